"""A run resumed on another prompt set: ``state.data_position`` counts batches of one particular
set, and ``fit`` used to go on at that position of whatever prompts it was given, silently.

Fast: a linear "model" and a made-up step stand in for a language model and a recipe (the
bookkeeping around the step is what is checked)."""
import warnings

import pytest
import torch

import rlkit as rk
from rlkit import checkpoint as ck
from rlkit.loop import PROMPTS_KEY, fit


def _state(seed=0):
    torch.manual_seed(seed)
    return rk.init(torch.nn.Linear(4, 3), rk.optim.adamw(lr=1e-2), seed=7)


class _Recipe:
    def step(self, state, prompts, reward):
        state.optimizer.zero_grad()
        sum((p ** 2).sum() for p in state.actor.parameters()).backward()
        state.optimizer.step()
        return state.replace(step=state.step + 1, policy_version=state.policy_version + 1), {"loss": 0.0}


def _reward(completions, **kwargs):
    return [0.0 for _ in completions]


def _prompts(tok, texts):
    return rk.load_prompts(texts, tok)


def test_a_resumed_run_on_other_prompts_warns_and_on_its_own_does_not(tmp_path, char_tok):
    own = _prompts(char_tok, [f"{i}+{i}=" for i in range(8)])
    other = _prompts(char_tok, [f"{i}*{i}=" for i in range(8)])  # same size: only the content differs
    saver = ck.Checkpointer(tmp_path, every=1, save_on_sigterm=False)
    state, _ = fit(_state(), _Recipe(), _reward, own, steps=2, batch_size=4, checkpointer=saver)
    assert state.extras[PROMPTS_KEY] == own.fingerprint()

    resumed = ck.Checkpointer(tmp_path, save_on_sigterm=False).resume(_state(seed=1), "auto")
    assert resumed.data_position == 2 and resumed.extras[PROMPTS_KEY] == own.fingerprint()  # kept on disk
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed, _ = fit(resumed, _Recipe(), _reward, own, steps=3, batch_size=4)

    with pytest.warns(RuntimeWarning, match=r"data_position=3 counts batches of another prompt set .*state.replace\(data_position=0\)"):
        resumed, _ = fit(resumed, _Recipe(), _reward, other, steps=4, batch_size=4)
    assert resumed.extras[PROMPTS_KEY] == other.fingerprint()  # the position now counts the new set's batches
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(resumed, _Recipe(), _reward, other, steps=5, batch_size=4)


def test_a_fresh_position_never_warns(char_tok):
    own = _prompts(char_tok, [f"{i}+{i}=" for i in range(8)])
    state, _ = fit(_state(), _Recipe(), _reward, own, steps=1, batch_size=4)
    state = state.replace(data_position=0)  # the documented way to start the data over
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(state, _Recipe(), _reward, _prompts(char_tok, ["1+2=", "3+4=", "5+6=", "7+8="]), steps=2, batch_size=4)


def test_the_fingerprint_sees_size_order_and_content_and_not_a_copy(char_tok):
    texts = [f"{i}+{i}=" for i in range(300)]
    base = _prompts(char_tok, texts).fingerprint()
    assert _prompts(char_tok, list(texts)).fingerprint() == base  # a copy: the same set
    assert _prompts(char_tok, texts[:-1]).fingerprint() != base
    assert _prompts(char_tok, texts[::-1]).fingerprint() != base
    assert _prompts(char_tok, ["9" + t for t in texts]).fingerprint() != base
