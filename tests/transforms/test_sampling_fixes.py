"""Top-k/top-p old log-probs, generation_config stop ids, fit's up-front prompt-length check,
scalar and numpy rewards, and tensor/numpy token-id prompt rows."""
import warnings

import numpy as np
import pytest
import torch

import rlkit as rk
from rlkit.batch import make_batch, set_column
from rlkit.data import DataError
from rlkit.engines import TorchEngine
from rlkit.transforms import forward as forward_mod
from rlkit.transforms.forward import model_logprobs


@pytest.fixture
def peaked(char_tok):
    """A tiny model with a peaked next-token distribution, so top-p 0.8 / top-k 5 filter tokens out."""
    model = rk.models.tiny(char_tok, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, tie_word_embeddings=False, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)
    return model


def _grpo_batch(state, **sampling):
    batch = rk.rollout(state, ["1+2=", "3*4=", "ab"], n=4, max_new_tokens=6, seed=0, **sampling)
    batch = rk.score(batch, lambda completions, **_: [float(len(c) % 3) for c in completions])
    return rk.advantage(batch, "grpo")


def _token_mean(x, mask):
    return float((x * mask).sum() / mask.sum())


@pytest.mark.parametrize("sampling", [{"top_k": 5}, {"top_p": 0.8}], ids=["top_k", "top_p"])
def test_filtered_rollout_trains_with_ratio_one_on_the_first_step(peaked, char_tok, sampling):
    """rollout records the log-probs of the filtered distribution; as old log-probs against the
    trainer's unfiltered ones the on-policy ratio was 0.7-0.8 (38% of tokens clipped at top_k=5)."""
    state = rk.init(peaked, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    batch = _grpo_batch(state, temperature=0.9, **sampling)
    mask = batch["response_mask"]
    trainer, _ = model_logprobs(peaked, batch, temperature=0.9)
    # the test means something: the rollout's log-probs are not the trainer's (unfiltered) ones
    assert _token_mean((trainer - batch["logprobs"]).abs(), mask) > 0.05
    # ratio 1 everywhere: ppo_clip's token-mean loss is -mean(A), nothing clipped, no KL
    expected = -_token_mean(batch["advantages"], mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, one = rk.update(state, batch, temperature=0.9, max_logprob_gap=1e-3)  # one optimizer step: all on-policy
    assert one["actor/pg_loss"] == pytest.approx(expected, abs=1e-6)
    assert one["actor/clipfrac"] == 0.0
    assert abs(one["actor/approx_kl"]) < 1e-6
    # the train-vs-rollout gap warning must not fire: on filtered rows the gap is by design; it is
    # measured over unfiltered rows only, and there are none here, so there is no gap metric either
    assert not [w for w in caught if "differ from the rollout" in str(w.message)]
    assert "actor/logprob_gap" not in one
    assert batch["logprobs_filtered"].dtype == torch.bool and batch["logprobs_filtered"].all()


def test_filtered_old_logprobs_equal_an_explicit_compute_old_logprobs(peaked, char_tok):
    """update's loss and new weights equal those of an update given rk.compute_old_logprobs."""
    import copy

    batch = _grpo_batch(rk.init(copy.deepcopy(peaked), tokenizer=char_tok), top_k=4)
    results = []
    for explicit in (False, True):
        state = rk.init(copy.deepcopy(peaked), rk.optim.adamw(lr=1e-2, eps=1.0, weight_decay=0.0), tokenizer=char_tok)
        given = rk.compute_old_logprobs(state, batch, micro_batch_size=5) if explicit else batch
        state, metrics = rk.update(state, given, mini_batch_size=4, micro_batch_size=2, max_logprob_gap=None)
        results.append((metrics, {k: v.detach().clone() for k, v in state.actor.named_parameters()}))
    (m0, p0), (m1, p1) = results
    for key in ("actor/pg_loss", "actor/clipfrac", "actor/approx_kl"):
        assert m0[key] == pytest.approx(m1[key], abs=1e-6), key
    for k in p0:
        torch.testing.assert_close(p0[k], p1[k], atol=1e-6, rtol=1e-5)


def test_unfiltered_rollout_keeps_its_log_probs_and_runs_no_extra_forward(peaked, char_tok, monkeypatch):
    state = rk.init(peaked, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    plain = _grpo_batch(state, temperature=0.9)
    assert "logprobs_filtered" not in plain.keys()  # existing batches keep their keys
    calls = []
    real = forward_mod.compute_old_logprobs
    monkeypatch.setattr(forward_mod, "compute_old_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    shifted = plain.clone()
    shifted.set("logprobs", plain["logprobs"] - 0.1 * plain["response_mask"])  # ratio e^0.1 if these are used
    _, metrics = rk.update(state, shifted, temperature=0.9, max_logprob_gap=None)
    assert calls == []
    assert metrics["actor/approx_kl"] == pytest.approx(-0.1, abs=1e-4)  # mean(old - new): the rollout's log-probs
    # a filtered batch runs the old-policy forward once; one with old_logprobs already does not
    state = rk.init(peaked, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    filtered = _grpo_batch(state, top_p=0.8)
    state, _ = rk.update(state, filtered, max_logprob_gap=None)
    assert calls == [1]
    state, _ = rk.update(state, real(state, _grpo_batch(state, top_p=0.8)), max_logprob_gap=None)
    assert calls == [1]


def test_filtered_flag_follows_rows_and_a_mixed_batch_measures_the_gap_on_unfiltered_rows(peaked, char_tok):
    state = rk.init(peaked, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    filtered = rk.rollout(state, ["1+2=", "ab"], n=2, max_new_tokens=5, top_k=3, seed=1)
    plain = rk.rollout(state, ["3*4="], n=2, max_new_tokens=7, seed=2)
    assert filtered[torch.tensor([0, 2])]["logprobs_filtered"].tolist() == [True, True]
    mixed = rk.concat([filtered, plain])
    assert mixed["logprobs_filtered"].tolist() == [True] * 4 + [False] * 2
    assert "logprobs_filtered" not in rk.concat([plain, plain]).keys()  # no flag column where no batch had one
    mixed = rk.advantage(rk.score(mixed, lambda completions, **_: [float(len(c)) for c in completions]), "grpo")
    rows = mixed[4:]
    lp, _ = model_logprobs(state.actor, rows)
    expected = _token_mean((lp - rows["logprobs"]).abs(), rows["response_mask"])
    state, metrics = rk.update(state, mixed, max_logprob_gap=None)
    assert metrics["actor/logprob_gap"] == pytest.approx(expected, rel=1e-4, abs=1e-7)
    assert metrics["actor/clipfrac"] == 0.0 and abs(metrics["actor/approx_kl"]) < 1e-6
    # only unmarked rows left (the flag column all False): the rollout's log-probs, as without it
    unmarked = mixed[4:]
    shifted = unmarked.clone()
    shifted.set("logprobs", unmarked["logprobs"] - 0.1 * unmarked["response_mask"])
    now, _ = model_logprobs(state.actor, shifted)  # the policy has moved one step since the rollout
    expected = _token_mean(shifted["logprobs"] - now, shifted["response_mask"])  # approx_kl = mean(old - new)
    assert abs(expected) > 0.05
    _, metrics = rk.update(state, rk.advantage(shifted, "grpo"), max_logprob_gap=None)
    assert metrics["actor/approx_kl"] == pytest.approx(expected, abs=1e-5)


class _Recording(TorchEngine):
    """The built-in engine, recording the SamplingParams each generate call gets."""

    def generate(self, prompts, params, **kw):
        self.seen = params
        return super().generate(prompts, params, **kw)


def _eot_model():
    tok = rk.models.char_tokenizer("0123456789+=")
    eot = tok.convert_tokens_to_ids("=")  # stands in for Llama-3's <|eot_id|>
    model = rk.models.tiny(tok, arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, seed=0)
    return tok, eot, model


def test_rollout_stops_at_every_eos_of_the_generation_config():
    tok, eot, model = _eot_model()
    model.generation_config.eos_token_id = [eot, tok.eos_token_id, eot]
    state = rk.init(model, tokenizer=tok)
    engine = _Recording.from_model(model)
    rk.rollout(state, ["12+3="], max_new_tokens=2, engine=engine)
    assert engine.seen.stop_token_ids == (tok.eos_token_id, eot)  # the tokenizer's first, de-duplicated
    model.generation_config.eos_token_id = eot  # one int
    rk.rollout(state, ["12+3="], max_new_tokens=2, engine=engine)
    assert engine.seen.stop_token_ids == (tok.eos_token_id, eot)
    rk.rollout(state, ["12+3="], max_new_tokens=2, engine=engine, stop_token_ids=[tok.eos_token_id])  # as given
    assert engine.seen.stop_token_ids == (tok.eos_token_id,)
    for kind in ("torch", "hf"):
        b = rk.rollout(state, ["12+3="] * 8, max_new_tokens=24, engine=kind, decode=False)
        rows = [r[m].tolist() for r, m in zip(b["response_ids"], b["response_mask"])]
        assert not any(eot in r[:-1] for r in rows), (kind, rows)  # nothing generated past the end of a turn
        assert any(r[-1] == eot for r in rows), (kind, rows)  # and some rows did end there
        assert not b["truncated"][[r[-1] == eot for r in rows]].any()
    # an explicit list is used as given: the same rows now run past eot
    b = rk.rollout(state, ["12+3="] * 8, max_new_tokens=24, stop_token_ids=[tok.eos_token_id], decode=False)
    assert any(eot in r[m].tolist()[:-1] for r, m in zip(b["response_ids"], b["response_mask"]))


def test_evaluate_stops_where_rollout_does():
    tok, eot, model = _eot_model()
    model.generation_config.eos_token_id = [tok.eos_token_id, eot]
    engine = _Recording.from_model(model)
    rk.evaluate(model, tok, ["12+3="], lambda completions, **_: [0.0] * len(completions), engine=engine)
    assert engine.seen.stop_token_ids == (tok.eos_token_id, eot)  # evaluate stopped only at the tokenizer's EOS


def test_fit_checks_every_prompt_against_the_context_before_step_0(char_tok):
    model = rk.models.tiny(char_tok, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=16, seed=0)
    state = rk.init(model, tokenizer=char_tok)
    prompts = ["1+1=", "2+2=", "1+2+3+4+5+6=", "3+3="]  # row 2: 12 tokens, + 6 new > 16
    calls = []

    def reward(completions, **_):
        calls.append(1)
        return [0.0] * len(completions)

    recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=6)
    with pytest.raises(ValueError, match=r"row 2 .*12 tokens.*max_new_tokens=6.*context of 16") as info:
        rk.fit(state, recipe, reward, prompts, steps=3, batch_size=1, shuffle=False)
    assert calls == [] and state.step == 0  # before the first step: the state is still usable
    assert "prompt 0" not in str(info.value)
    state, _ = rk.fit(state, recipe.with_(max_new_tokens=4), reward, prompts, steps=1, batch_size=1, shuffle=False)
    assert state.step == 1


def _text_batch():
    batch = make_batch([[5, 6], [5, 6], [7], [7]], [[1, 2], [3], [4, 4], [2]], group=[0, 0, 1, 1])
    set_column(batch, "response_text", ["a", "b", "c", "d"])
    set_column(batch, "prompt_text", ["p", "p", "q", "q"])
    return batch


def test_a_trl_reward_returning_one_number_is_told_so_after_one_call():
    calls = []

    def mean_reward(completions, **_):
        calls.append(len(completions))
        return 0.5

    with pytest.raises(rk.RewardError, match=r"'mean_reward' must return one number per completion .*got float '0.5'") as info:
        rk.score(_text_batch(), mean_reward)
    assert calls == [4]
    assert "sample 0" not in str(info.value)


def test_a_b_by_1_numpy_reward_column_scores_as_the_tensor_does():
    column = [[1.0], [0.0], [0.5], [0.25]]
    as_tensor = rk.score(_text_batch(), lambda completions, **_: torch.tensor(column))["rewards"]
    as_numpy = rk.score(_text_batch(), lambda completions, **_: np.array(column))["rewards"]
    assert as_numpy.tolist() == as_tensor.tolist() == [1.0, 0.0, 0.5, 0.25]
    assert rk.score(_text_batch(), lambda completions, **_: np.array([1, 0, 1, 1]))["rewards"].tolist() == [1.0, 0.0, 1.0, 1.0]
    with pytest.raises(rk.RewardError, match=r"returned a tensor of shape \(4, 2\) for a batch of 4 responses"):
        rk.score(_text_batch(), lambda completions, **_: np.ones((4, 2)))


def test_prompts_take_tensor_and_numpy_token_id_rows(char_tok, tiny_model):
    rows = [[5, 6, 7], [8, 9]]
    prompts = rk.Prompts(["a", "b"], [torch.tensor(rows[0]), np.array(rows[1])])
    assert prompts.ids == rows and all(type(t) is int for r in prompts.ids for t in r)
    assert rk.Prompts(["a", "b"], torch.tensor([[5, 6], [8, 9]])).ids == [[5, 6], [8, 9]]
    state = rk.init(tiny_model, tokenizer=char_tok)
    got = rk.rollout(state, prompts, max_new_tokens=2, seed=0)
    want = rk.rollout(state, rk.Prompts(["a", "b"], rows), max_new_tokens=2, seed=0)
    assert torch.equal(got["prompt_ids"], want["prompt_ids"]) and torch.equal(got["response_ids"], want["response_ids"])
    one = rk.rollout(state, rk.Prompts(["0"], [torch.tensor([3])]), max_new_tokens=2)  # one token: not empty
    assert one["prompt_ids"].tolist() == [[3]]
    # id 0, a falsy tensor, is not empty either: it is this tokenizer's pad, refused as padding (not as "zero tokens")
    assert rk.Prompts(["<pad>"], [torch.tensor([0])]).ids == [[0]]
    with pytest.raises(DataError, match="begins or ends with the pad token"):
        rk.rollout(state, rk.Prompts(["<pad>"], [torch.tensor([0])]), max_new_tokens=2)
    with pytest.raises(DataError, match=r"row 1 is a 1-d torch.float32 Tensor.*1-d integer tensor"):
        rk.Prompts(["a", "b"], [torch.tensor([5]), torch.tensor([1.0, 2.0])])
    with pytest.raises(DataError, match=r"row 0 .*2-d"):
        rk.Prompts(["a"], [np.array([[5, 6]])])


def test_top_k_of_the_whole_vocabulary_is_not_a_filter(peaked, char_tok):
    """top_k >= the logits' width keeps every token: the engine samples exactly as unfiltered, so
    the batch is not marked logprobs_filtered (which had update recompute its old log-probs and drop
    the actor/logprob_gap check); top_k one below the width still is a filter."""
    from rlkit.transforms.rollout import is_filtered
    from rlkit.engines import SamplingParams

    vocab = peaked.lm_head.weight.shape[0]
    state = rk.init(peaked, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    plain = _grpo_batch(state, temperature=0.9)
    for k in (vocab, 10 * vocab):
        whole = _grpo_batch(state, temperature=0.9, top_k=k)
        assert "logprobs_filtered" not in whole.keys()
        assert torch.equal(whole["response_ids"], plain["response_ids"])
        state, metrics = rk.update(state, whole, temperature=0.9, max_logprob_gap=None)
        assert "actor/logprob_gap" in metrics
        plain = _grpo_batch(state, temperature=0.9)  # the updated weights' unfiltered sample
    assert _grpo_batch(state, temperature=0.9, top_k=vocab - 1)["logprobs_filtered"].all()
    assert is_filtered(SamplingParams(max_new_tokens=2, top_k=vocab)) is True  # no width known: any top_k filters
    assert is_filtered(SamplingParams(max_new_tokens=2, top_k=vocab), vocab) is False
