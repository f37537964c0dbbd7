"""Pipeline.lower over a bf16 model on 2 processes (one process lowers to itself: the master copies stay): the optimizer is rebuilt over FSDP's DTensor shards, where
float32 master copies are not kept (MasterWeightAdamW steps plain tensors), so lowering warns that
most of each step rounds away, and says to give a float32 model with FSDP mixed precision instead;
a float32 model lowers without the warning, and master_weights=True over shards is an error; a
float16 model warns that its shards' float16 AdamW moments blow up at the usual eps."""
from __future__ import annotations

import warnings

import pytest
import torch

import rlkit as rk

pytestmark = pytest.mark.distributed


def _worker(dtype_name: str, master_weights, lr=1e-6, eps=1e-8):
    from rlkit.parallel import init_distributed, shutdown

    init_distributed("gloo")
    try:
        task = rk.tasks.arithmetic(n_train=16, n_test=4)
        model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1).to(getattr(torch, dtype_name))
        state = rk.init(model, rk.optim.adamw(lr=lr, eps=eps, master_weights=master_weights), tokenizer=task.tokenizer)
        plan = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                state = plan.shard(state)
            except ValueError as exc:
                return {"error": str(exc)}
        if master_weights is None and dtype_name == "float16":
            # what the warning says: step the shards (float16 moments) with gradients too small to square
            start = [p.detach().to_local().float().clone() for p in state.actor.parameters()]
            for step in range(5):
                g = torch.Generator().manual_seed(step)
                for p in state.actor.parameters():
                    full = (torch.randn(p.shape, generator=g) * 1e-4).half()  # the same on every rank
                    p.grad = torch.distributed.tensor.distribute_tensor(full, p.device_mesh, p.placements)
                state.optimizer.step()
            moved = max(float((p.detach().to_local().float() - s).abs().max())
                        for p, s in zip(state.actor.parameters(), start) if s.numel())
        else:
            moved = None
        return {"warnings": [str(w.message) for w in caught if "Pipeline.lower" in str(w.message)], "moved": moved,
                "optimizer": type(state.optimizer).__name__}
    finally:
        shutdown()


def test_lowering_a_bf16_model_warns_and_a_float32_one_does_not():
    from rlkit.parallel.local import run_local

    for bf16 in run_local(_worker, 2, "bfloat16", None, timeout=180, device="cpu"):
        (message,) = bf16["warnings"]
        assert "the actor's sharded trainable weights are bf16/fp16" in message and "mixed_precision=True" in message
        assert bf16["optimizer"] == "AdamW"
    for fp32 in run_local(_worker, 2, "float32", None, timeout=180, device="cpu"):
        assert fp32["warnings"] == [] and fp32["optimizer"] == "AdamW"
    for forced in run_local(_worker, 2, "bfloat16", True, timeout=180, device="cpu"):
        assert "master_weights=True, but the parameters are FSDP-sharded" in forced["error"]


def test_lowering_a_float16_model_warns_of_its_float16_moments_where_eps_lets_them_blow_up():
    """One process's float16 weights step in MasterWeightAdamW (float32 moments); the shards keep
    float16 moments, whose second moment underflows for small gradients: with eps=1e-8 five steps of
    lr=1e-3 move a weight by far more than AdamW's at most 5 * lr, with eps=1e-4 they do not."""
    from rlkit.parallel.local import run_local

    for small in run_local(_worker, 2, "float16", None, 1e-3, 1e-8, timeout=180, device="cpu"):
        (message,) = small["warnings"]
        assert "sharded trainable weights are float16" in message and "moments in float16" in message
        assert "eps=1e-08" in message and "mixed_precision=True" in message and "eps >= 0.0001" in message
        assert small["moved"] > 100 * 5e-3  # what the warning is about: steps hundreds of times lr
    for safe in run_local(_worker, 2, "float16", None, 1e-3, 1e-4, timeout=180, device="cpu"):
        assert safe["warnings"] == []
        assert safe["moved"] < 5 * 5e-3
