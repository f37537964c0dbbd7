"""What the engines and rollout/evaluate do with inputs users give them: models with dropout or a
dynamic rotary, prompts as a dict, one-off engine names, single stop ids, seeds and temperatures.
Each test fails on the code before its fix."""
from __future__ import annotations

import pytest
import torch

import rlkit as rk
from rlkit.data import as_prompts
from rlkit.engines import HFEngine, SamplingParams, TorchEngine
from rlkit.transforms.forward import model_logprobs
from rlkit.transforms.rollout import batch_from_generation

TEXTS = ["12+3=", "7", "abc def gh", "99", "a+b=c"]


def _gap(model, batch) -> float:
    lp, _ = model_logprobs(model, batch)
    return float((lp - batch["logprobs"])[batch["response_mask"]].abs().max())


def test_hf_engine_samples_without_dropout(tok, refs):
    """The actor is in train mode after rk.init and update; HFEngine ran generate() in it, so a
    model with dropout sampled noisy tokens (greedy differed by seed) with log-probs up to 3.4 off."""
    model = refs.make_model(tok, attention_dropout=0.3).train()
    state = rk.init(model, rk.optim.adamw(lr=1e-4), tokenizer=tok)
    a = rk.rollout(state, TEXTS, max_new_tokens=8, temperature=0, engine="hf", seed=0)
    b = rk.rollout(state, TEXTS, max_new_tokens=8, temperature=0, engine="hf", seed=1)
    assert torch.equal(a["response_ids"], b["response_ids"])
    assert _gap(model, a) < 1e-5
    assert model.training  # the caller's mode is given back


def test_dynamic_rope_under_256_positions_matches_the_trainer(tok, refs):
    """The engine's rotary table was built for 256 positions at once; a dynamic rotary rescales
    for a sequence past the model's context, so a 64-position model was rotated wrongly."""
    model = refs.make_model(tok, arch="llama", max_position_embeddings=64, rope_theta=10000.0,
                       rope_scaling={"rope_type": "dynamic", "factor": 2.0}).double()
    prompts = as_prompts(TEXTS, tok)
    out = TorchEngine.from_model(model).generate(prompts.ids, SamplingParams(max_new_tokens=12, temperature=0))
    assert _gap(model, batch_from_generation(prompts, out, tok)) < 1e-5


def test_rollout_reads_a_dict_of_columns_as_load_prompts_does(tok, model):
    state = rk.init(model, rk.optim.adamw(lr=1e-4), tokenizer=tok)
    batch = rk.rollout(state, {"prompt": ["1+2=", "3+4=", "5+6="], "answer": ["3", "7", "11"]}, max_new_tokens=2)
    # list() of the dict was its keys: two prompts, "prompt" and "answer"
    assert list(batch["prompt_text"]) == ["1+2=", "3+4=", "5+6="]
    assert list(batch["answer"]) == ["3", "7", "11"]
    one = rk.rollout(state, {"prompt": "1+2=", "answer": "3"}, max_new_tokens=2)
    assert list(one["prompt_text"]) == ["1+2="] and list(one["answer"]) == ["3"]


def test_a_one_off_engine_name_does_not_become_the_default(tok, model):
    state = rk.init(model, rk.optim.adamw(lr=1e-4), tokenizer=tok)
    before = rk.rollout(state, TEXTS, n=2, max_new_tokens=6)
    rk.rollout(state, TEXTS, max_new_tokens=2, engine="hf")
    after = rk.rollout(state, TEXTS, n=2, max_new_tokens=6)
    assert isinstance(state._cache["engine"], TorchEngine)
    assert torch.equal(before["response_ids"], after["response_ids"])


def test_stop_token_ids_take_one_id_or_a_tensor(tok, model):
    state = rk.init(model, rk.optim.adamw(lr=1e-4), tokenizer=tok)
    stop = tok.encode("3")[0]
    ref = rk.rollout(state, TEXTS, n=2, max_new_tokens=8, stop_token_ids=[stop], seed=5)
    for given in (stop, torch.tensor([stop])):  # int: a TypeError; tensor: refused as "(tensor(2),)"
        got = rk.rollout(state, TEXTS, n=2, max_new_tokens=8, stop_token_ids=given, seed=5)
        assert torch.equal(got["response_ids"], ref["response_ids"])
        assert torch.equal(got["response_mask"], ref["response_mask"])


def test_rollout_seed_must_be_a_63_bit_int(tok, model):
    state = rk.init(model, rk.optim.adamw(lr=1e-4), tokenizer=tok)
    for seed in (1.5, 2**64, -1, "7"):  # 1.5 sampled as 1; 2**64 overflowed in the generator
        with pytest.raises(ValueError, match=rf"rollout: seed must be an int in \[0, 2\*\*63\) or None.*got {seed!r}"):
            rk.rollout(state, TEXTS, max_new_tokens=2, seed=seed)


def test_temperatures_that_overflow_the_logits_are_refused():
    with pytest.raises(ValueError, match=r"temperature=1e-38 is below 0.0001.*use temperature=0 for greedy"):
        SamplingParams(temperature=1e-38)
    assert SamplingParams(temperature=1e-4).temperature == 1e-4


def test_evaluate_takes_engine_names_and_numbers_prompts_in_the_whole_set(tok, model):
    reward = lambda completions, **_: [float(len(c)) for c in completions]  # noqa: E731
    by_name = rk.evaluate(model, tok, ["12+3=", "7"], reward, max_new_tokens=3, engine="hf")
    by_object = rk.evaluate(model, tok, ["12+3=", "7"], reward, max_new_tokens=3, engine=HFEngine(model, tok))
    assert by_name == by_object
    with pytest.raises(TypeError, match="evaluate: engine must be None.*a name.*got int"):
        rk.evaluate(model, tok, ["7"], reward, engine=3)
    # with batch_size=1 a second prompt without tokens was reported as "prompt 0"
    empty_second = rk.data.Prompts(["7", "x"], [tok.encode("7"), []])
    with pytest.raises(ValueError, match="evaluate: prompt 1 tokenized to zero tokens"):
        rk.evaluate(model, tok, empty_second, reward, batch_size=1)


def test_hf_engine_names_prompt_ids_outside_the_vocabulary(tok, model):
    vocab = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"generate: prompt 1 has token ids outside \[0, {vocab}\)"):
        HFEngine(model, tok).generate([[5, 6], [5, vocab + 2]], SamplingParams(max_new_tokens=2))
