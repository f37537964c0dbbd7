"""When compiling pays: the standard GRPO step eager and compiled, model size by model size.

    python benchmarks/compile_sizes.py --device cuda [--sizes 0.6M,6M,13M,24M,39M,129M,494M] [--steps 5] [--json out.json]

``rk.init(compile="auto")`` compiles the training blocks, and ``TorchEngine(compile_decode=None)``
the decode pieces, only for models of at least ``rlkit.models.compile.AUTO_MIN_PARAMS``
parameters: compiling costs tens of seconds up front, and a small model may never earn them back.
This script measures where that line should be. For each size it runs the standard step
(32 prompts x 8 samples, prompt 64 tokens, response 256 tokens, EOS ignored, old-policy and
reference passes, one update; ``_workload.PRESETS["qwen2.5-0.5b"]``) on a Qwen2-shaped random
model of that size, in two arms:

- ``eager``: ``init(compile=False)``, ``TorchEngine(compile_decode=False)``;
- ``compiled``: ``init(compile=True)``, ``TorchEngine(compile_decode=True)``.

The engine captures CUDA graphs in both arms. Each (size, arm) runs in a process of its own
with an empty inductor cache, as on a user's first run. Reported per arm: the first two steps
(they include compiling: the second recompiles for changing token counts), the median of the
steps after them, and the peak GPU memory. Per size: the saving per step and the break-even
point, the number of steps after which the compiled run has caught up with the eager one.

One table, then one ``RESULT_JSON`` line. ``--device cpu`` runs too (the smoke test uses it with
the smallest size); on a CPU compiling needs a C++ compiler.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _workload import PRESETS, Clock, child_json, emit_result, grpo_phases, reward, sync, word_prompts, word_tokenizer  # noqa: E402

#: name -> (hidden, layers, attention heads, kv heads, intermediate, vocabulary); the names are
#: the parameter counts (tied embeddings)
SIZES = {
    "0.6M": (128, 2, 4, 2, 512, 1024),
    "6M": (256, 4, 4, 2, 1024, 8192),
    "13M": (320, 6, 5, 1, 1280, 12288),
    "24M": (384, 8, 6, 2, 1536, 16384),
    "39M": (512, 8, 8, 2, 2048, 16384),
    "129M": (768, 12, 12, 4, 3072, 32768),
    "494M": (896, 24, 14, 2, 4864, 151936),  # Qwen2.5-0.5B's shape
}
ARMS = ("eager", "compiled")
WARM = 2  # steps counted as start-up: the first compiles, the second recompiles with dynamic sizes


def shape(name: str) -> dict:
    """The ``rlkit.models.tiny`` overrides of size ``name`` (on the ``qwen2.5-0.5b`` preset)."""
    if name not in SIZES:
        raise ValueError(f"unknown size {name!r}; choose from {', '.join(SIZES)}")
    hidden, layers, heads, kv_heads, inter, _ = SIZES[name]
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=inter, head_dim=hidden // heads)


def build_sized(name: str, device: torch.device, wl=None, seed: int = 0):
    """``(model, tokenizer, prompt texts)`` for size ``name`` on workload ``wl``'s prompts (default the
    standard one), in ``wl.dtype``."""
    from rlkit.models import tiny

    overrides = shape(name)
    vocab = SIZES[name][-1]
    wl = wl or PRESETS["qwen2.5-0.5b"]
    tok = word_tokenizer(vocab)
    model = tiny(tok, size="qwen2.5-0.5b", seed=seed, dtype=wl.dtype, **overrides)
    return model.to(device), tok, word_prompts(wl, vocab, random.Random(seed))


def workload(device: torch.device, max_new_tokens: int | None = None, prompts: int | None = None):
    """The standard workload, bf16 on CUDA; float32 on a CPU (whose bf16 products may be far
    slower); ``max_new_tokens`` / ``prompts`` shrink it (the smoke test)."""
    import dataclasses

    wl = PRESETS["qwen2.5-0.5b"]
    changes = {"max_new_tokens": max_new_tokens, "n_prompts": prompts}
    changes = {k: v for k, v in changes.items() if v}
    if device.type != "cuda":
        changes["dtype"] = torch.float32
    return dataclasses.replace(wl, **changes)


def run_arm(size: str, arm: str, device: torch.device, steps: int, max_new_tokens: int | None = None,
            prompts: int | None = None) -> dict:
    """One (size, arm) in this process: ``WARM + steps`` GRPO steps; returns their times."""
    from rlkit.data import as_prompts
    from rlkit.optim import adamw
    from rlkit.state import init
    from rlkit.transforms.rollout import make_engine

    wl = workload(device, max_new_tokens, prompts)
    compiled = arm == "compiled"
    model, tok, texts = build_sized(size, device, wl)
    state = init(model, adamw(lr=wl.lr), tokenizer=tok, ref="copy", compile=compiled)
    state._cache["engine"] = make_engine(state, "torch", compile_decode=compiled)
    state._cache["engine_kind"] = "torch"
    prompts = as_prompts(texts, tok)
    times = []
    for i in range(WARM + steps):
        if device.type == "cuda" and i == WARM:
            torch.cuda.reset_peak_memory_stats(device)
        clock = Clock(device)
        t0 = time.perf_counter()
        state, _, _ = grpo_phases(state, prompts, wl, clock, reward, beta=wl.beta, micro_batch=wl.micro_batch)
        sync(device)
        times.append(time.perf_counter() - t0)
        print(f"{size} {arm} step {i}: {times[-1]:.3f}s", file=sys.stderr, flush=True)
    out = {
        "size": size, "arm": arm, "params": sum(p.numel() for p in model.parameters()),
        "startup_s": sum(times[:WARM]), "step_s": statistics.median(times[WARM:]), "steps_s": times,
    }
    if device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return out


def run_child(size: str, arm: str, args) -> dict:
    """``run_arm`` in a fresh process with an empty inductor cache."""
    with tempfile.TemporaryDirectory(prefix="rlkit-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "RLKIT_COMPILE": ""}
        cmd = [sys.executable, os.path.abspath(__file__), "--child", size, arm, "--device", args.device,
               "--steps", str(args.steps)]
        if args.max_new_tokens:
            cmd += ["--max-new-tokens", str(args.max_new_tokens)]
        if args.prompts:
            cmd += ["--prompts", str(args.prompts)]
        out = child_json(cmd, "ARM_JSON", env=env)
    if "error" in out:
        return {"size": size, "arm": arm, "error": out["error"]}
    return out


def summarize(arms: dict) -> dict:
    """Saving per step and break-even steps from one size's two arms."""
    eager, comp = arms.get("eager", {}), arms.get("compiled", {})
    if "step_s" not in eager or "step_s" not in comp:
        return {}
    saving = eager["step_s"] - comp["step_s"]
    extra = comp["startup_s"] - eager["startup_s"]
    out = {"speedup": eager["step_s"] / comp["step_s"], "saving_s": saving, "extra_startup_s": extra}
    # steps (after the two start-up steps) until the compiled run's total time is the eager one's
    out["break_even_steps"] = max(0.0, extra / saving) if saving > 0 else None
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {', '.join(SIZES)}")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, from eager, compiled")
    ap.add_argument("--steps", type=int, default=5, help=f"timed steps per arm after the {WARM} start-up steps")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the standard workload's 256")
    ap.add_argument("--prompts", type=int, default=None, help="default: the standard workload's 32 (8 samples each)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=2, metavar=("SIZE", "ARM"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for s in sizes:
        if s not in SIZES:
            ap.error(f"--sizes: unknown size {s!r}; choose from {', '.join(SIZES)}")
    for a in arms:
        if a not in ARMS:
            ap.error(f"--arms: unknown arm {a!r}; choose from {', '.join(ARMS)}")
    device = torch.device(args.device)
    if args.child:
        out = run_arm(*args.child, device, args.steps, args.max_new_tokens, args.prompts)
        print("ARM_JSON " + json.dumps(out), flush=True)
        return out

    from rlkit.models.compile import AUTO_MIN_PARAMS

    result = {"torch": torch.__version__, "device": str(device), "auto_min_params": AUTO_MIN_PARAMS,
              "steps": args.steps, "sizes": {}}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    for size in sizes:
        per = {arm: run_child(size, arm, args) for arm in arms}
        for arm, r in per.items():
            if "error" in r:
                print(f"{size} {arm} failed: {r['error']}", flush=True)
        result["sizes"][size] = {**per, **summarize(per)}
        print(json.dumps({size: result["sizes"][size]}, default=float), flush=True)

    print(f"\n{'size':>6} {'params':>12} {'arm':>9} {'first 2 steps':>14} {'step':>9} {'peak GB':>8}")
    for size, r in result["sizes"].items():
        for arm in arms:
            a = r.get(arm, {})
            if "step_s" not in a:
                print(f"{size:>6} {'':>12} {arm:>9} {'failed':>14}")
                continue
            peak = f"{a['peak_memory_gb']:.1f}" if "peak_memory_gb" in a else "-"
            print(f"{size:>6} {a['params']:>12,} {arm:>9} {a['startup_s']:>13.1f}s {a['step_s']:>8.3f}s {peak:>8}")
        if "speedup" in r:
            be = r["break_even_steps"]
            print(f"{'':>6} compiled: {r['speedup']:.2f}x a step, {r['extra_startup_s']:+.1f} s to start, "
                  + (f"even after {be:.0f} more steps" if be is not None else "never even"))
    emit_result(result, args.json)
    return result


if __name__ == "__main__":
    main()
