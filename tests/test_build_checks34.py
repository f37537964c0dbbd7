"""Options checked when they are given, not steps later.

- A recipe's ``loss_kw`` for rlkit's own policy losses: ``kl_cov_ratio=2`` or ``clip_ratio=-0.1``
  built a recipe without a word and failed in the first update, after a whole rollout; the recipe
  now runs the loss once on a 1 x 4 batch of zeros when built, so the loss's own message names the
  option. A loss of the user's is never run at build time.
- ``SamplingParams(ignore_stop=np.True_)`` (a flag read from a numpy array or config) was refused
  though numpy bools are accepted by every other switch; it is now stored as a plain bool.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import rlkit as rk


@pytest.mark.parametrize("loss, kw, name", [
    ("kl_cov", {"kl_cov_ratio": 2.0}, "kl_cov_ratio"),
    ("kl_cov", {"ppo_kl_coef": -1.0}, "ppo_kl_coef"),
    ("clip_cov", {"clip_cov_ratio": 0.0}, "clip_cov_ratio"),
    ("ppo_clip", {"clip_ratio": -0.1}, "clip_ratio"),
    ("ppo_clip", {"clip_ratio_c": 0.5}, "clip_ratio_c"),
])
@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_a_bad_loss_option_is_refused_when_the_recipe_is_built(recipe, loss, kw, name):
    with pytest.raises(ValueError, match=name):
        rk.recipes.get(recipe).with_(loss=loss, loss_kw=kw)


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo", "gpg", "gmpo", "clip_cov", "kl_cov"])
def test_every_builtin_loss_builds_with_its_defaults_without_a_warning(loss):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe = rk.recipes.get("grpo").with_(loss=loss)
    assert recipe.loss == loss


def test_a_users_loss_is_not_run_when_the_recipe_is_built():
    calls = []

    def mine(logprobs, old_logprobs, advantages, response_mask, *, agg="token-mean", num_tokens=None,
             num_seqs=None, horizon=None, scale=1.0):
        calls.append(scale)
        raise ValueError("must not run at build time")

    recipe = rk.recipes.get("grpo").with_(loss=mine, loss_kw={"scale": 2.0})
    assert recipe.loss is mine and calls == []


def test_ignore_stop_takes_a_numpy_bool_and_stores_a_bool():
    p = rk.engines.SamplingParams(max_new_tokens=4, ignore_stop=np.True_)
    assert p.ignore_stop is True
    assert rk.engines.SamplingParams(max_new_tokens=4, ignore_stop=np.bool_(False)).ignore_stop is False
    for bad in ("no", 1, None):
        with pytest.raises(ValueError, match="SamplingParams.ignore_stop must be True or False"):
            rk.engines.SamplingParams(max_new_tokens=4, ignore_stop=bad)
