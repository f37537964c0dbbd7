"""The CPU preset's update, A/B: the CPU training path's changes, each toggled back, timed
interleaved on one fixed GRPO batch in one process.

    python benchmarks/cpu_update_ab.py [--threads 2] [--repeats 25]

Variants (cumulative, left to right):

- ``before``: the shared-prompt attention as per-segment gathers (two ``_attend_segments`` calls
  per layer, the layout before the ninth session), every log-prob chunk checkpointed, and
  torch's per-parameter AdamW loop (its CPU default);
- ``+plan``: :func:`rlkit.models.logprobs._shared_padded` (one cached padding plan per layout);
- ``+no-ckpt``: chunks below ``CHECKPOINT_MIN_LOGITS`` keep their logits for the backward;
- ``+foreach``: AdamW through torch's foreach kernels (rlkit's CPU default from the ninth to the
  eleventh session);
- ``+math-attn``: the padded-segment attention as two batched products
  (:data:`rlkit.models.logprobs.CPU_MATH_ATTENTION`) instead of SDPA (twelfth session);
- ``+index-select``: the training forward's row gathers through ``index_select``, whose backward
  is ``index_add_``, instead of indexing (:data:`rlkit.models.logprobs.CPU_INDEX_SELECT`);
- ``+fused-adamw``: AdamW through torch's fused CPU kernel -- all of today's defaults.

The first four compute the same values; the last three round differently. Prints the median and
minimum update time of each, its median time relative to ``before`` update by update (the
variants take turns, so a noisy machine's drift cancels in the ratio), and checks the
parameters after the same updates: ``+plan`` to ``+foreach`` equal ``before``'s bit for bit,
the last three agree with it to float rounding. One JSON line at the end.

The bit-for-bit check needs a quiet machine or ``--threads 1``. With two threads on a loaded
2-core machine, some reductions split differently from update to update, so even variants with
the same arithmetic can differ in the last bits; the smoke test runs it on one thread.
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

VARIANTS = ("before", "+plan", "+no-ckpt", "+foreach", "+math-attn", "+index-select", "+fused-adamw")
#: variants that compute exactly what ``before`` computes
BIT_IDENTICAL = VARIANTS[:4]


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

    planned, min_logits, math_attention, index_select = (L._shared_padded, L.CHECKPOINT_MIN_LOGITS, L.CPU_MATH_ATTENTION,
                                                         L.CPU_INDEX_SELECT)

    def configure(level: int) -> None:
        L._shared_padded = planned if level >= 1 else L._shared_segments
        L.CHECKPOINT_MIN_LOGITS = min_logits if level >= 2 else 0
        L.CPU_MATH_ATTENTION = math_attention if level >= 4 else False
        L.CPU_INDEX_SELECT = index_select if level >= 5 else False

    device = torch.device("cpu")
    wl, model, tok, texts = build("cpu", device)
    prompts = as_prompts(texts, tok)
    first = init(copy.deepcopy(model), adamw(lr=wl.lr), tokenizer=tok)
    batch = advantage(score(rollout(first, prompts, n=wl.n, max_new_tokens=wl.max_new_tokens), reward, tokenizer=tok), "grpo")
    # fused=False is torch's default, the per-parameter loop on CPU; None is rlkit's choice (fused)
    states = [init(copy.deepcopy(model), adamw(lr=wl.lr, fused=None if level >= 6 else False), tokenizer=tok)
              for level in range(len(VARIANTS))]
    for level in (3, 4, 5):  # foreach: a flag the optimizer reads at each step (no state exists yet)
        for group in states[level].optimizer.param_groups:
            group["foreach"] = True
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
    print(f"{'variant':13s} {'median':>9s} {'min':>9s} {'vs before':>10s}  parameters after {args.repeats} updates")
    for level, name in enumerate(VARIANTS):
        params = dict(states[level].actor.named_parameters())
        same = all(torch.equal(base[k], p) for k, p in params.items())
        gap = max(float((base[k] - p).detach().abs().max()) for k, p in params.items())
        med, low = statistics.median(times[level]), min(times[level])
        ratio = statistics.median(t / t0 for t, t0 in zip(times[level], times[0]))
        result["variants"][name] = {"update_ms_median": 1e3 * med, "update_ms_min": 1e3 * low, "paired_ratio_to_before": ratio,
                                    "bit_identical": same, "max_param_diff": gap}
        check = "= before, bit for bit" if same else f"differ from before by at most {gap:.1e}"
        print(f"{name:13s} {1e3 * med:7.2f}ms {1e3 * low:7.2f}ms {ratio:9.3f}x  {check}")
    print("RESULT_JSON " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
