"""Session 33's argument contracts, each refused with an error that names the argument and the fix:
a recipe's loss_scale_growth_interval is checked when the recipe is built; kl_cov's ratio and
coefficient (and clip_cov's ratio) are in range; boolean switches (fit's and update's shuffle,
rollout's decode) take True or False, not a truthy string; eval_fn without eval_every is refused as
the opposite mistake is; the log-prob and value passes expect a TrainState first; batch helpers do
not read a string as a list of characters."""
import numpy as np
import pytest
import torch

import rlkit as rk
from rlkit.algos import POLICY_LOSSES


# 1. the recipe's loss_scale_growth_interval, when the recipe is built (it failed inside the first
#    update, after its rollout and scoring)
@pytest.mark.parametrize("value", [0, -5, 2.5, "100", None, True])
def test_recipe_refuses_a_bad_loss_scale_growth_interval_when_built(value):
    with pytest.raises(ValueError, match=r"GRPO\.loss_scale_growth_interval must be a positive int .*got "):
        rk.recipes.get("grpo", n=2, max_new_tokens=3, loss_scale_growth_interval=value)


def test_recipe_keeps_a_good_loss_scale_growth_interval():
    recipe = rk.recipes.get("grpo", n=2, max_new_tokens=3, loss_scale_growth_interval=7)
    assert recipe.update_kwargs()["loss_scale_growth_interval"] == 7
    with pytest.raises(ValueError, match="loss_scale_growth_interval"):
        recipe.with_(loss_scale_growth_interval=0)


# 2. kl_cov / clip_cov options
def _loss_inputs():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 5, generator=g)
    old = logp + 0.1 * torch.randn(2, 5, generator=g)
    adv = torch.randn(2, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    return logp, old, adv, mask


@pytest.mark.parametrize("ratio", [1.5, 2, 0.0, -0.1, float("nan"), "0.1", None])
def test_kl_cov_ratio_must_be_in_0_1(ratio):
    # above 1 it failed in torch.topk with "selected index k out of range"
    with pytest.raises(ValueError, match=r"kl_cov: kl_cov_ratio must be a number in \(0, 1\]"):
        POLICY_LOSSES.get("kl_cov")(*_loss_inputs(), kl_cov_ratio=ratio)


@pytest.mark.parametrize("ratio", [1.5, 0.0, float("nan"), "0.1"])
def test_clip_cov_ratio_must_be_in_0_1_too(ratio):
    with pytest.raises(ValueError, match=r"clip_cov: clip_cov_ratio must be a number in \(0, 1\]"):
        POLICY_LOSSES.get("clip_cov")(*_loss_inputs(), clip_cov_ratio=ratio)


@pytest.mark.parametrize("coef", [-0.1, float("nan"), float("inf"), "0.1", None])
def test_kl_cov_coef_must_be_finite_and_non_negative(coef):
    # a negative coefficient rewarded moving away from the old policy
    with pytest.raises(ValueError, match=r"kl_cov: ppo_kl_coef must be a finite number >= 0"):
        POLICY_LOSSES.get("kl_cov")(*_loss_inputs(), ppo_kl_coef=coef)


def test_kl_cov_and_clip_cov_take_a_ratio_of_one_and_a_zero_coef():
    inputs = _loss_inputs()
    loss, metrics = POLICY_LOSSES.get("kl_cov")(*inputs, kl_cov_ratio=1.0, ppo_kl_coef=0.0)
    assert torch.isfinite(loss) and float(metrics["clipfrac"]) == 1.0  # every valid token chosen
    loss, _ = POLICY_LOSSES.get("clip_cov")(*inputs, clip_cov_ratio=1, clip_cov_lb=-1e9, clip_cov_ub=1e9)
    assert torch.isfinite(loss)


# 3. boolean switches
def test_fit_refuses_a_truthy_string_for_shuffle(task, fresh_state):
    state = fresh_state()
    for value in ("no", "False", 1, 0, None):
        with pytest.raises(ValueError, match=r"fit: shuffle must be True or False"):
            rk.fit(state, "grpo", task.reward, task.train, steps=1, batch_size=2, shuffle=value)
    assert state.step == 0  # refused before any step; the state is still usable


def test_update_refuses_a_truthy_string_for_shuffle(tiny_model, char_tok, policy_batch):
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    batch = policy_batch(tiny_model)
    for value in ("no", 1, None):
        with pytest.raises(ValueError, match=r"shuffle must be True or False .*got "):
            rk.update(state, batch, shuffle=value, mini_batch_size=4)
    new, _ = rk.update(state, batch, shuffle=np.bool_(True), mini_batch_size=4, max_logprob_gap=None)  # a numpy bool is fine
    assert new.step == 1


def test_rollout_refuses_a_truthy_string_for_decode(task, fresh_state):
    state = fresh_state()
    prompts = task.train.batch_at(0, 2, shuffle=False)
    for value in ("no", 0, None):
        with pytest.raises(ValueError, match=r"rollout: decode must be True or False"):
            rk.rollout(state, prompts, n=1, max_new_tokens=2, decode=value)
    batch = rk.rollout(state, prompts, n=1, max_new_tokens=2, decode=np.bool_(False))
    assert "response_text" not in batch.keys()
    assert "response_text" in rk.rollout(state, prompts, n=1, max_new_tokens=2, decode=True).keys()


# 4. eval_fn without eval_every
def test_fit_refuses_eval_fn_without_eval_every(task, fresh_state):
    calls = []
    with pytest.raises(ValueError, match=r"eval_fn is given but eval_every=0 \(never\): pass eval_every=N"):
        rk.fit(fresh_state(), "grpo", task.reward, task.train, steps=1, batch_size=2,
               eval_fn=lambda state: calls.append(1) or {"accuracy": 1.0})
    assert not calls


def test_plan_fit_refuses_eval_fn_without_eval_every(task, fresh_state):
    # Plan.fit is rk.fit over the plan; rk.launch's pre-check shares the same function (loop._checked_run)
    plan = rk.Pipeline(rk.recipes.get("grpo", n=2, max_new_tokens=2), reward=task.reward).lower()
    with pytest.raises(ValueError, match="eval_fn is given but eval_every=0"):
        plan.fit(fresh_state(), task.train, steps=1, batch_size=2, eval_fn=lambda state: {"accuracy": 1.0})
    with pytest.raises(ValueError, match="fit: shuffle must be True or False"):
        plan.fit(fresh_state(), task.train, steps=1, batch_size=2, shuffle="no")


def test_checked_run_agrees_for_launch():
    from types import SimpleNamespace

    from rlkit.loop import _checked_run

    state = SimpleNamespace(step=0, tokenizer=None)
    prompts = SimpleNamespace(batch_at=None)
    with pytest.raises(ValueError, match="eval_fn is given but eval_every=0"):
        _checked_run(state, prompts, 1, 2, 0, lambda s: {})
    with pytest.raises(ValueError, match="asks for evaluation but eval_fn is None"):
        _checked_run(state, prompts, 1, 2, 3, None)
    assert _checked_run(state, prompts, 1, 2, 3, lambda s: {}) is prompts
    assert _checked_run(state, prompts, 1, 2, 0, None) is prompts


# 5. the forward passes expect a TrainState first
@pytest.mark.parametrize("name", ["compute_old_logprobs", "compute_ref_logprobs", "compute_values"])
def test_forward_passes_expect_a_train_state(name, task, fresh_state):
    state = fresh_state()
    batch = rk.rollout(state, task.train.batch_at(0, 2, shuffle=False), n=1, max_new_tokens=2)
    with pytest.raises(TypeError, match=rf"{name} expects a TrainState first \(from rk.init\), got .*not state.actor"):
        getattr(rk, name)(state.actor, batch)
    with pytest.raises(TypeError, match=rf"{name} expects a TrainState first"):
        getattr(rk, name)(batch, state)


# 6. a string where a list is expected
def _batch():
    return rk.make_batch([[5, 6], [7]], [[1, 2, 3], [4]], group=[0, 0], rewards=[1.0, 0.0])


def test_validate_takes_one_field_name_as_a_string():
    b = _batch()
    assert rk.validate(b, require="rewards") is b  # it raised "batch has no field 'r'"
    with pytest.raises(rk.BatchError, match="batch has no field 'advantages'"):
        rk.validate(b, require="advantages")


def test_set_column_refuses_a_string_of_values():
    b = _batch()
    with pytest.raises(rk.BatchError, match=r"column 'x': values must be a list with one value per row, got the str 'ab'"):
        rk.set_column(b, "x", "ab")  # it stored 'a' and 'b'
    assert "x" not in b.keys()
    rk.set_column(b, "x", ["ab", "ab"])
    assert rk.column(b, "x") == ["ab", "ab"]
    with pytest.raises(rk.BatchError, match="values must be a list"):
        rk.make_batch([[5], [6]], [[1], [2]], columns={"answer": "ab"})


def test_launch_refuses_a_shuffle_that_is_no_bool_before_any_worker_starts(task, fresh_state):
    import time

    plan = rk.Pipeline(rk.recipes.get("grpo", n=2, max_new_tokens=2), reward=task.reward).lower()
    started = time.perf_counter()
    with pytest.raises(ValueError, match="launch: shuffle must be True or False"):
        rk.launch(plan, fresh_state(), task.train, steps=1, batch_size=2, nproc_per_node=2, shuffle="no", echo_logs=False)
    assert time.perf_counter() - started < 10  # refused in the caller: no worker was started
