"""Engine inputs a probe found mishandled: fractional prompt ids, a non-bool ignore_stop, a numpy or
0-d tensor pad id for HFEngine."""
import numpy as np
import pytest
import torch

from rlkit.engines import HFEngine, SamplingParams, TorchEngine


@pytest.mark.parametrize("bad", [[[5, 14.7, 6]], [[1.0, 5.0]], [torch.tensor([1.0, 2.0])]])
def test_fractional_prompt_ids_are_refused_not_truncated(model, bad):
    # torch.tensor([5, 14.7, 6]) is [5, 14, 6]: another prompt, generated from without a word
    with pytest.raises(ValueError, match="not an integer token id"):
        TorchEngine.from_model(model).generate(bad, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="not an integer token id"):
        HFEngine(model, 0).generate(bad, SamplingParams(max_new_tokens=2))


def test_integer_prompts_of_every_kind_generate_the_same(model):
    engine = TorchEngine.from_model(model)
    params = SamplingParams(max_new_tokens=3, temperature=0)
    want = engine.generate([[5, 6, 7]], params).response_ids
    for prompt in (torch.tensor([5, 6, 7]), np.array([5, 6, 7]), (np.int64(5), 6, 7)):
        assert torch.equal(engine.generate([prompt], params).response_ids, want)


def test_ignore_stop_must_be_a_bool():
    with pytest.raises(ValueError, match="ignore_stop must be True or False"):
        SamplingParams(ignore_stop="no")  # truthy: every stop token was ignored
    assert SamplingParams(ignore_stop=True).ignore_stop


@pytest.mark.parametrize("pad", [np.int64(0), torch.tensor(0)])
def test_hf_engine_takes_an_integer_pad_id_of_any_type(model, pad):
    # it said "the tokenizer has no pad_token_id ... or pass the pad id as an int" to a pad id
    assert HFEngine(model, pad).pad_token_id == 0
