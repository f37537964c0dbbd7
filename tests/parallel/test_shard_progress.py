"""A state that has stepped before Plan.shard (restored from a checkpoint in the notebook, then
lowered to go on over several processes) keeps its AdamW moments and its place in the learning-rate
schedule: the shard rebuilt both, so the run went on with fresh moments and a restarted warm-up,
silently (the logged actor/lr jumped back to the peak). Two gloo processes: one update, shard,
one more update equals shard first, two updates (the same batch, the same global maths)."""
from __future__ import annotations

import pytest
import torch

import rlkit as rk
from rlkit.batch import make_batch

pytestmark = pytest.mark.distributed


def _batch(tok):
    b = make_batch([[1, 5, 6], [1, 5, 6], [1, 8], [1, 8]], [[10, 11, 12, 3], [4, 7], [5, 6], [4, 4, 4]],
                   group=[0, 0, 1, 1], rewards=[1.0, 0.0, 0.0, 1.0], pad_token_id=tok.pad_token_id,
                   logprobs=[[-2.0] * n for n in (4, 2, 2, 3)])
    return rk.advantage(b, "grpo")


def _worker(shard_after: int):
    from rlkit.parallel import init_distributed, shutdown

    init_distributed("gloo")
    try:
        task = rk.tasks.arithmetic(n_train=16, n_test=4)
        model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1)
        spec = rk.optim.adamw(lr=1e-2, warmup_steps=2, total_steps=6, schedule="cosine", weight_decay=0.0)
        state = rk.init(model, spec, tokenizer=task.tokenizer)
        plan = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower()
        seen = []
        for step in range(2):
            if step == shard_after:
                before = state.optimizer.param_groups[0]["lr"]
                state = plan.shard(state)
                seen.append(("lr kept", state.optimizer.param_groups[0]["lr"] == before))
            state, metrics = rk.update(state, _batch(task.tokenizer), max_logprob_gap=None)
            seen.append(("lr", metrics["actor/lr"]))
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in state.actor.named_parameters()}
        return seen, full
    finally:
        shutdown()


def test_sharding_a_stepped_state_keeps_its_moments_and_schedule():
    from rlkit.parallel.local import run_local

    first = run_local(_worker, 2, 0, timeout=240, device="cpu")    # shard, then two updates
    later = run_local(_worker, 2, 1, timeout=240, device="cpu")    # one update, shard, one update
    (seen0, w0), (seen1, w1) = first[0], later[0]
    assert [x for x in seen1 if x[0] == "lr"] == [x for x in seen0 if x[0] == "lr"]  # the schedule went on
    assert ("lr kept", True) in seen1
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=2e-5, rtol=1e-4)  # the lost moments: ~1.6e-2
    # the test has teeth: the lr schedule moved (warm-up), so a restarted schedule would differ
    lrs = [x[1] for x in seen0 if x[0] == "lr"]
    assert lrs[0] != lrs[1]


def _bf16_worker():
    import warnings

    from rlkit.parallel import init_distributed, shutdown

    init_distributed("gloo")
    try:
        task = rk.tasks.arithmetic(n_train=16, n_test=4)
        model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1).to(torch.bfloat16)
        state = rk.init(model, rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer)  # float32 master copies (default)
        state, _ = rk.update(state, _batch(task.tokenizer), max_logprob_gap=None)
        moment = state.optimizer.state[state.actor.lm_head.weight]["exp_avg"].float().clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower().shard(state)
        kept = state.optimizer.state[state.actor.lm_head.weight]
        said = [str(w.message) for w in caught if "master weights are not kept" in str(w.message)]
        keys, dtype = sorted(kept), kept["exp_avg"].dtype
        same = torch.equal(kept["exp_avg"].full_tensor(), moment.to(torch.bfloat16))  # kept in the weights' dtype
        # and the sharded optimizer steps with them (torch's fused AdamW refused float32 moments of
        # bf16 weights: "expected scalar type BFloat16 but found Float", so rk.launch of a stepped bf16 state failed)
        state, metrics = rk.update(state, _batch(task.tokenizer), max_logprob_gap=None)
        return said, keys, same, dtype, metrics["actor/grad_norm"]
    finally:
        shutdown()


def test_sharding_drops_master_copies_with_a_warning_and_keeps_the_moments():
    from rlkit.parallel.local import run_local

    for said, keys, same, dtype, grad_norm in run_local(_bf16_worker, 2, timeout=240, device="cpu"):
        assert len(said) == 1 and "moments and schedule carry over" in said[0]
        assert "master" not in keys and "exp_avg" in keys and same and dtype == torch.bfloat16
        assert grad_norm > 0
