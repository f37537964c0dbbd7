"""A reward returning a 2-D tensor or a dict is named by what it returned, not by a count of
flattened values or keys."""
import pytest
import torch

import rlkit as rk
from rlkit.batch import make_batch


def _batch():
    return make_batch([[1, 2]] * 4, [[3], [4, 4], [5], [6]], columns={"response_text": ["a", "bb", "c", "d"], "prompt_text": ["p"] * 4})


def test_a_two_column_tensor_is_named_by_its_shape():
    with pytest.raises(rk.RewardError, match=r"returned a tensor of shape \(4, 2\) for a batch of 4 responses; return one "
                                             r"number per completion \(shape \(4,\)\)"):
        rk.score(_batch(), lambda completions, **kw: torch.ones(len(completions), 2))
    # a (b, 1) column still counts as one number per completion
    out = rk.score(_batch(), lambda completions, **kw: torch.arange(len(completions), dtype=torch.float32)[:, None])
    assert out["rewards"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_dict_is_named_as_a_dict():
    with pytest.raises(rk.RewardError, match=r"returned a dict \(keys \['score'\]\) for a batch of 4 responses"):
        rk.score(_batch(), lambda completions, **kw: {"score": [1.0] * len(completions)})


def test_a_misspelt_reward_keyword_gets_a_did_you_mean():
    # it said "needs the column 'prompt' ... e.g. [{'prompt': ..., 'prompt': ...}]"
    def singular(completions, prompt, **kw):
        return [1.0] * len(completions)

    with pytest.raises(rk.RewardError, match=r"takes a parameter 'prompt', which nothing passes: did you mean 'prompts'\?"):
        rk.score(_batch(), singular)
