"""What tutorials/from_trl.md says about TRL 1.16's GRPOTrainer, checked against TRL's formulas
written out here from its documented semantics (not by running TRL): its loss_type aggregations,
its scale_rewards advantages, its k3 KL term, and where rlkit differs by default (dual clip, the
advantage epsilon, Dr. GRPO's scale)."""
import math

import pytest
import torch

import rlkit as rk
from rlkit.algos.kl import kl_penalty
from rlkit.algos.losses import ppo_clip
from rlkit.batch import make_batch

B, T = 4, 6


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate([6, 3, 1, 4]):
        mask[i, :n] = True
    logp = -torch.rand(B, T, generator=g) * 2
    old = logp + 0.3 * torch.randn(B, T, generator=g)  # off-policy enough for every clip to matter
    adv = torch.tensor([1.5, -2.0, 0.7, -0.4])[:, None].expand(B, T).clone()
    ref = logp + 0.2 * torch.randn(B, T, generator=g)
    return logp, old, adv, mask, ref


def _trl_per_token(logp, old, adv, eps_low=0.2, eps_high=0.2):
    """TRL's per-token GRPO loss: -min(r A, clip(r, 1 - eps, 1 + eps_high) A), no dual clip."""
    r = torch.exp(logp - old)
    return -torch.minimum(r * adv, torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv)


def test_trl_loss_types_are_rlkit_aggregations(inputs):
    logp, old, adv, mask, _ = inputs
    per_token = _trl_per_token(logp, old, adv)
    m = mask.float()
    trl = {
        "dapo": (per_token * m).sum() / m.sum(),  # TRL's default: over the batch's tokens
        "grpo": ((per_token * m).sum(-1) / m.sum(-1)).mean(),  # per sequence, then over sequences
        "dr_grpo": (per_token * m).sum() / (B * T),  # max_completion_length = T
    }
    no_dual = {"clip_ratio_c": math.inf}
    ours = {
        "dapo": ppo_clip(logp, old, adv, mask, agg="token-mean", **no_dual)[0],
        "grpo": ppo_clip(logp, old, adv, mask, agg="seq-mean-token-mean", **no_dual)[0],
        "dr_grpo": ppo_clip(logp, old, adv, mask, agg="seq-mean-token-sum-norm", horizon=T, **no_dual)[0],
    }
    torch.testing.assert_close(ours["dapo"], trl["dapo"])
    torch.testing.assert_close(ours["grpo"], trl["grpo"])
    torch.testing.assert_close(ours["dr_grpo"], B * trl["dr_grpo"])  # verl's scale: B times TRL's
    # DAPO's clip-higher: TRL's epsilon_high is loss_kw clip_ratio_high
    torch.testing.assert_close(
        ppo_clip(logp, old, adv, mask, agg="token-mean", clip_ratio_high=0.28, **no_dual)[0],
        (_trl_per_token(logp, old, adv, eps_high=0.28) * m).sum() / m.sum(),
    )
    # rlkit's default dual clip (clip_ratio_c=3) bounds the loss of negative advantages at large ratios
    far = old - 2.0  # ratio e^2 > 3
    assert not torch.allclose(ppo_clip(logp, far, adv, mask)[0], ppo_clip(logp, far, adv, mask, **no_dual)[0])
    assert rk.recipes.get("grpo").agg is None and rk.recipes.get("dapo").agg == "token-mean"


def test_trl_scale_rewards_are_rlkit_grpo_options():
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    batch = make_batch([[1, 2]] * 8, [[3]] * 8, group=group.tolist(), rewards=rewards.tolist())
    grouped = rewards.view(2, 4)
    mean = grouped.mean(-1, keepdim=True).expand(2, 4).reshape(-1)
    std = grouped.std(-1, keepdim=True).expand(2, 4).reshape(-1)  # unbiased, as TRL's torch.std
    trl_group = (rewards - mean) / (std + 1e-4)  # scale_rewards="group" (TRL's default), its epsilon 1e-4
    trl_none = rewards - mean  # scale_rewards="none"
    ours = rk.advantage(batch, "grpo", epsilon=1e-4)["advantages"][:, 0]
    torch.testing.assert_close(ours, trl_group)
    torch.testing.assert_close(rk.advantage(batch, "grpo", norm_by_std=False)["advantages"][:, 0], trl_none)
    assert torch.equal(ours[4:], torch.zeros(4))  # a group of equal rewards: no signal


def test_trl_beta_kl_is_k3(inputs):
    logp, _, _, mask, ref = inputs
    trl = torch.exp(ref - logp) - (ref - logp) - 1  # TRL's per-token KL
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl") * mask, trl * mask)
