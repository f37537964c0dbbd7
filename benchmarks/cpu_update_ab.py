"""The CPU preset's update, A/B: the ninth session's three bit-identical changes to the training
path, each toggled back, timed interleaved on one fixed GRPO batch in one process.

    python benchmarks/cpu_update_ab.py [--threads 2] [--repeats 25]

Variants (cumulative, left to right):

- ``before``: the shared-prompt attention as per-segment gathers (two ``_attend_segments`` calls
  per layer, the layout before the ninth session), every log-prob chunk checkpointed, and
  torch's per-parameter AdamW loop (its CPU default);
- ``+plan``: :func:`rlkit.models.logprobs._shared_padded` (one cached padding plan per layout);
- ``+no-ckpt``: chunks below ``CHECKPOINT_MIN_LOGITS`` keep their logits for the backward;
- ``+foreach``: rlkit's CPU default AdamW (the foreach kernels) -- all of today's defaults.

Prints the median and minimum update time of each and checks that every variant's parameters,
after the same updates, equal ``before``'s bit for bit. One JSON line at the end.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

VARIANTS = ("before", "+plan", "+no-ckpt", "+foreach")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=25, help="updates per variant (the first 3 are not timed)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from _workload import build, reward

    from rlkit.data import as_prompts
    from rlkit.models import logprobs as L
    from rlkit.optim import adamw
    from rlkit.state import init
    from rlkit.transforms.advantage import advantage
    from rlkit.transforms.rollout import rollout
    from rlkit.transforms.score import score
    from rlkit.transforms.update import update

    planned, min_logits = L._shared_padded, L.CHECKPOINT_MIN_LOGITS

    def configure(level: int) -> None:
        L._shared_padded = planned if level >= 1 else L._shared_segments
        L.CHECKPOINT_MIN_LOGITS = min_logits if level >= 2 else 0

    device = torch.device("cpu")
    wl, model, tok, texts = build("cpu", device)
    prompts = as_prompts(texts, tok)
    first = init(copy.deepcopy(model), adamw(lr=wl.lr), tokenizer=tok)
    batch = advantage(score(rollout(first, prompts, n=wl.n, max_new_tokens=wl.max_new_tokens), reward, tokenizer=tok), "grpo")
    # fused=False is torch's default, the per-parameter loop on CPU; None is rlkit's choice (foreach)
    states = [init(copy.deepcopy(model), adamw(lr=wl.lr, fused=None if level >= 3 else False), tokenizer=tok)
              for level in range(len(VARIANTS))]
    times: list[list[float]] = [[] for _ in VARIANTS]
    try:
        for r in range(args.repeats):
            for level in range(len(VARIANTS)):
                configure(level)
                t = time.perf_counter()
                states[level], _ = update(states[level], batch, loss="ppo_clip", micro_batch_size=wl.micro_batch)
                if r >= 3:
                    times[level].append(time.perf_counter() - t)
    finally:
        configure(len(VARIANTS))
    base = dict(states[0].actor.named_parameters())
    result = {"threads": args.threads, "tokens": float(batch["response_mask"].sum()), "variants": {}}
    print(f"{'variant':12s} {'median':>9s} {'min':>9s}  parameters after {args.repeats} updates")
    for level, name in enumerate(VARIANTS):
        same = all(torch.equal(base[k], p) for k, p in states[level].actor.named_parameters())
        med, low = statistics.median(times[level]), min(times[level])
        result["variants"][name] = {"update_ms_median": 1e3 * med, "update_ms_min": 1e3 * low, "bit_identical": same}
        print(f"{name:12s} {1e3 * med:7.2f}ms {1e3 * low:7.2f}ms  {'= before, bit for bit' if same else 'DIFFER from before'}")
    print("RESULT_JSON " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
