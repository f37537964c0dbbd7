"""How ``score`` calls reward functions written for TRL and verl: verl's own data format, TRL's
keyword call, async functions, batch-style functions with options, and the batch's own columns."""
import asyncio
import functools

import pytest

import rlkit as rk
from rlkit.batch import make_batch
from rlkit.models.tokenizers import char_tokenizer
from rlkit.transforms.score import reward_style

TOK = char_tokenizer("0123456789+= abc")  # '0' is id 4


def _ids(text):
    return TOK.encode(text)


def _batch(**columns):
    return make_batch([_ids("1+3="), _ids("2+4=")], [_ids("4"), _ids("7")], columns=columns or None)


def test_verl_reward_reads_ground_truth_from_verls_reward_model_column():
    """verl's preprocessing (examples/data_preprocess/gsm8k.py) keeps the answer in
    reward_model={"style": "rule", "ground_truth": ...}: it was passed as ground_truth=None."""
    got = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        got.append(ground_truth)
        return float(solution_str == ground_truth)

    verl_rows = _batch(data_source=["openai/gsm8k"] * 2, extra_info=[{"index": 0}, {"index": 1}],
                       reward_model=[{"style": "rule", "ground_truth": "4"}, {"style": "rule", "ground_truth": "6"}])
    out = rk.score(verl_rows, compute_score, tokenizer=TOK)
    assert got == ["4", "6"] and out["rewards"].tolist() == [1.0, 0.0]
    got.clear()
    with pytest.raises(rk.RewardError, match=r"'compute_score' needs a ground_truth.*'reward_model'.*its columns: \['solution'\].*ground_truth"):
        rk.score(_batch(solution=["4", "6"]), compute_score, tokenizer=TOK)
    assert got == []  # refused before any call, not scored against None
    with pytest.raises(rk.RewardError, match="'reward_model' column of sample 1 is 'x', not a dict with a 'ground_truth' key"):
        rk.score(_batch(reward_model=[{"ground_truth": "4"}, "x"]), compute_score, tokenizer=TOK)


def test_trl_reward_is_called_by_keyword_as_trl_calls_it():
    def prompts_first(prompts, completions, **kw):  # TRL: reward_func(prompts=..., completions=..., ...)
        return [float(p.endswith("=") and c in ("4", "7")) for p, c in zip(prompts, completions)]

    def only_kwargs(**kw):
        return [float(c == a) for c, a in zip(kw["completions"], kw["answer"])]

    def responses_first(responses, answer):  # first parameter named otherwise: positional, as before
        return [float(c == a) for c, a in zip(responses, answer)]

    b = _batch(answer=["4", "6"])
    assert rk.score(b, prompts_first, tokenizer=TOK)["rewards"].tolist() == [1.0, 1.0]
    assert rk.score(b, only_kwargs, tokenizer=TOK)["rewards"].tolist() == [1.0, 0.0]
    assert rk.score(b, responses_first, tokenizer=TOK)["rewards"].tolist() == [1.0, 0.0]


def test_async_rewards_are_awaited_also_inside_a_running_event_loop():
    calls = []

    async def exact(completions, answer, **kw):
        calls.append(len(completions))
        await asyncio.sleep(0)
        return [float(c == a) for c, a in zip(completions, answer)]

    async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str == ground_truth)

    b = _batch(answer=["4", "6"])
    assert rk.score(b, [exact, compute_score], tokenizer=TOK)["rewards"].tolist() == [2.0, 0.0]

    async def in_jupyter():  # a notebook cell runs inside an event loop: asyncio.run refuses there
        return rk.score(b, exact, tokenizer=TOK)["rewards"].tolist()

    assert asyncio.run(in_jupyter()) == [1.0, 0.0]
    calls.clear()

    async def fails(completions, **kw):
        calls.append(len(completions))
        raise ConnectionError("judge unreachable")

    with pytest.raises(rk.RewardError, match="'fails' raised ConnectionError: judge unreachable.*not retried sample by sample"):
        rk.score(b, fails, tokenizer=TOK)
    assert calls == [2]  # called once for the batch, not again per sample


def test_batch_style_rewards_may_have_options_with_defaults():
    def length_penalty(batch, scale=0.1):
        return -scale * batch["response_mask"].sum(-1).float()

    def with_keyword_only(batch, *, scale=1.0):
        return scale * batch["response_mask"].sum(-1).float()

    b = make_batch([_ids("1")] * 2, [_ids("456"), _ids("4")])
    for fn in (length_penalty, functools.partial(length_penalty, scale=0.5), with_keyword_only):
        assert reward_style(fn) == "batch"
    assert rk.score(b, length_penalty, tokenizer=TOK)["rewards"].tolist() == pytest.approx([-0.3, -0.1])
    assert rk.score(b, functools.partial(length_penalty, scale=0.5), tokenizer=TOK)["rewards"].tolist() == [-1.5, -0.5]
    assert reward_style(lambda batch, answer: 0) == "trl"  # a required second parameter: not called as f(batch)


def test_rewards_get_the_data_columns_not_the_batchs_own():
    seen = {}

    def record(completions, **kw):
        seen.update(kw)
        return [0.0] * len(completions)

    b = _batch(answer=["4", "6"])
    b.set_non_tensor("rollout_metrics", {"rollout/seconds": 0.1})  # as rollout stores it
    rk.score(b, record, tokenizer=TOK)
    # TRL's own keywords besides the data columns; never the batch's rollout_metrics
    assert sorted(seen) == ["answer", "completion_ids", "log_extra", "log_metric", "prompts", "trainer_state"]
    # the names the missing-column check counts as given are the ones passed
    from rlkit.transforms.score import TRL_KEYWORDS

    assert sorted(TRL_KEYWORDS) == sorted(set(seen) - {"answer"})


def test_hash_format_scores_only_completions_that_end_with_the_answer_line():
    from rlkit.rewards import hash_format

    # "#### 42" then more text scored 1.0, although the docstring says the completion must end with it
    assert hash_format(["#### 42\nWait, let me reconsider. The answer might be 7.", "Answer:\n#### 42", "so\n#### -1,000.5\n\n",
                        "the answer is #### 42", "#### forty-two", ""]) == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_rewards_see_text_without_special_tokens_as_documented_and_can_opt_out():
    """As TRL and verl, rewards score text decoded with skip_special_tokens=True ("4<unk>6" is
    "46"); score and decode_batch now say so, and how to score the special tokens too."""
    from rlkit.batch import column, row_tokens, set_column
    from rlkit.models.tokenizers import decode_batch

    for doc in (rk.score.__doc__, decode_batch.__doc__):
        assert "skip_special_tokens=True" in doc and "46" in doc, doc
    four, six, unk = TOK.convert_tokens_to_ids(["4", "6", "<unk>"])
    b = make_batch([_ids("1+3=")] * 2, [[four, six], [four, unk, six]], columns={"answer": ["46", "46"]})
    assert rk.score(b, "exact_match", tokenizer=TOK)["rewards"].tolist() == [1.0, 1.0]
    set_column(b, "response_text", TOK.batch_decode(row_tokens(b["response_ids"], b["response_mask"]), skip_special_tokens=False))
    assert column(b, "response_text") == ["46", "4<unk>6"]
    assert rk.score(b, "exact_match", tokenizer=TOK)["rewards"].tolist() == [1.0, 0.0]


def test_a_trl_reward_missing_its_column_is_named_with_the_fix_before_it_is_called():
    """exact_match(completions, answer) on prompts without an 'answer' column raised Python's
    "missing 1 required positional argument: 'answer'", blamed on sample 0, after the rollout."""
    from rlkit.rewards import exact_match

    calls = []

    def by_keyword(completions, solution, **kwargs):
        calls.append(1)
        return [1.0] * len(completions)

    def positional(responses, answer, scale=1.0):  # the completions come positionally
        calls.append(1)
        return [scale] * len(responses)

    def defaulted(completions, answer=None, **kwargs):
        return [float(answer is None)] * len(completions)

    with pytest.raises(rk.RewardError, match=r"^reward 'exact_match' needs the column 'answer', which the prompts do not "
                                             r"have \(their data columns: none: prompts given as plain strings carry no "
                                             r"columns\)\. Give the prompts as rows that carry it, e\.g\. \[\{'prompt': \.\.\., 'answer': \.\.\.\}\]"):
        rk.score(_batch(), exact_match, tokenizer=TOK)
    with pytest.raises(rk.RewardError, match=r"'by_keyword' needs the column 'solution'.*their data columns: 'answer'"):
        rk.score(_batch(answer=["4", "6"]), by_keyword, tokenizer=TOK)
    with pytest.raises(rk.RewardError, match=r"'positional' needs the column 'answer'"):
        rk.score(_batch(solution=["4", "6"]), positional, tokenizer=TOK)
    assert calls == []
    # present, or defaulted: called as before
    assert rk.score(_batch(answer=["4", "6"]), exact_match, tokenizer=TOK)["rewards"].tolist() == [1.0, 0.0]
    assert rk.score(_batch(answer=["4", "6"]), positional, tokenizer=TOK)["rewards"].tolist() == [1.0, 1.0]
    assert rk.score(_batch(), defaulted, tokenizer=TOK)["rewards"].tolist() == [1.0, 1.0]


def test_fit_and_evaluate_name_a_missing_reward_column():
    task = rk.tasks.arithmetic(digits=1, n_train=8, n_test=4)
    state = rk.init(rk.models.tiny(task.tokenizer, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=1, seed=0), tokenizer=task.tokenizer)
    plain = ["1+2=", "3+4=", "5+1=", "2+2="]
    recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=2)
    with pytest.raises(rk.RewardError, match=r"^fit: reward 'exact_match' needs the column 'answer'"):
        rk.fit(state, recipe, task.reward, plain, steps=1, batch_size=2)
    assert not state.is_donated and state.step == 0
    with pytest.raises(rk.RewardError, match=r"reward 'exact_match' needs the column 'answer'"):
        rk.evaluate(state, task.tokenizer, plain, task.reward, max_new_tokens=2)
    # the task's own prompts carry the answers
    state, _ = rk.fit(state, recipe, task.reward, task.train, steps=1, batch_size=2)
    assert state.step == 1
