"""rk.init's checks: bf16/fp16 weights too large for a step of lr to move them are warned about
(the estimate matches what AdamW actually changes), a critic sharing the actor's weights is
refused, and the seed is an int in [0, 2**63) as rollout requires."""
import copy
import warnings

import pytest
import torch

import rlkit as rk
from rlkit.state import movable_fraction


def _bf16(tiny_model):
    return copy.deepcopy(tiny_model).to(torch.bfloat16)


def _changed_by_one_adamw_step(model, lr):
    """The share of the weights one real AdamW step of ``lr`` changes (random gradients)."""
    model = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step()
    changed = sum(int((b != p.detach()).sum()) for b, p in zip(before, model.parameters()))
    return changed / sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("lr", [1e-6, 1e-5, 1e-4, 1e-3])
def test_movable_fraction_matches_what_adamw_changes(tiny_model, lr):
    model = _bf16(tiny_model)
    assert movable_fraction(model, lr) == pytest.approx(_changed_by_one_adamw_step(model, lr), abs=0.02)
    assert movable_fraction(tiny_model, lr) is None  # float32: nothing to say


def _init_warnings(model, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rk.init(model, **kw)
    return [str(w.message) for w in caught if "optimizer step changes only" in str(w.message)]


def test_init_warns_when_bf16_weights_cannot_follow_the_lr(tiny_model, char_tok):
    """Only with master_weights=False: by default the optimizer steps float32 master copies."""
    off = dict(master_weights=False)
    model = _bf16(tiny_model)
    (message,) = _init_warnings(model, optimizer=rk.optim.adamw(lr=1e-6, **off), tokenizer=char_tok)
    assert "actor's trainable weights are bfloat16 and at lr=1e-06" in message
    assert "leave master_weights at None" in message and "train in float32" in message
    assert _init_warnings(_bf16(tiny_model), optimizer=rk.optim.adamw(lr=1e-6), tokenizer=char_tok) == []  # master copies
    assert _init_warnings(_bf16(tiny_model), optimizer=rk.optim.adamw(lr=1e-3, **off), tokenizer=char_tok) == []
    assert _init_warnings(copy.deepcopy(tiny_model), optimizer=rk.optim.adamw(lr=1e-6, **off), tokenizer=char_tok) == []
    frozen = _bf16(tiny_model).requires_grad_(False)  # nothing trainable in bf16: nothing to warn about
    assert movable_fraction(frozen, 1e-6) is None


def test_init_warns_for_a_bf16_critic_too(tiny_model, char_tok):
    actor = copy.deepcopy(tiny_model)
    critic = rk.models.critic(_bf16(tiny_model))
    (message,) = _init_warnings(actor, optimizer=rk.optim.adamw(lr=1e-3), tokenizer=char_tok, critic=critic,
                                critic_optimizer=rk.optim.adamw(lr=1e-6, master_weights=False))
    assert "the critic's trainable weights are bfloat16" in message


def test_critic_sharing_the_actors_weights_is_refused(tiny_model, char_tok):
    with pytest.raises(ValueError, match=r"critic is the actor itself \(or shares its parameters\).*rk.models.critic\(model\)"):
        rk.init(tiny_model, tokenizer=char_tok, critic=tiny_model)
    shared = rk.models.critic(tiny_model)
    shared.base_model.embed_tokens = tiny_model.model.embed_tokens  # one shared module is enough
    with pytest.raises(ValueError, match="shares its parameters"):
        rk.init(tiny_model, tokenizer=char_tok, critic=shared)
    state = rk.init(tiny_model, tokenizer=char_tok, critic=rk.models.critic(tiny_model))
    assert state.critic is not None


@pytest.mark.parametrize("seed", [1.5, "0", -1, 2**63, True, None])
def test_init_seed_must_be_an_int_in_range(tiny_model, char_tok, seed):
    with pytest.raises(ValueError, match=r"rk.init: seed must be an int in \[0, 2\*\*63\)"):
        rk.init(tiny_model, tokenizer=char_tok, seed=seed)
    assert rk.init(tiny_model, tokenizer=char_tok, seed=2**63 - 1).seed == 2**63 - 1
