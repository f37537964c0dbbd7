import re

import pytest
import torch

import rlkit as rk
from rlkit.batch import make_batch
from rlkit.transforms.advantage import sequence_to_token_rewards


def _scored(rewards, group, lengths=None):
    b = len(rewards)
    lengths = lengths or [3] * b
    batch = make_batch([[1, 2]] * b, [[5] * n for n in lengths], group=group, rewards=rewards)
    return batch


def test_sequence_reward_goes_on_the_last_response_token():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    out = sequence_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert out.tolist() == [[0, 1, 0], [2, 0, 0], [0, 0, 3]]


def test_grpo_hand_worked_values_and_purity():
    batch = _scored([1.0, 0.0, 0.5, 0.5], group=[7, 7, 3, 3], lengths=[3, 2, 1, 3])
    out = rk.advantage(batch, "grpo")
    assert "advantages" not in batch.keys()  # the input is not modified
    adv = out["advantages"]
    # group 7: rewards [1, 0], unbiased std = 0.7071 -> +-0.7071 on every valid token
    assert adv[0, :3].tolist() == pytest.approx([0.70710] * 3, abs=1e-4)
    assert adv[1, :2].tolist() == pytest.approx([-0.70710] * 2, abs=1e-4)
    assert adv[1, 2] == 0
    assert torch.all(adv[2:] == 0)  # equal rewards: zero advantage


def test_a_second_call_uses_rewards_changed_after_the_first():
    """advantage() stored the token rewards it derived from ``rewards`` and preferred them at the
    next call: re-scored rewards were silently ignored. Token rewards the batch carries itself
    (KL-in-reward, shaping) are still used as they are."""
    batch = _scored([1.0, 0.0, 0.0, 1.0], group=[0, 0, 1, 1], lengths=[2, 1, 3, 1])
    first = rk.advantage(batch, "grpo")
    first.set("rewards", torch.tensor([0.0, 1.0, 1.0, 0.0]))
    again = rk.advantage(first, "grpo")
    # each group: rewards (0, 1), unbiased std 0.7071 -> -+0.7071 on every valid token
    assert again["advantages"][:, 0].tolist() == pytest.approx([-0.70710, 0.70710, 0.70710, -0.70710], abs=1e-4)
    assert "token_rewards" not in again.keys()
    own = _scored([1.0, 0.0, 0.0, 1.0], group=[0, 0, 1, 1], lengths=[2, 1, 3, 1])
    own.set("token_rewards", torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    out = rk.advantage(own, "grpo")
    assert out["advantages"][:, 0].tolist() == pytest.approx([-0.70710, 0.70710, 0.0, 0.0], abs=1e-4)
    assert torch.equal(out["token_rewards"], own["token_rewards"])


def test_the_reinforce_pp_recipe_says_it_runs_the_baseline_estimator():
    """rk.recipes.get("reinforce++") runs reinforce++_baseline while rk.advantage(batch,
    "reinforce++") is the plain estimator; the recipe did not say so."""
    import importlib

    module = importlib.import_module("rlkit.recipes.rloo")  # rlkit.recipes.rloo is also the rloo factory
    assert rk.recipes.get("reinforce++").estimator == "reinforce++_baseline"
    for doc in (module.__doc__, module.reinforce_pp.__doc__):
        assert "reinforce++_baseline" in doc and 'CriticFree(estimator="reinforce++")' in doc


def test_group_estimator_needs_two_samples_per_prompt():
    batch = _scored([1.0, 0.0], group=[0, 1])
    with pytest.raises(rk.BatchError, match="n >= 2"):
        rk.advantage(batch, "grpo")
    with pytest.raises(rk.BatchError, match="different sizes"):
        rk.advantage(_scored([1.0, 0.0, 1.0], group=[0, 0, 1]), "rloo")


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="unknown advantage estimator 'grp'.*grpo"):
        rk.advantage(_scored([1.0, 0.0], group=[0, 0]), "grp")


def test_user_estimator_receives_only_named_fields():
    seen = {}

    def my_estimator(token_rewards, response_mask, *, scale=1.0):
        seen["args"] = (token_rewards.shape, response_mask.shape)
        adv = token_rewards.sum(-1, keepdim=True) * response_mask * scale
        return adv, adv

    out = rk.advantage(_scored([1.0, 2.0], group=[0, 0]), my_estimator, scale=2.0)
    assert out["advantages"][1].tolist() == [4.0, 4.0, 4.0]
    with pytest.raises(TypeError, match="no option"):
        rk.advantage(_scored([1.0, 2.0], group=[0, 0]), my_estimator, sclae=2.0)


def test_gae_requires_values():
    with pytest.raises(ValueError, match="values"):
        rk.advantage(_scored([1.0, 2.0], group=[0, 0]), "gae")


def test_nan_reward_is_refused_naming_the_row():
    with pytest.raises(rk.BatchError, match="rewards.*rows \\[1\\]"):
        rk.advantage(_scored([1.0, float("nan")], group=[0, 0]), "grpo")


# ---------------------------------------------------------------- which estimators need equal groups


def median_baseline(token_rewards, response_mask, group, *, scale=1.0):
    """The tutorial's estimator (tutorials/custom_algorithm.md), verbatim."""
    scores = token_rewards.sum(-1)
    ids = torch.unique(group, return_inverse=True)[1]
    # quantile(0.5) averages the two middle values of an even group; Tensor.median takes the lower
    medians = torch.stack([scores[ids == g].quantile(0.5) for g in range(int(ids.max()) + 1)])
    adv = (scores - medians[ids]) * scale
    adv = adv[:, None] * response_mask
    return adv, adv


def test_custom_group_estimator_takes_groups_of_unequal_size():
    import statistics

    rewards = [1.0, 0.0, 3.0, 2.0, 5.0, -1.0, 4.0, 0.5, 7.0]
    group = [9, 4, 9, 9, -2, 4, 4, 4, 4]  # sizes 3, 5, 1; arbitrary ids, not contiguous
    lengths = [3, 1, 2, 3, 2, 3, 1, 2, 3]
    out = rk.advantage(_scored(rewards, group, lengths), median_baseline, scale=0.5)
    members = {g: [r for r, h in zip(rewards, group) if h == g] for g in set(group)}
    want = [(r - statistics.median(members[g])) * 0.5 for r, g in zip(rewards, group)]
    for i, n in enumerate(lengths):
        assert out["advantages"][i, :n].tolist() == pytest.approx([want[i]] * n)
        assert torch.all(out["advantages"][i, n:] == 0)


def test_the_tutorials_median_of_an_even_group_is_the_mean_of_its_middle_values():
    """Tensor.median gave [1, 0] the median 0, so half of a binary group got no advantage."""
    import statistics

    rewards = [1.0, 0.0, 1.0, 0.0, 3.0, 0.0, 2.0, 5.0]
    group = [0, 0, 0, 0, 1, 1, 1, 1]
    out = rk.advantage(_scored(rewards, group, [1] * 8), median_baseline)
    members = {g: [r for r, h in zip(rewards, group) if h == g] for g in set(group)}
    want = [r - statistics.median(members[g]) for r, g in zip(rewards, group)]
    assert out["advantages"][:, 0].tolist() == pytest.approx(want)
    assert out["advantages"][:4, 0].tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5])


BUILTIN_GROUP = [
    ("grpo", "grpo"), ("drgrpo", "drgrpo"), ("rloo", "rloo"), ("opo", "opo"), ("gpg", "gpg"),
    ("reinforce++_baseline", "reinforce++_baseline"),
    ("reinforce_plus_plus_baseline", "reinforce_plus_plus_baseline"),
    (rk.algos.advantages.grpo, "grpo"), (rk.algos.advantages.rloo, "rloo"),
    (rk.algos.advantages.reinforce_plus_plus_baseline, "reinforce++_baseline"),
]


@pytest.mark.parametrize("estimator, shown", BUILTIN_GROUP, ids=lambda e: e if isinstance(e, str) else f"fn:{e.__name__}")
def test_builtin_group_estimator_checks_by_name_alias_or_function(estimator, shown):
    with pytest.raises(rk.BatchError, match=f"estimator '{re.escape(shown)}' compares.*n >= 2"):
        rk.advantage(_scored([1.0, 0.0], group=[0, 1]), estimator)
    with pytest.raises(rk.BatchError, match="different sizes"):
        rk.advantage(_scored([1.0, 0.0, 1.0], group=[0, 0, 1]), estimator)


def test_a_users_name_for_a_builtin_gets_its_checks(monkeypatch):
    from rlkit.algos.advantages import ADVANTAGE_ESTIMATORS

    monkeypatch.setattr(ADVANTAGE_ESTIMATORS, "_fns", dict(ADVANTAGE_ESTIMATORS._fns))
    ADVANTAGE_ESTIMATORS.register("my_grpo")(rk.algos.advantages.grpo)
    with pytest.raises(rk.BatchError, match="'my_grpo' compares.*n >= 2"):
        rk.advantage(_scored([1.0, 0.0], group=[0, 1]), "my_grpo")


def test_group_estimators_set_holds_aliases_and_functions():
    from rlkit.transforms.advantage import GROUP_ESTIMATORS

    for e in ("grpo", "reinforce++_baseline", "reinforce_plus_plus_baseline", rk.algos.advantages.drgrpo):
        assert e in GROUP_ESTIMATORS
    for e in ("gae", "reinforce++", "reinforce_plus_plus", "remax", rk.algos.advantages.gae, median_baseline):
        assert e not in GROUP_ESTIMATORS


# ---------------------------------------------------------------- rows without response tokens


def test_nonzero_reward_on_an_empty_response_is_refused_naming_the_row():
    batch = make_batch([[5]] * 4, [[6, 7], [], [6], [7]], group=[0] * 4, rewards=[1.0, -5.0, 1.0, 1.0])
    for est in ("rloo", "grpo", "reinforce++", median_baseline):
        with pytest.raises(rk.BatchError, match="rows \\[1\\].*-5.*no response token.*drop those rows"):
            rk.advantage(batch, est)
    with pytest.raises(rk.BatchError, match="rows \\[0, 2\\]"):
        sequence_to_token_rewards(torch.tensor([2.0, 0.0, -1.0]), torch.tensor([[0, 0], [1, 0], [0, 0]]).bool())


def test_zero_reward_on_an_empty_response_keeps_the_documented_formula():
    """Reward 0 on a row with no token loses nothing: the row's score is 0 either way."""
    import statistics

    rewards = [1.0, 0.0, 3.0, 1.0]
    batch = make_batch([[5]] * 4, [[6, 7], [], [6], [7]], group=[0] * 4, rewards=rewards)
    rloo = rk.advantage(batch, "rloo")["advantages"]
    for i in (0, 2, 3):  # A_i = s_i - mean of the other rows
        others = rewards[:i] + rewards[i + 1:]
        assert rloo[i, 0].item() == pytest.approx(rewards[i] - sum(others) / 3)
    assert torch.all(rloo[1] == 0)
    grpo = rk.advantage(batch, "grpo")["advantages"]
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)
    assert grpo[2, 0].item() == pytest.approx((3.0 - mean) / (std + 1e-6), rel=1e-6)
