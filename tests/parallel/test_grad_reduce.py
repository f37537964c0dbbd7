"""``Pipeline.lower(grad_reduce="step")``: one gradient reduce-scatter per optimizer step.

Two gloo processes, four micro-batches per rank. Checked against one process and against the
default (``"micro_batch"``): the same parameters after the update, the same metrics, a quarter of
the reduce-scatters; and an update that fails between micro-batches leaves no gradient behind for
the next one.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import rlkit as rk

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from grad_reduce import count_reduce_scatters  # noqa: E402  (benchmarks/grad_reduce.py)

pytestmark = pytest.mark.distributed


def _setup(with_critic: bool = False):
    from rlkit.batch import make_batch

    task = rk.tasks.arithmetic(n_train=64, n_test=8)
    model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=64, intermediate_size=128,
                           num_attention_heads=2, num_key_value_heads=1)
    g = torch.Generator().manual_seed(5)
    prompts = [task.train.ids[i] for i in range(2) for _ in range(4)]
    responses = [torch.randint(4, 19, (int(k),), generator=g).tolist() for k in [1, 5, 3, 6, 2, 2, 4, 1]]
    batch = make_batch(prompts, responses, group=[0] * 4 + [1] * 4, rewards=[1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    batch.set("logprobs", -torch.rand(batch["response_mask"].shape, generator=g) * batch["response_mask"])
    batch = rk.advantage(batch, "grpo")
    critic = None
    if with_critic:  # PPO: the critic's update reduces its gradients the same way
        critic = rk.models.critic(model)
        batch.set("values", 0.1 * torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"])
        batch.set("returns", torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"])
    # eps=1: Adam's first step ~ lr * g, so the comparison measures gradients, not float-noise signs
    state = rk.init(model, rk.optim.adamw(lr=1e-2, eps=1.0, weight_decay=0.0), tokenizer=task.tokenizer, critic=critic)
    return task, state, batch


class _FailOnce:
    """ppo_clip, except that its ``fail_at``-th call raises (a failure between micro-batches)."""

    def __init__(self, fail_at: int | None):
        self.calls, self.fail_at = 0, fail_at

    def __call__(self, logprobs, old_logprobs, advantages, mask, **kw):
        from rlkit.algos.losses import ppo_clip

        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return ppo_clip(logprobs, old_logprobs, advantages, mask, **kw)


def _worker(grad_reduce: str, fail_first: bool, mixed_precision: bool = False, with_critic: bool = False):
    from rlkit.parallel import full_state_dict, init_distributed, shutdown

    init_distributed("gloo")
    try:
        task, state, batch = _setup(with_critic)
        calls = count_reduce_scatters()
        plan = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower(grad_reduce=grad_reduce, mixed_precision=mixed_precision)
        state = plan.shard(state)
        failed = None
        if fail_first:
            # the second micro-batch's loss raises: the first one's gradients are unreduced then
            try:
                rk.update(state, batch, loss=_FailOnce(2), micro_batch_size=1, max_logprob_gap=None)
            except RuntimeError as exc:
                failed = str(exc)
        n_before = len(calls)
        state, metrics = rk.update(state, batch, loss=_FailOnce(None), micro_batch_size=1, max_logprob_gap=None)
        n_calls = len(calls) - n_before
        actor = full_state_dict(state._cache["actor_module"])
        critic = full_state_dict(state._cache["critic_module"]) if with_critic else None
        return {"actor": actor, "critic": critic, "metrics": metrics, "reduce_scatters": n_calls, "failed": failed}
    finally:
        shutdown()


@pytest.fixture(scope="module")
def single():
    _, state, batch = _setup()
    state, metrics = rk.update(state, batch, loss=_FailOnce(None), micro_batch_size=1, max_logprob_gap=None)
    return {k: v.clone() for k, v in state.actor.state_dict().items()}, metrics


def _check(results, single):
    ref, metrics = single
    # the full state dict is gathered to rank 0 only
    got = {k[len("model."):]: v for k, v in results[0]["actor"].items() if k.startswith("model.")}
    assert got, results[0]["actor"].keys()
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, atol=2e-6, rtol=1e-5, msg=name)
    for result in results:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert result["metrics"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key


def test_step_reduces_once_per_step_and_equals_one_process(single):
    from rlkit.parallel.local import run_local

    every = run_local(_worker, 2, "micro_batch", False, timeout=240)
    once = run_local(_worker, 2, "step", False, timeout=240)
    _check(every, single)
    _check(once, single)
    # 4 micro-batches a rank: FSDP's units (2 blocks and the root) reduce 4 times each, or once
    n_every, n_once = every[0]["reduce_scatters"], once[0]["reduce_scatters"]
    assert n_every > 0 and n_every == 4 * n_once, (n_every, n_once)


def test_failed_update_leaves_no_unreduced_gradient(single):
    from rlkit.parallel.local import run_local

    results = run_local(_worker, 2, "step", True, timeout=240)
    assert all(r["failed"] == "injected failure" for r in results)
    # had the first micro-batch's unreduced gradient survived, FSDP would add it into this update's
    _check(results, single)


def test_ppo_critic_reduces_once_per_step_too():
    from rlkit.parallel.local import run_local

    _, state, batch = _setup(with_critic=True)
    state, metrics = rk.update(state, batch, loss=_FailOnce(None), micro_batch_size=1, max_logprob_gap=None)
    results = run_local(_worker, 2, "step", False, False, True, timeout=240)
    _check(results, ({k: v.clone() for k, v in state.actor.state_dict().items()}, metrics))
    got = {k[len("critic."):]: v for k, v in results[0]["critic"].items() if k.startswith("critic.")} or \
        {k[len("model."):]: v for k, v in results[0]["critic"].items() if k.startswith("model.")}
    assert got, results[0]["critic"].keys()
    for name, value in state.critic.state_dict().items():
        torch.testing.assert_close(got[name], value, atol=2e-6, rtol=1e-5, msg=name)
    for r in results:
        assert r["metrics"]["critic/vf_loss"] == pytest.approx(metrics["critic/vf_loss"], rel=1e-5)
    # once per FSDP unit of each trained model: the actor's 3 and the critic's 3
    assert results[0]["reduce_scatters"] == 6


def test_mixed_precision_accumulates_in_float32_and_drops_it_on_failure():
    """bf16 compute, float32 reduction: FSDP2 accumulates the unreduced gradients in a float32
    copy of its own (``unsharded_accumulated_grad``), the path a GPU run takes."""
    from rlkit.parallel.local import run_local

    every = run_local(_worker, 2, "micro_batch", False, True, timeout=240)
    clean = run_local(_worker, 2, "step", False, True, timeout=240)
    failed = run_local(_worker, 2, "step", True, True, timeout=240)
    assert all(r["failed"] == "injected failure" for r in failed)
    assert clean[0]["reduce_scatters"] * 4 == every[0]["reduce_scatters"] > 0
    for name, value in clean[0]["actor"].items():
        # the retried update computes exactly what a clean one does
        torch.testing.assert_close(failed[0]["actor"][name], value, atol=0, rtol=0, msg=name)
        # the same update as reducing every micro-batch, up to bf16 rounding
        torch.testing.assert_close(every[0]["actor"][name], value, atol=1e-4, rtol=1e-3, msg=name)


def test_grad_reduce_is_checked():
    with pytest.raises(ValueError, match="grad_reduce must be one of 'micro_batch', 'step'"):
        rk.Pipeline(rk.recipes.get("grpo"), reward=lambda **_: [0.0]).lower(grad_reduce="epoch")


def test_param_groups_are_found_on_either_fsdp2_layout():
    """FSDP2 keeps a unit's parameter groups in ``_fsdp_param_groups`` (newer torch) or in one
    ``_fsdp_param_group`` (torch <= 2.11, the GPU image's). Reading only the first silently kept a
    failed update's gradients on torch 2.11 (found on the H200); neither is an error, never a no-op."""
    from types import SimpleNamespace

    from rlkit.parallel.fsdp import _param_groups

    def unit(**state):
        return SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**state))

    assert _param_groups(unit(_fsdp_param_groups=["a", "b"])) == ["a", "b"]
    assert _param_groups(unit(_fsdp_param_group="a")) == ["a"]
    assert _param_groups(unit(_fsdp_param_group=None)) == []
    with pytest.raises(RuntimeError, match="_fsdp_param_groups nor _fsdp_param_group"):
        _param_groups(unit())
