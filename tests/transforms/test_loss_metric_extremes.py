"""A loss's metrics named ``*_max`` / ``*_min`` are the extreme over micro-batches, mini-batches and
data-parallel ranks; every other metric stays a token-weighted mean. Before, every loss metric was a
token-weighted mean of its per-micro-batch values, so tutorials/custom_algorithm.md's
``weight_max`` reported 2.95 where the largest weight was 3.0.

Checked against the batch's own max / min / token mean (independent of how update splits it), on
one process with 1, 2 and 8 rows per micro-batch and two mini-batches, and on 2 gloo processes.
"""
from __future__ import annotations

import pytest
import torch

import rlkit as rk
from rlkit.algos.losses import ppo_clip


def _setup():
    from rlkit.batch import make_batch

    task = rk.tasks.arithmetic(n_train=64, n_test=8)
    model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1)
    g = torch.Generator().manual_seed(3)
    prompts = [task.train.ids[i] for i in range(2) for _ in range(4)]
    responses = [torch.randint(4, 19, (int(k),), generator=g).tolist() for k in [1, 5, 3, 6, 2, 2, 4, 1]]
    batch = make_batch(prompts, responses, group=[0] * 4 + [1] * 4, rewards=[1.0, 0.0, 3.0, 0.0, 0.5, 0.0, 1.0, 2.0])
    batch.set("logprobs", -torch.rand(batch["response_mask"].shape, generator=g) * batch["response_mask"])
    batch = rk.advantage(batch, "grpo")
    state = rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)
    return task, state, batch


def _loss(logprobs, old_logprobs, advantages, response_mask, *, num_tokens=None, **kw):
    """ppo_clip, plus the max, min and mean of the batch's (random) behaviour log-probs over this
    micro-batch's tokens: a per-token probe with its extremes in different micro-batches."""
    loss, metrics = ppo_clip(logprobs, old_logprobs, advantages, response_mask, num_tokens=num_tokens, **kw)
    probe = old_logprobs[response_mask.bool()]
    return loss, {**metrics, "probe_max": probe.max(), "probe_min": probe.min(), "probe_mean": probe.mean()}


def _reference(batch):
    on = batch["response_mask"].bool()
    # the comparison needs micro-batches whose own extremes differ from the batch's
    per_row = [float(batch["logprobs"][i][on[i]].max()) for i in range(len(batch))]
    assert len(set(per_row)) == len(per_row), per_row
    values = batch["logprobs"][on].double()
    return float(values.max()), float(values.min()), float(values.mean())


def _update(state, batch, micro, mini=None):
    return rk.update(state, batch, loss=_loss, micro_batch_size=micro, mini_batch_size=mini, max_logprob_gap=None)


@pytest.mark.parametrize("micro, mini", [(1, None), (2, None), (8, None), (2, 4)])
def test_max_and_min_metrics_are_the_batchs_extremes_and_the_rest_stay_token_means(micro, mini):
    _, state, batch = _setup()
    top, bottom, mean = _reference(batch)
    _, metrics = _update(state, batch, micro, mini)
    assert metrics["actor/probe_max"] == pytest.approx(top, abs=1e-6)
    assert metrics["actor/probe_min"] == pytest.approx(bottom, abs=1e-6)
    if mini is None:  # one mini-batch: the token-weighted mean of the micro-batches' means is the batch's
        assert metrics["actor/probe_mean"] == pytest.approx(mean, abs=1e-6)


def _worker():
    from rlkit.parallel import init_distributed, shutdown

    init_distributed("gloo")
    try:
        task, state, batch = _setup()
        plan = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower()
        state = plan.shard(state)
        _, metrics = _update(state, batch, 1)
        return metrics
    finally:
        shutdown()


@pytest.mark.distributed
def test_two_ranks_report_the_extremes_over_both_ranks():
    from rlkit.parallel.local import run_local

    _, _, batch = _setup()
    top, bottom, mean = _reference(batch)
    for metrics in run_local(_worker, 2, timeout=180, device="cpu"):
        assert metrics["actor/probe_max"] == pytest.approx(top, abs=1e-6)
        assert metrics["actor/probe_min"] == pytest.approx(bottom, abs=1e-6)
        assert metrics["actor/probe_mean"] == pytest.approx(mean, abs=1e-6)
