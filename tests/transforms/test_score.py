import pytest
import torch

import rlkit as rk
from rlkit.batch import make_batch
from rlkit.rewards import RewardModel, exact_match, extract_hash_answer, format_reward, hash_format, math_answer


def _batch():
    return make_batch(
        [[1], [2], [3]], [[4], [5], [6]],
        columns={"prompt_text": ["1+1=", "2+2=", "3+3="], "response_text": ["2", "5", "#### 6"], "answer": ["2", "4", "6"]},
    )


def test_trl_and_verl_style_rewards_weighted():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(ground_truth in solution_str)}

    out = rk.score(_batch(), {"exact": exact_match, "verl": compute_score}, weights={"exact": 1.0, "verl": 0.5})
    assert out["reward/exact"].tolist() == [1.0, 0.0, 0.0]
    assert out["reward/verl"].tolist() == [1.0, 0.0, 1.0]
    assert out["rewards"].tolist() == [1.5, 0.0, 0.5]


def test_reward_errors_name_the_sample():
    def raises(completions, **_):
        return [1.0 if c != "5" else 1 / 0 for c in completions]

    with pytest.raises(rk.RewardError, match="raises.*ZeroDivisionError.*sample 1.*'2\\+2='"):
        rk.score(_batch(), raises)
    with pytest.raises(rk.RewardError, match="returned nan for sample 2"):
        rk.score(_batch(), lambda completions, **_: [0.0, 1.0, float("nan")])
    with pytest.raises(rk.RewardError, match="returned 2 values for a batch of 3"):
        rk.score(_batch(), lambda completions, **_: [0.0, 1.0])


def test_none_means_the_reward_does_not_apply_as_in_trl():
    """TRL's convention for mixed datasets: a function returns None for a sample it does not apply
    to; the weighted total sums only the functions that scored each sample (TRL: nansum over the
    functions). Hand-worked: sample 0 scored by both (1*1 + 0.5*1), 1 only by 'verbose' (0.5*1), 2
    only by 'exact' (1*0)."""
    def exact(completions, answer, **_):
        return [float(c == a) if i != 1 else None for i, (c, a) in enumerate(zip(completions, answer))]

    def verbose(completions, **_):
        return [float(len(c) == 1) if i != 2 else None for i, c in enumerate(completions)]

    out = rk.score(_batch(), {"exact": exact, "verbose": verbose}, weights={"exact": 1.0, "verbose": 0.5})
    assert out["rewards"].tolist() == [1.5, 0.5, 0.0]
    assert torch.isnan(out["reward/exact"][1]) and torch.isnan(out["reward/verbose"][2])
    assert out["reward/exact"][[0, 2]].tolist() == [1.0, 0.0]
    from rlkit.recipes.base import reward_metrics

    metrics = reward_metrics(out)
    assert metrics["reward/exact_mean"] == 0.5 and metrics["reward/verbose_mean"] == 1.0  # over the samples scored
    assert metrics["reward/mean"] == pytest.approx(2.0 / 3)

    with pytest.raises(rk.RewardError, match="sample 1 .*has no reward: every one of the 2 reward functions returned None.*1 such"):
        rk.score(_batch(), [exact, lambda completions, **_: [1.0, None, 0.0]])
    with pytest.raises(rk.RewardError, match="sample 0 .*has no reward: the reward function returned None.*3 such.*return 0.0"):
        rk.score(_batch(), lambda completions, **_: [None] * 3)


def test_rewards_must_be_numbers():
    with pytest.raises(rk.RewardError, match="returned str '1' for sample 0.*return numbers"):
        rk.score(_batch(), lambda completions, **_: ["1", "0", "1"])
    with pytest.raises(rk.RewardError, match="returned list .* for sample 2"):
        rk.score(_batch(), lambda completions, **_: [1.0, 0.0, [1.0]])
    with pytest.raises(rk.RewardError, match="must return one number per completion .*got float '1.0'"):
        rk.score(_batch(), lambda batch: 1.0)  # batch style, one number for the whole batch

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return None

    with pytest.raises(rk.RewardError, match="returned None for sample 0.*compute_score must return a number"):
        rk.score(_batch(), compute_score)
    # numbers of every kind are fine: bool, int, numpy scalars, 0-d tensors
    np = pytest.importorskip("numpy")
    out = rk.score(_batch(), lambda completions, **_: [True, np.float64(0.5), torch.tensor(2)])
    assert out["rewards"].tolist() == [1.0, 0.5, 2.0]


def test_ready_made_rewards():
    assert extract_hash_answer("so it is 12\n#### 1,234") == "1234"
    assert extract_hash_answer("no answer") is None
    assert math_answer(["work #### 72", "#### 71", "72"], ["blah #### 72", "72", "72"]) == [1.0, 0.0, 0.0]
    fmt = format_reward(r"\d+")
    assert fmt(["12", "1a", " 7 "]) == [1.0, 0.0, 1.0]
    assert exact_match([" 1,000", "9"], ["1000", "8"]) == [1.0, 0.0]
    # numbers compare as numbers; a reference that is not a number compares as text
    assert math_answer(["#### 72.0", "#### -3", "#### 5"], ["72", "#### -3.00", "five"]) == [1.0, 1.0, 0.0]
    assert hash_format(["x\n#### 12", "#### twelve", "12"]) == [1.0, 0.0, 0.0]


def test_registry_errors_say_what_is_valid():
    registry = rk.algos.POLICY_LOSSES
    assert registry.get("ppo_clip") is registry.get(registry.get("ppo_clip"))  # a callable passes through
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'.*ppo_clip"):
        registry.get("ppo")
    with pytest.raises(TypeError, match="a name .* or a callable, got int"):
        registry.get(3)
    with pytest.raises(ValueError, match="'ppo_clip' is already registered"):
        registry.register("ppo_clip")(lambda *a, **k: None)
    assert "ppo_clip" in registry and "ppo" not in registry and list(registry) == registry.names()


@pytest.mark.parametrize("config_pad", ["tokenizer's", None])
def test_reward_model_role_scores_the_sequences(char_tok, config_pad):
    """Each sequence scored as it is alone, unpadded; also for a classifier whose config has no
    pad_token_id (transformers refused a batch of more than one: RewardModel aligns the sequences
    itself), whose config is left as it was."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    pad = char_tok.pad_token_id if config_pad else None
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(char_tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=pad)
    rm = Qwen2ForSequenceClassification(cfg).eval()
    batch = make_batch([[5, 6], [7]], [[8, 9, 10], [11]], pad_token_id=char_tok.pad_token_id)
    got = rk.score(batch, RewardModel(rm))["rewards"]
    # reference: each row alone, unpadded
    with torch.no_grad():
        ref = [rm(input_ids=torch.tensor([[5, 6, 8, 9, 10]])).logits[0, 0], rm(input_ids=torch.tensor([[7, 11]])).logits[0, 0]]
    torch.testing.assert_close(got, torch.stack(ref), atol=1e-5, rtol=1e-5)
    assert rm.config.pad_token_id == pad  # the model is left as it was


def test_lazy_rows_compute_each_row_once_in_blocks():
    from rlkit.transforms.score import LazyRows, materialize

    calls = []

    def compute(lo, hi):
        calls.append((lo, hi))
        return [f"row{i}" for i in range(lo, hi)]

    rows = LazyRows(6, compute)
    assert len(rows) == 6 and calls == []  # nothing computed before it is read
    assert rows[2:4] == ["row2", "row3"] and calls == [(2, 4)]
    assert rows[-1] == "row5" and calls[-1] == (5, 6)
    assert rows[1:5] == ["row1", "row2", "row3", "row4"] and calls[-1] == (1, 5)
    assert rows[::2] == ["row0", "row2", "row4"]
    assert materialize(rows) == [f"row{i}" for i in range(6)] and list(rows) == materialize(rows)
    n_calls = len(calls)
    assert rows[:] == materialize(rows) and len(calls) == n_calls  # all cached now
    with pytest.raises(IndexError):
        rows[6]


def test_reward_functions_get_plain_lists_of_decoded_text():
    """score decodes lazily, but a user's reward sees ordinary lists (it may concatenate, pickle,
    index with numpy, ...)."""
    from rlkit.batch import make_batch
    from rlkit.models.tokenizers import char_tokenizer
    from rlkit.transforms.score import score

    tok = char_tokenizer("abc123")
    batch = make_batch([tok.encode("ab"), tok.encode("ca")], [tok.encode("12"), tok.encode("3")])
    got = {}

    def reward(completions, prompts, completion_ids):
        got.update(completions=completions, prompts=prompts, ids=completion_ids)
        return [1.0, 2.0]

    score(batch, reward, tokenizer=tok)
    assert got["completions"] == ["12", "3"] and got["prompts"] == ["ab", "ca"]
    assert all(type(v) is list for v in got.values())
    assert got["ids"] == [tok.encode("12"), tok.encode("3")]


def test_built_in_rewards_by_name_and_bad_rewards_or_weights_are_named():
    """A name was iterated as a list of callables ("'e' is not a callable object"); a NaN weight
    made every reward NaN silently; a weight for no function was ignored."""
    by_name = rk.score(_batch(), "exact_match")
    assert by_name["rewards"].tolist() == rk.score(_batch(), exact_match)["rewards"].tolist() == [1.0, 0.0, 0.0]
    assert rk.score(_batch(), ["exact_match", "hash_format"])["rewards"].tolist() == [1.0, 0.0, 1.0]
    for reward, match in ((None, "reward is None"), ("exactmatch", "unknown reward 'exactmatch'.*exact_match"),
                          ([exact_match, 3], "a reward must be a function"), (3, "reward must be a function, a list")):
        with pytest.raises(rk.RewardError, match=match):
            rk.score(_batch(), reward)
    for weights, match in (([float("nan")], "weight of reward 'exact_match' must be a finite number, got nan"),
                           (2.0, "weights must be a list"),
                           ({"exact_match": 1.0, "other": 2.0}, "unknown \\['other'\\]")):
        with pytest.raises(rk.RewardError, match=match):
            rk.score(_batch(), exact_match, weights=weights)
