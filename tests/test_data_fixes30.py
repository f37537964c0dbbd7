"""Bring-your-own-data paths a probe found wrong:

- ``rk.Prompts(texts, tokenizer(texts, padding=True, return_tensors="pt")["input_ids"])`` (a 2-d
  id tensor, documented as accepted) kept the padding as prompt tokens: the engine generated after
  it, other responses than for the same texts. The tokenizer's whole output (with its
  attention_mask) now gives the unpadded rows, and padded rows are refused by rollout and fit.
- a chat prompt ending with an assistant message (a prefill) was closed and a new assistant turn
  opened; TRL continues it (``continue_final_message=True``).
- ``rk.evaluate`` given several rewards (as fit takes them) reported their sum as "accuracy" and
  nothing else.
"""
from __future__ import annotations

import pytest

import rlkit as rk
from rlkit.data import DataError

TEXTS = ["12+3=", "1+2=", "40+41="]


@pytest.fixture(scope="module")
def task():
    return rk.tasks.arithmetic(digits=2, n_train=8, n_test=4)


@pytest.fixture()
def state(task):
    model = rk.models.tiny(task.tokenizer, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    return rk.init(model, tokenizer=task.tokenizer)


@pytest.mark.parametrize("side", ["left", "right"])
def test_the_tokenizers_whole_output_gives_the_unpadded_rows(task, side):
    tok = task.tokenizer
    old, tok.padding_side = tok.padding_side, side
    try:
        enc = tok(TEXTS, padding=True, return_tensors="pt")
    finally:
        tok.padding_side = old
    assert (enc["attention_mask"] == 0).any()  # the shorter rows are padded
    prompts = rk.Prompts(TEXTS, enc)
    assert prompts.ids == [tok(t)["input_ids"] for t in TEXTS]


def test_padded_id_rows_are_refused_by_rollout_and_fit_naming_the_row_and_the_fix(task, state):
    tok = task.tokenizer
    padded = tok(TEXTS, padding=True, return_tensors="pt")["input_ids"]
    prompts = rk.Prompts(TEXTS, padded)
    with pytest.raises(DataError, match=r"rollout: prompt row 0 begins or ends with the pad token \(id 0\).*attention_mask"):
        rk.rollout(state, prompts, n=2, max_new_tokens=3)
    plan = rk.Pipeline(rk.recipes.get("grpo").with_(n=2, max_new_tokens=3), reward=lambda completions, **_: [0.0] * len(completions)).lower()
    with pytest.raises(DataError, match=r"fit: prompt row 0 .*rows: 0, 1"):
        plan.fit(state, prompts, steps=1, batch_size=3)
    assert state.step == 0
    # the same texts, unpadded: they roll out
    batch = rk.rollout(state, rk.Prompts(TEXTS, tok(TEXTS, padding=True, return_tensors="pt")), n=2, max_new_tokens=3)
    assert batch["prompt_ids"].shape[0] == 6


def test_a_leading_pad_that_is_the_bos_is_a_real_bos(task, state):
    tok = task.tokenizer
    old = tok.bos_token
    tok.bos_token = tok.pad_token
    try:
        rk.rollout(state, rk.Prompts(["1+2="], [[tok.pad_token_id, *tok("1+2=")["input_ids"]]]), max_new_tokens=2)
    finally:
        tok.bos_token = old


TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% if not loop.last or m['role'] != 'assistant' "
            "or not continue_final_message %}|{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")


def test_a_chat_prompt_ending_with_an_assistant_message_is_continued_as_trl_does(task):
    from rlkit.models.tokenizers import char_tokenizer

    tok = char_tokenizer("0123456789+= <>|aus")
    tok.chat_template = TEMPLATE
    prefill = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    ask = [{"role": "user", "content": "1+2="}]
    got = rk.load_prompts([prefill, ask], tok)
    assert tok.decode(got.ids[0]) == "<u>1+2=|<a>3"          # the prefill continued, no new turn
    assert tok.decode(got.ids[1]) == "<u>1+2=|<a>"           # a new assistant turn after a user message
    assert got.ids[0] == tok.apply_chat_template(prefill, continue_final_message=True, tokenize=True)["input_ids"]


def test_evaluate_reports_each_rewards_mean_beside_their_sum(task, state):
    def ones(completions, **_):
        return [float(c.count("1") > 0) for c in completions]

    def long(completions, **_):
        return [float(len(c) >= 2) for c in completions]

    both = rk.evaluate(state, task.tokenizer, task.test, [ones, long], max_new_tokens=4)
    alone = [rk.evaluate(state, task.tokenizer, task.test, fn, max_new_tokens=4)["accuracy"] for fn in (ones, long)]
    assert both["reward/ones"] == pytest.approx(alone[0]) and both["reward/long"] == pytest.approx(alone[1])
    assert both["accuracy"] == pytest.approx(sum(alone))
    assert set(rk.evaluate(state, task.tokenizer, task.test, ones, max_new_tokens=4)) == {"accuracy", "mean_response_len", "n"}
    # an independent count: the greedy responses scored by hand
    batch = rk.rollout(state, task.test, temperature=0, max_new_tokens=4)
    texts = task.tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(batch["response_ids"], batch["response_mask"])],
                                        skip_special_tokens=True)
    assert both["reward/long"] == pytest.approx(sum(len(t) >= 2 for t in texts) / len(texts))
    assert both["n"] == len(task.test)
