"""The rollout engine when the longest prompt changes from call to call, as it does with real data.

    python benchmarks/prompt_widths.py --preset qwen2.5-0.5b --device cuda [--calls 6] [--json out.json]

``TorchEngine`` keeps one decode plan (KV cache and CUDA graphs) for the prompt width it was built
for. A call with another width builds a new plan and captures its graphs again. Prompts are
therefore left-padded to a multiple of ``prompt_bucket`` tokens. This script times the standard
workload's rollout (32 prompts x 8 samples, 256 new tokens, EOS ignored) three ways, in one
process, call by call:

- ``fixed``: every prompt exactly ``prompt_tokens`` long (the standard workload);
- ``varied, prompt_bucket=1``: the longest prompt moves between calls (``prompt_tokens`` - 7 ..
  ``prompt_tokens``), padded only to the longest (the engine before ``prompt_bucket``);
- ``varied, default``: the same prompts with the engine's default ``prompt_bucket``.

It prints each arm's median call time and tokens/s, and the greedy tokens of the two varied arms
on the same prompts (equal but for the rounding of the extra padding). One JSON line at the end.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _workload import PRESETS, build, emit_result, sync  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=6, help="timed calls per arm (after one warm-up call)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the preset's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error(f"--calls must be >= 1, got {args.calls}")
    device = torch.device(args.device)

    from rlkit.engines import SamplingParams, TorchEngine

    wl, model, tok, _ = build(args.preset, device)
    model.eval()
    vocab = model.config.vocab_size
    steps = args.max_new_tokens or wl.max_new_tokens
    rng = random.Random(0)
    top = wl.prompt_tokens

    def prompts(width: int) -> list[list[int]]:
        # one prompt of exactly `width` tokens, the others up to 8 shorter
        lengths = [width] + [rng.randint(max(1, width - 8), width) for _ in range(wl.n_prompts - 1)]
        return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]

    widths = [top - (i * 3) % 8 for i in range(args.calls + 1)]  # e.g. 64, 61, 58, 63, 60, 57, 62
    varied = [prompts(w) for w in widths]
    fixed = [prompts(top) for _ in widths]
    sampled = SamplingParams(n=wl.n, max_new_tokens=steps, temperature=1.0, ignore_stop=True)

    def timed(engine, calls) -> list[float]:
        out = []
        for batch in calls:
            sync(device)
            t = time.perf_counter()
            engine.generate(batch, sampled)
            sync(device)
            out.append(time.perf_counter() - t)
        return out[1:]  # the first call builds the plan (and compiles)

    arms = {
        "fixed": (dict(), fixed),
        "varied, prompt_bucket=1": (dict(prompt_bucket=1), varied),
        "varied, default": (dict(), varied),
    }
    result = {"preset": args.preset, "device": str(device), "torch": torch.__version__, "rows": wl.rows,
              "max_new_tokens": steps, "widths": widths, "arms": {}}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    engines = {}
    for name, (options, calls) in arms.items():
        engine = TorchEngine.from_model(model, **options)
        engines[name] = engine
        seconds = timed(engine, calls)
        med = statistics.median(seconds)
        result["arms"][name] = {"seconds": seconds, "median_s": med, "tokens_per_s": wl.rows * steps / med,
                                "prompt_bucket": engine.prompt_bucket, "cuda_graphs": engine.cuda_graphs}
        print(f"{name:26s} median {med:.3f} s ({wl.rows * steps / med:,.0f} tokens/s); calls "
              + ", ".join(f"{s:.3f}" for s in seconds), flush=True)
        engine.release()

    # the padding changes rounding only: greedy tokens of the two varied arms on the same prompts
    greedy = SamplingParams(n=1, max_new_tokens=min(steps, 64), temperature=0.0, ignore_stop=True)
    a = engines["varied, prompt_bucket=1"].generate(varied[1], greedy).response_ids
    b = engines["varied, default"].generate(varied[1], greedy).response_ids
    result["greedy_first_token_equal"] = float((a[:, 0] == b[:, 0]).float().mean())
    result["greedy_tokens_equal"] = float((a == b).float().mean())
    base = result["arms"]["varied, prompt_bucket=1"]["median_s"]
    result["speedup_default_vs_unbucketed"] = base / result["arms"]["varied, default"]["median_s"]
    print(f"varied widths: default prompt_bucket {result['speedup_default_vs_unbucketed']:.2f}x the engine padding "
          f"to the longest prompt only; greedy tokens equal {result['greedy_tokens_equal']:.3f} "
          f"(first token {result['greedy_first_token_equal']:.3f})", flush=True)
    emit_result(result, args.json)
    return result


if __name__ == "__main__":
    main()
