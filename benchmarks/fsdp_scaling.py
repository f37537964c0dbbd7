"""FSDP2 training throughput on N GPUs at a fixed per-GPU batch, and the FSDP -> replicated weight sync.

    torchrun --nproc-per-node 1 benchmarks/fsdp_scaling.py --json one.json
    torchrun --nproc-per-node 2 benchmarks/fsdp_scaling.py --json two.json
    python benchmarks/fsdp_scaling.py --compare one.json two.json

The model is Qwen2.5-0.5B's shape (random init, float32 master weights, bf16 compute through
``rlkit.parallel.fsdp.shard_model``), wrapped as rlkit's ``LogprobModule`` (the FSDP root). A
step is the training forward (packed, varlen attention, chunked Triton log-probs), a
policy-gradient loss normalised by the global token count, backward (gradients summed over
ranks) and AdamW, over ``--rows`` rows per GPU of 64 prompt + 256 response tokens in micro-batches
of ``--micro``. Training tokens/s = all ranks' tokens / step time.

Weight sync: ``full_state_dict(cpu_offload=False)`` (all-gather of every shard to every rank)
then ``TorchEngine.load_weights`` into each rank's own bf16 generation copy (replicated layout),
timed together and apart; GB/s counts the engine's bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args) -> dict:
    from rlkit.engines import TorchEngine
    from rlkit.models import LogprobModule, tiny
    from rlkit.parallel.fsdp import full_state_dict, global_sum, shard_model
    from rlkit.parallel.mesh import default_device, device_mesh, init_distributed

    info = init_distributed()
    rank, world = info.rank, info.world_size
    device = default_device()
    vocab = 151936 if args.size == "qwen2.5-0.5b" else 512
    model = tiny(vocab, size=args.size, seed=0, dtype=torch.float32).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    engine_model = tiny(vocab, size=args.size, seed=1, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).to(device)
    engine = TorchEngine.from_model(engine_model)  # its own storage: a generation replica
    module = shard_model(LogprobModule(model), device_mesh(), gradient_reduction="sum")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-6)

    g = torch.Generator(device=device).manual_seed(1000 + rank)
    p, t = 64, 256
    prompt_ids = torch.randint(4, vocab, (args.rows, p), device=device, generator=g)
    response_ids = torch.randint(4, vocab, (args.rows, t), device=device, generator=g)
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    response_mask = torch.ones_like(response_ids, dtype=torch.bool)
    advantages = torch.randn(args.rows, t, device=device, generator=g)

    def step():
        optimizer.zero_grad(set_to_none=True)
        n_tokens = global_sum(response_mask.sum().float())
        for i in range(0, args.rows, args.micro):
            sl = slice(i, i + args.micro)
            lp, _ = module(prompt_ids[sl], prompt_mask[sl], response_ids[sl], response_mask[sl], with_entropy=True)
            loss = -(lp * advantages[sl] * response_mask[sl]).sum() / n_tokens
            loss.backward()
        optimizer.step()

    times = []
    for i in range(args.warmup + args.steps):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        _sync(device)
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = world * args.rows * (p + t)

    sync = []
    for _ in range(3):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        full = full_state_dict(module, cpu_offload=False)
        _sync(device)
        t1 = time.perf_counter()
        weights = {k[len("model."):] if k.startswith("model.") else k: v for k, v in full.items()}
        report = engine.load_weights(weights, version=1)
        _sync(device)
        sync.append((t1 - t0, time.perf_counter() - t1, report["bytes"]))
        del full, weights
    gather_s = statistics.median(s[0] for s in sync)
    load_s = statistics.median(s[1] for s in sync)
    engine_bytes = sync[-1][2]
    # reference bandwidth: a device-to-device copy of 2 GB, bytes read + written
    x = torch.empty(1024**3 if device.type == "cuda" else 1024**2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    y.copy_(x)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    _sync(device)
    copy_gbps = 2 * x.numel() * 2 * 5 / (time.perf_counter() - t0) / 1e9
    out = {
        "world_size": world,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": n_params,
        "rows_per_gpu": args.rows,
        "micro": args.micro,
        "step_seconds_median": step_s,
        "step_seconds_all": times,
        "train_tokens_per_s": tokens / step_s,
        "train_tflops_per_gpu": 6 * n_params * tokens / step_s / world / 1e12,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        "sync_gather_s": gather_s,
        "sync_load_s": load_s,
        "sync_total_s": gather_s + load_s,
        "sync_engine_bytes": engine_bytes,
        "sync_gbps": engine_bytes / (gather_s + load_s) / 1e9,
        "copy_gbps": copy_gbps,
    }
    dist.barrier()
    return out if rank == 0 else {}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128, help="rows per GPU per step")
    ap.add_argument("--micro", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--size", default="qwen2.5-0.5b", help="rlkit.models.PRESETS name ('tiny' for a CPU smoke run)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare", nargs=2, metavar=("ONE", "TWO"), help="print the scaling of two result files")
    args = ap.parse_args(argv)
    if args.compare:
        one, two = (json.load(open(f)) for f in args.compare)
        scaling = two["train_tokens_per_s"] / one["train_tokens_per_s"]
        print(f"training tokens/s: {one['world_size']} GPU {one['train_tokens_per_s']:,.0f}, "
              f"{two['world_size']} GPUs {two['train_tokens_per_s']:,.0f} -> {scaling:.2f}x")
        print(f"weight sync FSDP({two['world_size']}) -> replicated: {two['sync_total_s'] * 1e3:.1f} ms "
              f"(gather {two['sync_gather_s'] * 1e3:.1f} ms + load {two['sync_load_s'] * 1e3:.1f} ms), "
              f"{two['sync_gbps']:.1f} GB/s vs device copy {two['copy_gbps']:.0f} GB/s")
        print("SCALING_JSON " + json.dumps({"scaling": scaling, "one": one, "two": two}))
        return
    result = run(args)
    if result:
        print("FSDP_JSON " + json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    from rlkit.parallel.mesh import shutdown

    shutdown()


if __name__ == "__main__":
    main()
