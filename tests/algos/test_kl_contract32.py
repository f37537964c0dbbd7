"""A KL penalty of the user's own is held to its contract, fn(logprobs, ref_logprobs) -> (b t):
another signature is refused when the recipe is built (it failed after the first rollout with
Python's bare "missing 1 required positional argument"), and an estimate of another shape is named
as the KL's (it failed as "loss_mat has shape (16,) and mask (16, 5)")."""
import pytest
import torch

import rlkit as rk
from rlkit.algos.kl import kl_penalty


def three_args(logprobs, ref_logprobs, response_mask):
    return (logprobs - ref_logprobs) * response_mask


def per_row(logprobs, ref_logprobs):
    return (logprobs - ref_logprobs).sum(-1)


def with_option(logprobs, ref_logprobs, scale=2.0):
    return scale * (logprobs - ref_logprobs)


def test_a_kl_of_another_signature_is_refused_when_the_recipe_is_built():
    with pytest.raises(TypeError, match=r"GRPO: KL penalty 'three_args' has the signature \(logprobs, ref_logprobs, "
                                         r"response_mask\); update calls it as fn\(logprobs, ref_logprobs\)"):
        rk.recipes.GRPO(kl=(three_args, 0.1))
    rk.recipes.GRPO(kl=(with_option, 0.1))  # an extra parameter with a default is fine


def test_update_refuses_it_before_any_pass(tiny_model, char_tok, policy_batch):
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    with pytest.raises(TypeError, match="KL penalty 'three_args' has the signature"):
        rk.update(state, policy_batch(tiny_model, ref=True), kl=(three_args, 0.1))
    assert state.step == 0  # not donated: the refusal came first


def test_a_kl_estimate_of_another_shape_is_named():
    lp, ref = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"KL penalty 'per_row' returned shape \(3,\); a KL penalty returns a per-token "
                                         r"estimate of the inputs' shape \(3, 4\)"):
        kl_penalty(lp, ref, per_row)
    with pytest.raises(ValueError, match="KL penalty 'scalar' returned float"):
        kl_penalty(lp, ref, _scalar())
    torch.testing.assert_close(kl_penalty(lp, ref, with_option), 2.0 * (lp - ref))
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), lp - ref)


def _scalar():
    def scalar(logprobs, ref_logprobs):
        return 0.5
    return scalar
