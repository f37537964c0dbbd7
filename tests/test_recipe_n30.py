"""A recipe whose estimator compares the n responses of a prompt refuses n < 2 when built, naming
its field: DAPO with n=1 skipped every step after max_attempts rollouts without a word (one
response never disagrees with itself), and GRPO, RLOO and REINFORCE++ (with its group baseline)
failed only after the first rollout, naming rollout(..., n=8) instead of the recipe's n."""
import pytest

import rlkit as rk
from rlkit.algos import ADVANTAGE_ESTIMATORS


@pytest.mark.parametrize("name, message", [
    ("grpo", r"GRPO.n=1: the estimator 'grpo' compares"),
    ("drgrpo", r"GRPO.n=1: the estimator 'drgrpo' compares"),
    ("rloo", r"CriticFree.n=1: the estimator 'rloo' compares"),
    ("reinforce++", r"CriticFree.n=1: the estimator 'reinforce\+\+_baseline' compares"),
    ("dapo", r"DAPO.n=1: dynamic sampling .* nothing would train"),
])
def test_group_recipes_refuse_one_response_per_prompt_naming_n(name, message):
    with pytest.raises(ValueError, match=message):
        rk.recipes.get(name, n=1)
    with pytest.raises(ValueError, match=message):
        rk.recipes.get(name).with_(n=1)
    assert rk.recipes.get(name, n=2).n == 2


def test_an_estimator_given_as_the_function_is_held_to_it_too_and_others_are_not():
    with pytest.raises(ValueError, match=r"GRPO.n=1: the estimator 'rloo'"):
        rk.recipes.get("grpo").with_(n=1, estimator=ADVANTAGE_ESTIMATORS.get("rloo"))
    # PPO's GAE and plain REINFORCE++ have no groups: one response per prompt is a real setting
    assert rk.recipes.get("ppo", n=1).n == 1
    assert rk.recipes.get("grpo").with_(n=1, estimator="reinforce++").n == 1
