"""Recipes and the estimators they are given: a learned-value baseline gets the critic's values in
GRPO / CriticFree (it always received None), and the n >= 2 check follows what an estimator runs
(a functools.partial of a built-in, a name re-registered to a user's function)."""
import functools

import pytest
import torch

import rlkit as rk
from rlkit.algos.advantages import ADVANTAGE_ESTIMATORS
from rlkit.transforms.forward import compute_values

TASK_N_TRAIN = 8


def _state(task, critic=True):
    model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1)
    return rk.init(model, rk.optim.adamw(lr=3e-4), tokenizer=task.tokenizer,
                   critic=rk.models.critic(model) if critic else None)


@pytest.mark.parametrize("recipe", [rk.recipes.GRPO, rk.recipes.CriticFree])
def test_a_value_baseline_receives_the_critics_values(task, recipe):
    seen = []

    def value_baseline(token_rewards, response_mask, values=None):
        seen.append(values)
        returns = token_rewards.flip(-1).cumsum(-1).flip(-1) * response_mask
        base = 0.0 if values is None else values
        return (returns - base) * response_mask, returns

    state = _state(task)
    # the shape of the values the critic gives a batch of this size
    rollout = rk.rollout(state, task.train.take(range(2)), n=2, max_new_tokens=3)
    want = compute_values(state, rollout)["values"]
    step = recipe(estimator=value_baseline, n=2, max_new_tokens=3)
    critic_before = [p.detach().clone() for p in state.critic.parameters()]
    state, metrics = step.step(state, task.train.take(range(2)), task.reward)
    assert len(seen) == 1 and seen[0] is not None and seen[0].shape == want.shape
    assert torch.isfinite(seen[0]).all() and seen[0].abs().sum() > 0
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, state.critic.parameters()))  # the critic learns
    # without a critic the baseline gets None, as before (its default), and nothing else changes
    seen.clear()
    step.step(_state(task, critic=False), task.train.take(range(2)), task.reward)
    assert seen == [None]


def test_gae_runs_in_a_critic_free_recipe_on_a_state_with_a_critic(task):
    # "gae" requires values: it failed with "run the critic first" although the state had one
    state, metrics = rk.recipes.CriticFree(estimator="gae", n=2, max_new_tokens=3).step(
        _state(task), task.train.take(range(2)), task.reward)
    assert state.step == 1 and "critic/vf_loss" in metrics


def test_a_partial_of_a_group_builtin_gets_its_checks(task):
    eps = functools.partial(rk.algos.advantages.grpo, epsilon=1e-4)  # as tutorials/from_trl.md suggests
    with pytest.raises(ValueError, match="GRPO.n=1: the estimator 'grpo' compares"):
        rk.recipes.GRPO(estimator=eps, n=1)
    batch = rk.score(rk.rollout(_state(task, critic=False), task.train.take(range(2)), n=1, max_new_tokens=2), task.reward)
    with pytest.raises(rk.BatchError, match="every group has 1 sample"):
        rk.advantage(batch, eps)  # groups of one got r / (1 + eps), silently
    rk.recipes.GRPO(estimator=eps, n=2)  # n >= 2 is fine


def test_a_name_re_registered_to_a_users_function_is_the_users(monkeypatch):
    monkeypatch.setattr(ADVANTAGE_ESTIMATORS, "_fns", dict(ADVANTAGE_ESTIMATORS._fns))
    monkeypatch.setattr(ADVANTAGE_ESTIMATORS, "_user", dict(ADVANTAGE_ESTIMATORS._user))

    def single(token_rewards, response_mask):  # needs no groups
        return token_rewards * response_mask, token_rewards * response_mask

    ADVANTAGE_ESTIMATORS.register("grpo", override=True)(single)
    assert rk.recipes.GRPO(n=1).n == 1  # refused by name before, though "grpo" now runs `single`
