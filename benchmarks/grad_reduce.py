"""FSDP2 gradient reduction per micro-batch against once per optimizer step, side by side.

    python benchmarks/grad_reduce.py --local 2 --threads 1                 # CPU: 2 gloo processes
    torchrun --nproc-per-node 2 benchmarks/grad_reduce.py --preset qwen2.5-0.5b --rows 64 --micro 16

Two copies of one model are lowered with ``Pipeline.lower(grad_reduce="micro_batch")`` (the
default) and ``grad_reduce="step"`` on the same ranks, and ``rk.update`` alternates between them
on the same fixed batch (``--rows`` rows a rank in micro-batches of ``--micro``), so both see the
same drift of a noisy machine. Prints, per mode: the median update time, the reduce-scatters per
update (counted at ``torch.distributed``'s entry points), the peak GPU memory on CUDA; then the
paired ratio ``step / micro_batch`` and the largest parameter difference between the two copies
after all updates (float rounding only: the reductions add in another order). One JSON line.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def count_reduce_scatters() -> list:
    """Wrap torch.distributed's reduce-scatter entry points (FSDP2 calls them through the module);
    returns the list that gets one entry per call."""
    import torch.distributed as dist

    calls: list = []
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        real = getattr(dist, name, None)
        if real is not None:
            setattr(dist, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    return calls


def run(preset: str, rows: int, micro: int, repeats: int, threads: int | None) -> dict:
    import rlkit as rk
    from _workload import build
    from rlkit.batch import make_batch
    from rlkit.parallel import full_state_dict, init_distributed
    from rlkit.parallel.mesh import default_device

    if threads:
        torch.set_num_threads(threads)
    info = init_distributed()
    device = default_device()
    calls = count_reduce_scatters()
    g = torch.Generator().manual_seed(1000 + info.rank)
    states = {}
    for mode in ("micro_batch", "step"):
        wl, model, tok, _ = build(preset, device)  # the same seed: identical copies
        vocab = model.config.vocab_size
        state = rk.init(model, rk.optim.adamw(lr=1e-5), tokenizer=tok)
        plan = rk.Pipeline(rk.recipes.get("grpo"), reward=lambda completions, **_: [0.0] * len(completions)).lower(grad_reduce=mode)
        states[mode] = plan.shard(state)
    n = rows * info.world_size
    g = torch.Generator().manual_seed(0)
    p_len, t_len = (8, 16) if preset.startswith("cpu") else (64, 256)
    prompts = [torch.randint(4, vocab, (p_len,), generator=g).tolist() for _ in range(n // 8) for _ in range(8)]
    responses = [torch.randint(4, vocab, (int(torch.randint(t_len // 2, t_len + 1, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    batch = make_batch(prompts, responses, group=[i // 8 for i in range(n)], rewards=torch.rand(n, generator=g).tolist())
    batch.set("logprobs", -torch.rand(batch["response_mask"].shape, generator=g) * batch["response_mask"])
    batch = rk.advantage(batch, "grpo")

    times: dict[str, list[float]] = {m: [] for m in states}
    counts: dict[str, int] = {}
    peak: dict[str, float] = {}
    for i in range(repeats + 1):
        for mode in states:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            before = len(calls)
            t0 = time.perf_counter()
            states[mode], _ = rk.update(states[mode], batch, micro_batch_size=micro, max_logprob_gap=None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peak[mode] = torch.cuda.max_memory_allocated(device) / 1e9
            if i:  # the first update of each is a warm-up
                times[mode].append(time.perf_counter() - t0)
            counts[mode] = len(calls) - before
    full = {m: full_state_dict(s._cache["actor_module"]) for m, s in states.items()}
    diff = max(((full["step"][k].float() - v.float()).abs().max().item() for k, v in full["micro_batch"].items()), default=0.0)
    out = {
        "preset": preset, "device": device.type, "world_size": info.world_size, "rows_per_rank": rows, "micro_batch": micro,
        "micro_batches_per_update": rows // micro, "repeats": repeats,
        "modes": {m: {"update_ms_median": 1e3 * statistics.median(t), "reduce_scatters_per_update": counts[m],
                      **({"peak_gb": peak[m]} if m in peak else {})} for m, t in times.items()},
        "ratio_step_to_micro_batch": statistics.median(b / a for a, b in zip(times["micro_batch"], times["step"])),
        "max_param_diff": diff,
    }
    return out if info.rank == 0 else {}


def _worker(preset, rows, micro, repeats, threads):
    from rlkit.parallel import shutdown

    try:
        return run(preset, rows, micro, repeats, threads)
    finally:
        shutdown()


def main(argv=None) -> dict:
    from _workload import emit_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu", choices=("cpu", "qwen2.5-0.5b"))
    ap.add_argument("--rows", type=int, default=32, help="rows a rank per update")
    ap.add_argument("--micro", type=int, default=4, help="micro-batch rows")
    ap.add_argument("--repeats", type=int, default=10, help="timed updates of each mode")
    ap.add_argument("--local", type=int, default=0, help="spawn this many local processes (gloo on CPU) instead of torchrun")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rows % args.micro:
        ap.error(f"--micro {args.micro} must divide --rows {args.rows}")
    if args.rows * max(args.local, 1) % 8:
        ap.error("the global batch (rows x ranks) must be a whole number of groups of 8")
    if args.local:
        from rlkit.parallel.local import run_local

        res = run_local(_worker, args.local, args.preset, args.rows, args.micro, args.repeats, args.threads,
                        timeout=1200, threads=args.threads or 1)[0]
    else:
        res = _worker(args.preset, args.rows, args.micro, args.repeats, args.threads)
        if not res:
            return res
    print(f"{'mode':<12} {'update ms':>10} {'reduce-scatters':>16} {'peak GB':>8}")
    for mode, m in res["modes"].items():
        print(f"{mode:<12} {m['update_ms_median']:>10.1f} {m['reduce_scatters_per_update']:>16} {m.get('peak_gb', float('nan')):>8.2f}")
    print(f"step / micro_batch (paired median): {res['ratio_step_to_micro_batch']:.3f}; "
          f"largest parameter difference {res['max_param_diff']:.2e}")
    emit_result(res, args.json)
    return res


if __name__ == "__main__":
    main()
