"""Measure weight sync (train -> generate) and FSDP training throughput. Run it on every rank:

    torchrun --nproc-per-node 2 benchmarks/weight_sync.py --check --sync --train
    torchrun --nproc-per-node 1 benchmarks/weight_sync.py --train      # the 1-GPU baseline
    torchrun --nproc-per-node 2 benchmarks/weight_sync.py --check --sync --tiny   # CPU smoke run (gloo)

The model is Qwen2.5-0.5B-shaped with random init (no weights are downloaded); ``--tiny`` keeps
its structure at a width a CPU syncs in milliseconds. Rank 0 prints one JSON line per
measurement and, with ``--json``, writes them all to one file. Sync numbers: ``seconds`` per sync (median of ``--repeats``),
``gbps`` = bytes delivered to a rank / seconds, against ``copy_gbps``, a plain peer copy of
the same number of bytes from GPU 0 to GPU 1 (bytes / seconds). Every sync is also checked for
exact equality with the training weights.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def qwen25_05b_config(**overrides):
    from transformers import Qwen2Config

    shape = dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    )
    shape.update(overrides)
    return Qwen2Config(**shape)


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float | None:
    """GB/s of a GPU0 -> GPU1 copy of ``nbytes`` (None without two visible GPUs)."""
    if torch.cuda.device_count() < 2:
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def bench_sync(model, layouts: dict, repeats: int, reference: dict[str, torch.Tensor]) -> list[dict]:
    from rlkit.parallel.mesh import world
    from rlkit.parallel.reshard import gather_weights, shard_dim

    info = world()
    rows = []
    for name, layout in layouts.items():
        reports = []
        for _ in range(repeats + 1):
            weights, report = gather_weights(model, layout)
            reports.append(report)
        tp = layout.tp
        exact = True
        for key, value in weights.items():
            full = reference[key].to(value.dtype)
            dim = shard_dim(key, full.dim(), layout.plan) if tp > 1 else None
            expected = full if dim is None else full.chunk(tp, dim)[info.rank % tp]
            exact &= bool(torch.equal(value, expected.to(value.device)))
        del weights
        seconds = statistics.median(r.seconds for r in reports[1:])
        rows.append({
            "what": "weight_sync", "layout": name, "world": info.world_size, "exact": exact,
            "gbytes": reports[-1].bytes / 1e9, "seconds": seconds, "gbps": reports[-1].bytes / seconds / 1e9,
            "buckets": reports[-1].buckets, "peak_buffer_gbytes": reports[-1].peak_buffer_bytes / 1e9,
        })
    return rows


def bench_train(model, steps: int, batch: int, seq: int, vocab: int) -> dict:
    from rlkit.parallel.mesh import world

    info = world()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    generator = torch.Generator(device=info.device).manual_seed(info.rank)
    times = []
    for _ in range(steps + 2):
        ids = torch.randint(0, vocab, (batch, seq), device=info.device, generator=generator)
        _sync_device(info.device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync_device(info.device)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[2:])
    return {
        "what": "train", "world": info.world_size, "per_gpu_batch": [batch, seq], "step_seconds": step,
        "tokens_per_second": info.world_size * batch * seq / step, "tokens_per_second_per_gpu": batch * seq / step,
        "max_memory_gbytes": torch.cuda.max_memory_allocated() / 1e9 if info.device.type == "cuda" else None,
    }


#: ``--tiny``: the same architecture (grouped-query attention, tied embeddings) at a CPU smoke
#: run's size
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


def check_fsdp_equivalence() -> dict:
    """FSDP over all ranks (each 1/n of the batch, SUM reduction, global token normaliser) vs. a
    plain model on the full batch, on this device: max gradient and parameter differences."""
    from transformers import Qwen2ForCausalLM

    from rlkit.parallel.fsdp import global_sum, shard_model
    from rlkit.parallel.mesh import device_mesh, world

    info = world()
    config = qwen25_05b_config(**{**TINY, "vocab_size": 40, "tie_word_embeddings": False})

    def build():
        torch.manual_seed(0)
        with torch.device(info.device):
            return Qwen2ForCausalLM(config)

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (4 * info.world_size, 9), generator=g).to(info.device)
    mask = (torch.rand(ids.shape[0], 8, generator=g) > 0.3).to(info.device)

    def loss_of(model, ids, mask, n_tokens):
        logp = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return -(logp * mask).sum() / n_tokens

    ref = build()
    loss_of(ref, ids, mask, mask.sum()).backward()
    torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6).step()
    model = shard_model(build(), device_mesh(), mixed_precision=False, gradient_reduction="sum")
    rows = slice(info.rank * 4, (info.rank + 1) * 4)
    loss_of(model, ids[rows], mask[rows], global_sum(mask[rows].sum())).backward()
    grad_err = max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6).step()
    param_err = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return {"what": "fsdp_vs_single", "world": info.world_size, "grad_err": grad_err, "param_err": param_err}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sync", action="store_true", help="measure weight sync layouts")
    parser.add_argument("--train", action="store_true", help="measure FSDP training throughput")
    parser.add_argument("--check", action="store_true", help="check FSDP == single device on a tiny model")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smaller/faster runs)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same architecture (CPU smoke runs)")
    parser.add_argument("--json", default=None, help="rank 0 also writes every row here, as one JSON list")
    args = parser.parse_args(argv)

    from transformers import Qwen2ForCausalLM

    from rlkit.parallel.fsdp import full_state_dict, shard_model
    from rlkit.parallel.mesh import device_mesh, init_distributed, shutdown
    from rlkit.parallel.reshard import replicated, tensor_parallel

    info = init_distributed()
    checks = [check_fsdp_equivalence()] if args.check else []
    shape = dict(TINY) if args.tiny else {}
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    config = qwen25_05b_config(**shape)
    torch.manual_seed(0)
    with torch.device(info.device):
        model = Qwen2ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    shard_model(model, device_mesh())
    rows: list[dict] = checks + [{"what": "model", "params": n_params, "device": str(info.device), "world": info.world_size}]
    if args.sync and info.world_size > 1:
        reference = full_state_dict(model, cpu_offload=False)
        layouts = {"replicated_fp32": replicated(), "replicated_bf16": replicated(dtype=torch.bfloat16)}
        if info.world_size % 2 == 0:
            layouts["tp2_bf16"] = tensor_parallel(2, dtype=torch.bfloat16)
        rows += bench_sync(model, layouts, args.repeats, reference)
        del reference
        fp32_bytes = n_params * 4
        if info.rank == 0:
            rows.append({"what": "peer_copy", "gbytes": fp32_bytes / 1e9, "copy_gbps": copy_bandwidth(fp32_bytes)})
    if args.train:
        rows.append(bench_train(model, args.steps, args.batch, args.seq, config.vocab_size))
    if info.rank == 0:
        for row in rows:
            print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
