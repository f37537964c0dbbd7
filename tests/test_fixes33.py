"""Session 33's fixes: a re-scored batch drops the earlier score's reward/* columns; a truncated
prompt's text is the text the model sees; fold_in keys numbers by value."""
import numpy as np
import pytest
import torch

import rlkit as rk


def test_scoring_again_drops_the_earlier_functions_columns(task, fresh_state):
    batch = rk.rollout(fresh_state(), task.train.batch_at(0, 2, shuffle=False), n=2, max_new_tokens=3)

    def half(completions, **kw):
        return [0.5] * len(completions)

    def one(completions, **kw):
        return [1.0] * len(completions)

    first = rk.score(batch, [half])
    again = rk.score(first, [one])
    assert sorted(k for k in again.keys() if k.startswith("reward")) == ["reward/one", "rewards"]
    metrics = rk.recipes.reward_metrics(again)
    assert "reward/half_mean" not in metrics and metrics["reward/one_mean"] == 1.0
    assert "reward/half" in first.keys()  # the earlier batch keeps its own


def test_a_truncated_text_prompt_carries_the_text_of_the_tokens_kept(task, fresh_state):
    ps = rk.load_prompts([{"prompt": "12+34=", "answer": "46"}], task.tokenizer, max_prompt_tokens=3, truncate=True)
    assert ps.text == ["34="] and task.tokenizer.decode(ps.ids[0]) == "34="
    seen = {}

    def reward(completions, prompts, **kw):
        seen["prompts"] = list(prompts)
        return [0.0] * len(completions)

    batch = rk.rollout(fresh_state(), ps.batch_at(0, 1, shuffle=False), n=1, max_new_tokens=2)
    rk.score(batch, reward)
    assert seen["prompts"] == ["34="]  # the reward got the whole prompt, text the model never saw
    untouched = rk.load_prompts([{"prompt": "12+34="}], task.tokenizer, max_prompt_tokens=6, truncate=True)
    assert untouched.text == ["12+34="]


def test_a_truncated_conversation_warns_that_its_messages_are_whole():
    from rlkit.models.tokenizers import char_tokenizer

    tok = char_tokenizer("0123456789+= <>|aus")
    tok.chat_template = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}|{% endfor %}"
                         "{% if add_generation_prompt %}<a>{% endif %}")
    talk = [{"role": "user", "content": "12+34="}]
    with pytest.warns(RuntimeWarning, match=r"1 chat conversation\(s\) \(row\(s\) \[0\]\) were cut"):
        ps = rk.load_prompts([talk], tok, max_prompt_tokens=5, truncate=True)
    assert len(ps.ids[0]) == 5 and ps.messages == [talk]


def test_fold_in_keys_equal_numbers_alike_and_refuses_others():
    key = rk.fold_in(1, 3, "x")
    assert key == rk.fold_in(np.int64(1), np.int64(3), "x") == rk.fold_in(torch.tensor(1), torch.tensor(3), "x")
    assert rk.fold_in(0, "init") == 2020223635098297231  # the keys of ints and strings are the ones they were
    for bad in (3.0, None, [3]):
        with pytest.raises(TypeError, match="path item 0 must be an integer"):
            rk.fold_in(1, bad)
    with pytest.raises(TypeError, match="seed must be an integer"):
        rk.fold_in(1.5, 3)
