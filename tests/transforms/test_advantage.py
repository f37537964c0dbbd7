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
