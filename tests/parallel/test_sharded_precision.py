"""Pipeline.lower over a bf16 model on 2 processes (one process lowers to itself: the master copies stay): the optimizer is rebuilt over FSDP's DTensor shards, where
float32 master copies are not kept (MasterWeightAdamW steps plain tensors), so lowering warns that
most of each step rounds away, and says to give a float32 model with FSDP mixed precision instead;
a float32 model lowers without the warning, and master_weights=True over shards is an error."""
from __future__ import annotations

import warnings

import pytest
import torch

import rlkit as rk

pytestmark = pytest.mark.distributed


def _worker(dtype_name: str, master_weights):
    from rlkit.parallel import init_distributed, shutdown

    init_distributed("gloo")
    try:
        task = rk.tasks.arithmetic(n_train=16, n_test=4)
        model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1).to(getattr(torch, dtype_name))
        state = rk.init(model, rk.optim.adamw(lr=1e-6, master_weights=master_weights), tokenizer=task.tokenizer)
        plan = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                state = plan.shard(state)
            except ValueError as exc:
                return {"error": str(exc)}
        return {"warnings": [str(w.message) for w in caught if "Pipeline.lower" in str(w.message)],
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
