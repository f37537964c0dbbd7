"""Edge cases of the transforms' arguments and batches: update's arguments are all checked before
any work (max_logprob_gap was compared only after the optimizer step, which then donated the state
as unfinished), a gap warning raised as an error keeps the finished update (exc.state), the gap
warnings name train-mode dropout, 0-row batches and batches longer than the model's context are
refused by every transform, the log-prob passes check micro_batch_size as update does, and batches
with different fields are named before they are concatenated."""
import copy
import types
import warnings

import pytest
import torch
import transformers

import rlkit as rk
from rlkit import batch as batch_module
from rlkit.batch import BatchError, make_batch
from rlkit.recipes.dapo import keep_informative_groups
from rlkit.state import DonatedStateError
from rlkit.transforms.forward import model_logprobs
from rlkit.transforms.update import NonFiniteError

PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10], [1, 11]]
RESPONSES = [[3, 4, 5], [6, 7], [8], [9, 10, 11, 12]]


def _batch(model, *, shift=0.0, rewards=(1.0, 0.0, 0.5, 2.0), group=(0, 0, 1, 1)):
    """A hand-made batch whose logprobs are ``model``'s own (eval mode) plus ``shift``, with GRPO advantages."""
    plain = make_batch(PROMPTS, RESPONSES, group=list(group))
    lp, _ = model_logprobs(model, plain)
    rows = [(lp[i, : len(r)] + shift).tolist() for i, r in enumerate(RESPONSES)]
    batch = make_batch(PROMPTS, RESPONSES, group=list(group), logprobs=rows, rewards=list(rewards))
    return rk.advantage(batch, "grpo")


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _state(model, **kw):
    return rk.init(copy.deepcopy(model), rk.optim.adamw(lr=1e-2), **kw)


# ---------------------------------------------------------------------------------------------
# 1. max_logprob_gap checked up front; a gap warning raised as an error keeps the finished update


@pytest.mark.parametrize("gap", ["0.5", -1, 0, float("nan"), float("inf"), True])
def test_invalid_max_logprob_gap_is_refused_before_any_change(tiny_model, char_tok, gap):
    """A YAML string or -1 failed after optimizer.step() (a TypeError, a KeyError), so update
    donated the state as unfinished: the step and the state were lost."""
    state = _state(tiny_model, tokenizer=char_tok)
    batch = _batch(tiny_model)
    before = _params(state.actor)
    with pytest.raises(ValueError, match=r"max_logprob_gap must be a finite number > 0, or None \(never warn\), got"):
        rk.update(state, batch, max_logprob_gap=gap)
    assert _same(before, _params(state.actor))
    assert state.step == 0  # still usable: not donated
    state, _ = rk.update(state, batch, max_logprob_gap=0.5)
    assert state.step == 1


def test_gap_warning_raised_as_error_carries_the_finished_update(tiny_model, char_tok):
    """warnings.simplefilter("error") (pytest's filterwarnings = error) turned the gap warning,
    raised after the optimizer step, into a donation of the state as unfinished."""
    batch = _batch(tiny_model, shift=0.3)  # a stale engine: the rollout's log-probs are 0.3 off
    reference = _state(tiny_model, tokenizer=char_tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, expected_metrics = rk.update(reference, batch, max_logprob_gap=0.1)
    state = _state(tiny_model, tokenizer=char_tok)
    before = _params(state.actor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="log-probs differ from the rollout's by 0.3") as info:
            rk.update(state, batch, max_logprob_gap=0.1)
    new_state = info.value.state
    assert new_state.step == 1 and new_state.policy_version == 1
    assert not _same(before, _params(new_state.actor))  # the step's work is kept ...
    assert _same(_params(expected.actor), _params(new_state.actor))  # ... and is the update's
    assert info.value.metrics == expected_metrics
    assert info.value.metrics["actor/logprob_gap"] == pytest.approx(0.3, abs=1e-5)
    assert any("exc.state" in note for note in info.value.__notes__)
    with pytest.raises(DonatedStateError, match="donated to rlkit.update and can no longer be used"):
        state.step  # noqa: B018 - donated to the finished update, not as unfinished
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        newer, _ = rk.update(new_state, batch)  # the carried state trains on
    assert newer.step == 2


def _gpt2(char_tok, rate):
    config = transformers.GPT2Config(
        vocab_size=len(char_tok), n_embd=32, n_layer=1, n_head=2, n_positions=64,
        resid_pdrop=rate, embd_pdrop=rate, attn_pdrop=rate,
        bos_token_id=char_tok.bos_token_id, eos_token_id=char_tok.eos_token_id, pad_token_id=char_tok.pad_token_id,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _gap_warnings(state, batch, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rk.update(state, batch, **kw)
    return [str(w.message) for w in caught if "rlkit.update: at step" in str(w.message)]


def test_gap_warnings_name_train_mode_dropout(char_tok):
    """GPT-2's default dropout of 0.1, on in the update's train-mode forward: the batch's log-probs
    are exactly the model's (eval mode), so the gap is dropout noise only, which the warnings now say."""
    model = _gpt2(char_tok, 0.1)
    batch = _batch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rk.init's own dropout warning
        state = rk.init(copy.deepcopy(model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    (message,) = _gap_warnings(state, batch, max_logprob_gap=1e-4)
    assert "trainer's log-probs differ from the rollout's" in message
    assert "applies dropout in train mode" in message and "attn_pdrop" in message
    assert "dropout noise" in message and "rk.models.disable_dropout(model) before rk.init" in message
    # the batch's old_logprobs, from the eval-mode pass, against the train-mode forward: the same note
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = rk.init(copy.deepcopy(model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    old = rk.compute_old_logprobs(state, batch)
    messages = _gap_warnings(state, old, max_logprob_gap=1e-4)
    assert any("old_logprobs differ" in m and "rk.models.disable_dropout" in m for m in messages)


def test_gap_warnings_without_dropout_do_not_mention_it(char_tok):
    model = _gpt2(char_tok, 0.0)
    state = rk.init(copy.deepcopy(model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    (message,) = _gap_warnings(state, _batch(model, shift=0.3), max_logprob_gap=0.1)
    assert "differ from the rollout's by 0.3" in message and "dropout" not in message


# ---------------------------------------------------------------------------------------------
# 2. a batch of 0 rows


def _empty(model):
    """What DAPO's filter gives when every group's rewards agree: no row."""
    batch = _batch(model, rewards=(1.0, 1.0, 0.0, 0.0))
    empty = keep_informative_groups(batch)
    assert empty.batch_size[0] == 0
    return empty


def test_zero_row_batch_is_refused_by_every_transform(tiny_model, char_tok):
    """validate accepted it, then advantage failed with an IndexError, the log-prob passes with
    "range() arg 3 must not be zero" and update with "mini_batch_size ... got 0 and 0"."""
    state = _state(tiny_model, tokenizer=char_tok, ref="copy", critic=rk.models.critic(tiny_model))
    empty = _empty(tiny_model)
    before = _params(state.actor)
    calls = {
        "validate": lambda: rk.validate(empty),
        "advantage": lambda: rk.advantage(empty, "grpo"),
        "compute_old_logprobs": lambda: rk.compute_old_logprobs(state, empty),
        "compute_ref_logprobs": lambda: rk.compute_ref_logprobs(state, empty),
        "compute_values": lambda: rk.compute_values(state, empty),
        "update": lambda: rk.update(state, empty),
        "batch[mask] all False": lambda: rk.update(state, _batch(tiny_model)[torch.zeros(4, dtype=torch.bool)]),
    }
    for name, call in calls.items():
        with pytest.raises(BatchError, match=r"the batch has no rows \(batch_size 0\).*Skip this step.*DAPO"):
            call()
    assert _same(before, _params(state.actor)) and state.step == 0
    # one row is enough: the check is on the rows, not on the filter
    state, _ = rk.update(state, _batch(tiny_model)[:2])
    assert state.step == 1


# ---------------------------------------------------------------------------------------------
# 3. numeric arguments checked, naming the argument


@pytest.mark.parametrize("fn", ["compute_old_logprobs", "compute_ref_logprobs", "compute_values"])
def test_forward_passes_check_micro_batch_size_as_update_does(tiny_model, char_tok, fn):
    """-1 failed in torch.cat, 2.5 in range(), and 0 silently meant the whole batch where update refuses it."""
    state = _state(tiny_model, tokenizer=char_tok, ref="copy", critic=rk.models.critic(tiny_model))
    batch = _batch(tiny_model)
    for bad in (-1, 2.5, 0, "4", True):
        with pytest.raises(ValueError, match=rf"rk\.{fn}: micro_batch_size must be a positive int .*or None .*got {bad!r}"):
            getattr(rk, fn)(state, batch, micro_batch_size=bad)
    with pytest.raises(ValueError, match=r"micro_batch_size must be a positive int or None \(the whole batch\), got 0"):
        rk.update(state, batch, micro_batch_size=0)  # the rule the passes follow
    key = {"compute_old_logprobs": "old_logprobs", "compute_ref_logprobs": "ref_logprobs", "compute_values": "values"}[fn]
    whole = getattr(rk, fn)(state, batch)[key]
    torch.testing.assert_close(getattr(rk, fn)(state, batch, micro_batch_size=3)[key], whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kw,match", [
    (dict(epochs=2.0), r"epochs must be a positive int \(passes over the batch\), got 2\.0"),
    (dict(epochs=0), r"epochs must be a positive int \(passes over the batch\), got 0"),
    (dict(entropy_coef="0.01"), r"entropy_coef must be a finite number \(0: no entropy bonus\), got the str '0\.01'; pass a number: entropy_coef=0\.01$"),
    (dict(entropy_coef=float("nan")), r"entropy_coef must be a finite number .*got nan"),
    (dict(critic_coef=-1.0), r"critic_coef must be a finite number >= 0 .*got -1\.0; for instance: critic_coef=1$"),
    (dict(critic_coef=float("inf")), r"critic_coef must be a finite number >= 0 .*got inf"),
    (dict(mini_batch_size="2"), r"mini_batch_size must be a positive int or None \(the whole batch\), got '2'"),
])
def test_update_checks_its_numbers_before_any_work(tiny_model, char_tok, kw, match):
    state = _state(tiny_model, tokenizer=char_tok)
    batch = _batch(tiny_model)
    before = _params(state.actor)
    with pytest.raises(ValueError, match=match):
        rk.update(state, batch, **kw)
    assert _same(before, _params(state.actor)) and state.step == 0


def test_update_takes_entropy_coef_as_a_number_or_one_element_tensor(tiny_model, char_tok):
    """The recipes take a 0-d tensor ("as update takes it"): it still trains as the float does."""
    batch = _batch(tiny_model)
    a, _ = rk.update(_state(tiny_model, tokenizer=char_tok), batch, entropy_coef=0.01)
    b, _ = rk.update(_state(tiny_model, tokenizer=char_tok), batch, entropy_coef=torch.tensor(0.01))
    c, _ = rk.update(_state(tiny_model, tokenizer=char_tok), batch, entropy_coef=0.0)
    assert _same(_params(a.actor), _params(b.actor))
    assert not _same(_params(a.actor), _params(c.actor))  # the coefficient is applied


# ---------------------------------------------------------------------------------------------
# 4. batches with different fields; batches longer than the model's context


def test_check_same_fields_names_what_a_part_lacks(tiny_model):
    a = _batch(tiny_model)
    b = a.exclude("advantages", "returns")
    with pytest.raises(BatchError, match=r"concat: the batches have different fields \(part 1 lacks \['advantages', 'returns'\]; "
                                         r".*batch\.exclude\(\*\['advantages', 'returns'\]\)\) or add them to every part"):
        batch_module.check_same_fields([a, b], "concat")
    batch_module.check_same_fields([a, a.clone()], "concat")


def test_batch_longer_than_the_context_is_refused(char_tok):
    """rollout, fit and evaluate refuse prompts that do not fit the context; update and the passes
    trained a hand-made batch of any length."""
    model = rk.models.tiny(char_tok, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, max_position_embeddings=8, seed=0)
    state = _state(model, tokenizer=char_tok, ref="copy", critic=rk.models.critic(model))
    long = make_batch([[1, 5, 6, 7, 8], [1, 7]], [[3, 4, 5, 6], [6, 7]], group=[0, 0], logprobs=[[-1.0] * 4, [-1.0] * 2])
    long.set("advantages", torch.ones(2, 4))
    before = _params(state.actor)
    calls = {
        "rk.update": lambda: rk.update(state, long),
        "rk.compute_old_logprobs": lambda: rk.compute_old_logprobs(state, long),
        "rk.compute_ref_logprobs": lambda: rk.compute_ref_logprobs(state, long),
        "rk.compute_values": lambda: rk.compute_values(state, long),
    }
    for where, call in calls.items():
        with pytest.raises(ValueError, match=rf"{where}: row 0 of the batch \(5 prompt \+ 4 response tokens\) needs 9 "
                                             r"positions, over the model's context of 8 tokens.*rows over it are \[0\] of 2"):
            call()
    assert _same(before, _params(state.actor)) and state.step == 0
    # padded to 5 + 4 = 9 columns, but no row is longer than 8 tokens: accepted
    fits = make_batch([[1, 5, 6, 7, 8], [1, 7]], [[3, 4, 5], [6, 7, 8, 9]], group=[0, 0],
                      logprobs=[[-1.0] * 3, [-1.0] * 4])
    fits.set("advantages", torch.ones(2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state, _ = rk.update(state, rk.compute_values(state, fits))
    assert state.step == 1


def test_concat_names_the_fields_a_part_lacks(tiny_model):
    """rk.concat of a scored batch and an unscored one failed inside torch.cat with a bare KeyError."""
    from rlkit.transforms.rollout import concat

    a = _batch(tiny_model)
    with pytest.raises(BatchError, match=r"concat: the batches have different fields \(part 1 lacks \['advantages'"):
        concat([a, a.exclude("advantages", "returns")])
    assert concat([a, a.clone()]).batch_size[0] == 2 * a.batch_size[0]


def test_fit_keeps_the_finished_update_a_step_failed_after(tiny_model, char_tok):
    """fit's except-block put the state passed to the step (donated to the finished update) on the
    exception, as None, over the new state the update's exception carried."""
    batch = _batch(tiny_model, shift=0.3)

    def step(state, prompts, reward):
        return rk.update(state, batch, max_logprob_gap=0.1)

    state = _state(tiny_model, tokenizer=char_tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="log-probs differ") as info:
            rk.fit(state, types.SimpleNamespace(step=step), "exact_match", ["1+1="] * 4,
                   steps=3, batch_size=2)
    assert info.value.state.step == 1  # the update's new state, not None
    assert info.value.history == []


def _critic_batch(state, model, nan_returns):
    batch = rk.compute_values(state, _batch(model))
    batch = rk.advantage(batch, "gae")
    if nan_returns:
        batch.set("returns", batch["returns"] * float("nan"))
    return batch


def test_non_finite_critic_step_is_skipped_warned_and_counted(tiny_model, char_tok):
    """The critic's non-finite gradient zeroed its step silently, every update, with no streak."""
    state = _state(tiny_model, tokenizer=char_tok, critic=rk.models.critic(tiny_model))
    actor_before, critic_before = _params(state.actor), _params(state.critic)
    batch = _critic_batch(state, tiny_model, nan_returns=True)
    with pytest.warns(RuntimeWarning, match=r"non-finite critic loss or gradient at step 0 .*critic optimizer step skipped \(1 in a row\)"):
        state, metrics = rk.update(state, batch, max_nonfinite_steps=2, max_logprob_gap=None)
    assert metrics["critic/skipped_steps"] == 1.0 and metrics["actor/skipped_steps"] == 0.0
    assert _same(critic_before, _params(state.critic))  # the critic kept its weights
    assert not _same(actor_before, _params(state.actor))  # the actor trained on
    with pytest.warns(RuntimeWarning, match=r"\(2 in a row\)"):
        with pytest.raises(NonFiniteError, match="2 consecutive updates had a non-finite critic loss"):
            rk.update(state, batch, max_nonfinite_steps=2, max_logprob_gap=None)


def test_a_finite_critic_step_resets_its_streak(tiny_model, char_tok):
    state = _state(tiny_model, tokenizer=char_tok, critic=rk.models.critic(tiny_model))
    with pytest.warns(RuntimeWarning, match="non-finite critic"):
        state, _ = rk.update(state, _critic_batch(state, tiny_model, nan_returns=True), max_nonfinite_steps=2, max_logprob_gap=None)
    assert state.extras["critic_nonfinite_streak"] == 1
    state, metrics = rk.update(state, _critic_batch(state, tiny_model, nan_returns=False), max_nonfinite_steps=2, max_logprob_gap=None)
    assert state.extras["critic_nonfinite_streak"] == 0 and metrics["critic/skipped_steps"] == 0.0


@pytest.mark.parametrize("bad", [0, "3", 1.5])
def test_max_nonfinite_steps_is_checked_up_front(tiny_model, char_tok, bad):
    state = _state(tiny_model, tokenizer=char_tok)
    with pytest.raises((ValueError, TypeError), match="max_nonfinite_steps"):
        rk.update(state, _batch(tiny_model), max_nonfinite_steps=bad)
    assert state.step == 0


@pytest.mark.parametrize("name", ["group", "values", "token_rewards", "response_mask"])
def test_advantage_refuses_a_batch_input_passed_as_an_option(tiny_model, name):
    """group= failed with Python's "got multiple values for keyword argument 'group'"; an
    estimator taking **kw received it instead of the batch's."""
    batch = _batch(tiny_model)
    with pytest.raises(TypeError, match=rf"advantage: \['{name}'\] are read from the batch .*batch.set\('{name}', tensor\)"):
        rk.advantage(batch, "grpo", **{name: batch["response_mask"]})

    def mine(token_rewards, response_mask, **kw):
        return token_rewards, token_rewards

    with pytest.raises(TypeError, match=r"\['values'\] are read from the batch"):
        rk.advantage(batch, mine, values=torch.zeros_like(batch["advantages"]))
