"""A short GRPO run with the vLLM engine learns as with the built-in engine.

Runs in the vLLM environment (see .ci/run); skipped with the reason shown where vllm is not
importable. Same seed, same recipe, same reward; only ``engine=`` differs.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed; install it with `bash .ci/install_vllm.sh`")


def _run(engine: str, steps: int = 20):
    import rlkit as rk

    task = rk.tasks.arithmetic(n_train=256, n_test=8)
    model = rk.models.tiny(task.tokenizer, seed=0)  # head_dim 32: vLLM's CPU attention needs >= 32

    def sevens(completions, **_):
        return [sum(ch == "7" for ch in c) / 4 for c in completions]

    state = rk.init(model, rk.optim.adamw(lr=1e-3, weight_decay=0.0), tokenizer=task.tokenizer, seed=0)
    recipe = rk.recipes.get("grpo").with_(n=8, max_new_tokens=4, engine=engine)
    rewards, gaps, syncs = [], [], []
    for i in range(steps):
        state, metrics = recipe.step(state, task.train.batch_at(i, 8), sevens)
        rewards.append(metrics["reward/mean"])
        gaps.append(metrics["actor/logprob_gap"])
        syncs.append(metrics.get("rollout/sync/bytes", metrics.get("sync/bytes", 0.0)))
    engine_obj = state._cache.get("engine")
    if hasattr(engine_obj, "close"):
        engine_obj.close()
    return rewards, gaps, syncs


def test_grpo_with_vllm_learns_like_the_builtin_engine():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    r_vllm, gaps, syncs = _run("vllm")
    r_torch, _, _ = _run("torch")
    first_v, last_v = sum(r_vllm[:3]) / 3, sum(r_vllm[-3:]) / 3
    first_t, last_t = sum(r_torch[:3]) / 3, sum(r_torch[-3:]) / 3
    assert last_v > first_v + 0.3, r_vllm
    assert last_t > first_t + 0.3, r_torch
    assert abs(last_v - last_t) < 0.3, (r_vllm, r_torch)  # same learning, different samples
    # the engine was synced after every update and sampled with the trainer's weights
    assert max(gaps) < 1e-3, gaps
    assert all(s > 0 for s in syncs[1:]), syncs
