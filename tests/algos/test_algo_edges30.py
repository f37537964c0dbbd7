"""Edges of the algorithm functions a probe found accepted silently:

- Clip-Cov and KL-Cov choose the tokens they drop or penalise from each call's rows (at least one
  per call, as verl), so micro-batching changes the gradient although update's other losses are
  split-invariant: update now warns when micro-batching splits a mini-batch for them, and only then.
- gmpo ignored ``agg`` for its policy term (as verl) and so accepted a misspelt name.
- the KL controllers and ``apply_kl_to_rewards`` took NaN and negative coefficients (a NaN KL made
  the adaptive coefficient NaN for good); update's ``kl=`` refuses the same values.
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import rlkit as rk
from rlkit.algos import POLICY_LOSSES
from rlkit.algos.kl import AdaptiveKLController, FixedKLController, apply_kl_to_rewards


def _update(model, char_tok, batch, loss, micro):
    state = rk.init(copy.deepcopy(model), rk.optim.adamw(lr=1e-2), tokenizer=char_tok)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # clip_cov: every unclipped token a candidate (its default band 1 < cov < 5 holds none of these)
        kw = {"clip_cov_lb": -1e9, "clip_cov_ub": 1e9} if loss == "clip_cov" else None
        _, metrics = rk.update(state, batch, loss=loss, loss_kw=kw, micro_batch_size=micro, max_logprob_gap=None)
    return metrics, [str(w.message) for w in caught if "chooses the tokens" in str(w.message)]


@pytest.mark.parametrize("loss", ["kl_cov", "clip_cov"])
def test_cov_losses_warn_when_micro_batches_choose_their_own_tokens(tiny_model, char_tok, loss, policy_batch):
    batch = policy_batch(tiny_model)
    whole, quiet = _update(tiny_model, char_tok, batch, loss, None)
    split, warned = _update(tiny_model, char_tok, batch, loss, 1)
    # the reason for the warning: one token per call, so 8 micro-batches act on 8 tokens, not 1
    assert split["actor/clipfrac"] > 4 * whole["actor/clipfrac"] > 0
    assert not quiet
    assert len(warned) == 1 and f"{loss!r}" in warned[0] and "micro_batch_size=1" in warned[0] and "8 micro-batches" in warned[0]
    # a micro-batch as large as the mini-batch is no split
    _, same = _update(tiny_model, char_tok, batch, loss, 8)
    assert not same


def test_split_invariant_losses_do_not_warn_of_selection(tiny_model, char_tok, policy_batch):
    _, warned = _update(tiny_model, char_tok, policy_batch(tiny_model), "ppo_clip", 1)
    assert not warned


def test_gmpo_refuses_a_misspelt_aggregation_and_ignores_a_registered_one():
    g = torch.Generator().manual_seed(1)
    logp, old, adv = (torch.randn(3, 4, generator=g) for _ in range(3))
    mask = torch.ones(3, 4)
    gmpo = POLICY_LOSSES.get("gmpo")
    base, _ = gmpo(logp, old, adv, mask)
    assert gmpo(logp, old, adv, mask, agg="token-mean")[0] == base  # the policy term is per sequence, as verl
    with pytest.raises(ValueError, match="unknown loss aggregation .token_mean."):
        gmpo(logp, old, adv, mask, agg="token_mean")


@pytest.mark.parametrize("build", [
    lambda: FixedKLController(float("nan")),
    lambda: FixedKLController(-0.1),
    lambda: AdaptiveKLController(-1.0, 0.1, 10),
    lambda: AdaptiveKLController(float("inf"), 0.1, 10),
])
def test_kl_controllers_refuse_a_coefficient_update_would_refuse(build):
    with pytest.raises(ValueError, match="finite number >= 0"):
        build()


def test_adaptive_controller_refuses_a_nan_kl_instead_of_keeping_a_nan_coefficient():
    ctrl = AdaptiveKLController(0.1, 0.1, 10)
    with pytest.raises(ValueError, match="current_kl must be finite"):
        ctrl.update(float("nan"), 8)
    # a finite KL still moves it as the formula says: e = clip(0.2 / 0.1 - 1, +-0.2) = 0.2
    assert math.isclose(ctrl.update(torch.tensor(0.2), 5).value, 0.1 * (1 + 0.2 * 5 / 10))


@pytest.mark.parametrize("coef", [float("nan"), -1.0])
def test_apply_kl_to_rewards_refuses_a_bad_coefficient(coef):
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0"):
        apply_kl_to_rewards(r, torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3), kl_coef=coef)
