"""math_answer compares exactly and keeps non-separator commas; evaluate and arithmetic refuse a
seed a generator cannot take, naming it."""
import pytest

import rlkit as rk
from rlkit.rewards import exact_match, extract_hash_answer, math_answer


def test_math_answer_tells_large_integers_apart():
    # float() made both sides 1.2345678901234567e19 (and 9007199254740993 was 9007199254740992)
    assert math_answer(["#### 12345678901234567891", "#### 9007199254740993"],
                       ["12345678901234567890", "9007199254740992"]) == [0.0, 0.0]
    assert math_answer(["#### 12345678901234567891"], ["12345678901234567891"]) == [1.0]


def test_math_answer_drops_only_thousands_separators_as_exact_match_does():
    # every comma was deleted: "1,2" scored as 12, where exact_match documents it is not
    assert math_answer(["#### 1,2", "#### 12,34"], ["12", "1234"]) == [0.0, 0.0]
    assert exact_match(["1,2"], ["12"]) == [0.0]
    assert math_answer(["#### 1,234", "#### 1,234.5", "#### 2.0", "#### -5"], ["1234", "1234.5", "2", "-5"]) == [1.0] * 4
    assert extract_hash_answer("so #### 72,000 apples") == "72000"


@pytest.mark.parametrize("seed", ["a", 1.5, -1, None])
def test_arithmetic_refuses_a_seed_that_is_not_an_int(seed):
    with pytest.raises(ValueError, match=r"arithmetic: seed must be an int"):
        rk.tasks.arithmetic(digits=1, n_train=8, n_test=2, seed=seed)


def test_evaluate_refuses_a_seed_that_is_not_an_int():
    task = rk.tasks.arithmetic(digits=1, n_train=8, n_test=2)
    model = rk.models.tiny(task.tokenizer, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                           num_key_value_heads=1, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"evaluate: seed must be an int"):
        rk.evaluate(model, task.tokenizer, task.test, task.reward, max_new_tokens=2, temperature=1.0, seed=None)
