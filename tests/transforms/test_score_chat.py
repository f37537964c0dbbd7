"""TRL-style rewards get TRL's conversational format for chat prompts: ``prompts[i]`` the
conversation's message list and ``completions[i]`` ``[{"role": "assistant", "content": text}]``,
as TRL's ``GRPOTrainer`` builds them. rlkit passed the JSON of the messages and the plain text, so
a TRL reward indexing ``completion[0]["content"]`` failed, or counted the characters of a string.

Whether a prompt was a conversation is carried from ``load_prompts`` (``PromptSet.messages``)
through ``rollout`` (the batch's ``prompt_messages`` column) to ``score``: never guessed from
text, which may itself be JSON."""
import pickle

import pytest
import torch

import rlkit as rk
from rlkit.batch import BatchError, column, make_batch, set_column, split
from rlkit.data import DataError, PromptSet, Prompts, as_prompts
from rlkit.models.tokenizers import char_tokenizer
from rlkit.transforms.rollout import concat

SYSTEM = {"role": "system", "content": "be brief"}
CHAT = [SYSTEM, {"role": "user", "content": "1+1="}]
CHAT2 = [{"role": "user", "content": "2+2="}]
# a text prompt that is the JSON of a conversation: it stays text
JSON_TEXT = '[{"role": "user", "content": "3+3="}]'


@pytest.fixture(scope="module")
def tok():
    # the chat template tests/test_data.py uses, over the characters JSON text needs too
    t = char_tokenizer("0123456789+=: abcdefghijklmnopqrstuvwxyz[]{},\"")
    t.chat_template = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }} {% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")
    return t


@pytest.fixture(scope="module")
def state(tok):
    model = rk.models.tiny(tok, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    return rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=tok)


def _recorder(seen: list):
    """A TRL reward (its usual signature) recording what it was given, scoring the content length
    as a TRL reward for a conversational dataset does (``c[0]["content"]``) where the completion is
    a message list, and the text's length where it is a string."""
    def reward(prompts, completions, completion_ids, **kwargs):
        seen.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids})
        return [float(len(c[0]["content"]) if isinstance(c, list) else len(c)) for c in completions]

    return reward


def test_chat_prompts_reach_trl_rewards_as_trl_builds_them(state, tok):
    prompts = rk.load_prompts([{"prompt": CHAT, "answer": "2"}, {"prompt": CHAT2, "answer": "4"}], tok)
    batch = rk.rollout(state, prompts, n=1, max_new_tokens=3)
    texts = column(batch, "response_text")
    seen = []
    out = rk.score(batch, _recorder(seen))
    (got,) = seen
    # by hand, as TRL 1.x passes them for a conversational dataset
    assert got["prompts"] == [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}],
        [{"role": "user", "content": "2+2="}],
    ]
    assert got["completions"] == [[{"role": "assistant", "content": texts[0]}], [{"role": "assistant", "content": texts[1]}]]
    assert got["completion_ids"] == [r[m].tolist() for r, m in zip(batch["response_ids"], batch["response_mask"])]
    # the reward indexed the messages: the content's length, not that of a JSON string
    assert out["rewards"].tolist() == [float(len(t)) for t in texts]
    # what users see of the prompt stays printable text
    assert column(batch, "prompt_text") == ['[{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]',
                                            '[{"role": "user", "content": "2+2="}]']


def test_text_prompts_stay_strings_even_when_they_look_like_json(state, tok):
    batch = rk.rollout(state, ["1+1=", JSON_TEXT], n=1, max_new_tokens=3)
    assert "prompt_messages" not in batch.keys()
    seen = []
    rk.score(batch, _recorder(seen))
    assert seen[0]["prompts"] == ["1+1=", JSON_TEXT]
    assert seen[0]["completions"] == column(batch, "response_text")
    assert all(isinstance(c, str) for c in seen[0]["completions"])


def test_n_samples_per_prompt_and_a_mixed_batch_follow_each_row(state, tok):
    """Per sample: TRL decides for the whole batch from its first example; rlkit per row, so a text
    row keeps strings beside chat rows (the JSON-looking text one included)."""
    prompts = rk.load_prompts([{"prompt": CHAT}, {"prompt": JSON_TEXT}, {"prompt": "5+5="}, {"prompt": CHAT2}], tok)
    assert prompts.messages == [CHAT, None, None, CHAT2]
    batch = rk.rollout(state, prompts, n=2, max_new_tokens=3)
    texts = column(batch, "response_text")
    seen = []
    rk.score(batch, _recorder(seen))
    want_prompts = [CHAT, CHAT, JSON_TEXT, JSON_TEXT, "5+5=", "5+5=", CHAT2, CHAT2]
    assert seen[0]["prompts"] == want_prompts
    chat_rows = {0, 1, 6, 7}
    assert seen[0]["completions"] == [[{"role": "assistant", "content": t}] if i in chat_rows else t for i, t in enumerate(texts)]
    # the samples of one prompt get their own copies: a reward editing one edits nothing else
    assert seen[0]["prompts"][0] is not seen[0]["prompts"][1]


def test_a_reward_that_edits_its_prompts_changes_neither_the_batch_nor_the_next_reward(state, tok):
    batch = rk.rollout(state, [CHAT], n=2, max_new_tokens=3)

    def edits(prompts, completions, **_):
        prompts[0].append({"role": "assistant", "content": "x"})
        prompts[1][0]["content"] = "changed"
        return [0.0] * len(completions)

    seen = []
    rk.score(batch, {"edits": edits, "reads": _recorder(seen)})
    assert seen[0]["prompts"] == [CHAT, CHAT]
    assert column(batch, "prompt_messages") == [CHAT, CHAT]


def test_verl_and_batch_style_rewards_still_get_text(state, tok):
    batch = rk.rollout(state, [{"prompt": CHAT, "ground_truth": "2"}], n=2, max_new_tokens=3)
    got = {}

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        got.setdefault("verl", []).append(solution_str)
        return 0.0

    def by_batch(batch):
        got["batch"] = column(batch, "prompt_text")
        return torch.zeros(batch.batch_size[0])

    rk.score(batch, [compute_score, by_batch])
    assert got["verl"] == column(batch, "response_text")
    assert got["batch"] == [column(batch, "prompt_text")[0]] * 2 and isinstance(got["batch"][0], str)


def test_errors_name_a_chat_sample_by_its_printable_text(state, tok):
    batch = rk.rollout(state, [CHAT, "5+5="], n=1, max_new_tokens=3)

    def fails_on_chat(prompts, completions, **_):
        return [len(c[0]["content"]) / 0 if isinstance(c, list) else 0.0 for c in completions]

    with pytest.raises(rk.RewardError, match=r"ZeroDivisionError.*sample 0 \(prompt '\[\{\"role\": \"system\""):
        rk.score(batch, fails_on_chat)
    # a sharded reward's share names its rows from the lists it was given (rlkit.parallel's _failing_row)
    from rlkit.transforms.score import _sample_desc

    desc = _sample_desc(None, 0, [CHAT], [[{"role": "assistant", "content": "2"}]])
    assert desc == ("sample 0 (prompt '[{\"role\": \"system\", \"content\": \"be brief\"}, {\"role\": \"user\", \"content\": "
                    "\"1+1=\"}]', response '[{\"role\": \"assistant\", \"content\": \"2\"}]')")


def test_the_chat_rows_survive_slicing_concatenation_pickling_and_splitting(state, tok):
    chat = rk.rollout(state, rk.load_prompts([{"prompt": CHAT}, {"prompt": "5+5="}], tok), n=2, max_new_tokens=3)
    text = rk.rollout(state, ["1+1="], n=2, max_new_tokens=3)
    assert column(chat, "prompt_messages") == [CHAT, CHAT, None, None]

    def formats(batch):
        seen = []
        rk.score(batch, _recorder(seen))
        return [type(c).__name__ for c in seen[0]["completions"]], seen[0]["prompts"]

    assert formats(chat[1:3]) == (["list", "str"], [CHAT, "5+5="])
    assert formats(chat[torch.tensor([False, True, False, True])]) == (["list", "str"], [CHAT, "5+5="])
    assert formats(pickle.loads(pickle.dumps(chat))) == formats(chat)
    assert [formats(part)[1] for part in split(chat, 3)] == [[CHAT, CHAT, "5+5="], ["5+5="]]
    assert formats(torch.cat([chat[2:], chat[:2]]))[1] == ["5+5=", "5+5=", CHAT, CHAT]
    # rk's concat (DAPO's): a text-only part gets the column, None on its rows, where the fields differed
    both = concat([text, chat])
    assert column(both, "prompt_messages") == [None, None, CHAT, CHAT, None, None]
    assert formats(both) == (["str", "str", "list", "list", "str", "str"], ["1+1=", "1+1=", CHAT, CHAT, "5+5=", "5+5="])


def test_prompt_sets_carry_the_messages_to_every_batch(tok):
    prompts = rk.load_prompts([CHAT, "5+5=", CHAT2, JSON_TEXT], tok)
    assert prompts.messages == [CHAT, None, CHAT2, None]
    assert prompts.messages[0] is not CHAT  # a copy: editing the source after loading changes nothing
    assert prompts.take([2, 1]).messages == [CHAT2, None]
    assert prompts.batch_at(0, 2, shuffle=False).messages == [CHAT, None]
    assert prompts.take([1, 3]).messages == [None, None]  # a share without a conversation still has the field
    assert as_prompts(prompts, tok)[1:3].messages == [None, CHAT2]
    assert as_prompts(prompts, tok)[0].messages == [CHAT]
    assert rk.load_prompts(prompts.take([0, 1]), tok).messages == [CHAT, None]
    assert pickle.loads(pickle.dumps(prompts)).messages == prompts.messages
    assert rk.load_prompts(["1+1=", JSON_TEXT], tok).messages is None
    assert rk.load_prompts(["1+1="], tok, chat=True).messages is None  # rendered as a chat, but text data
    # a set pickled before the field existed: no messages (all text, as it was scored then)
    old = PromptSet(["1+1="], [[1]], {})
    del old.__dict__["messages"]
    assert pickle.loads(pickle.dumps(old)).messages is None
    with pytest.raises(DataError, match=r"Prompts has 1 rows of ids but 2 messages"):
        Prompts(["a"], [[1]], {}, [None, None])
    with pytest.raises(DataError, match=r"messages\[0\] is 'a'.*chat conversation"):
        Prompts(["a"], [[1]], {}, ["a"])


def test_a_hand_made_batch_may_carry_messages_and_a_bad_one_is_named():
    batch = make_batch([[1], [2]], [[3], [4]], columns={"prompt_text": ["p", "q"], "response_text": ["a", "b"],
                                                        "prompt_messages": [CHAT2, None]})
    seen = []
    rk.score(batch, _recorder(seen))
    assert seen[0]["prompts"] == [CHAT2, "q"] and seen[0]["completions"] == [[{"role": "assistant", "content": "a"}], "b"]
    set_column(batch, "prompt_messages", ["not a conversation", None])
    with pytest.raises(BatchError, match="column 'prompt_messages' row 0 is str"):
        rk.score(batch, _recorder([]))
    with pytest.raises(rk.data.DataError, match="prompt_messages"):
        rk.load_prompts([{"prompt": "1+1=", "prompt_messages": "x"}], char_tokenizer("0123456789+="))


def test_a_reward_sharded_over_ranks_builds_only_its_share():
    """rlkit.parallel.shard_reward's wrapper (``reads_row_shares``) slices its rows of the lazy
    per-row arguments itself: the conversational ones are built for those rows only."""
    batch = make_batch([[1], [2], [3]], [[4], [5], [6]], columns={"prompt_text": ["p", "q", "r"],
                                                                 "response_text": ["a", "b", "c"],
                                                                 "prompt_messages": [CHAT, None, CHAT2]})
    got = {}

    def share(completions, **kw):
        got["types"] = (type(completions).__name__, type(kw["prompts"]).__name__)
        got["rows"] = (list(completions[1:3]), list(kw["prompts"][1:3]))
        got["built"] = [r is not completions._MISSING for r in completions._rows]
        return [0.0, 0.0, 0.0]

    share.reads_row_shares = True
    rk.score(batch, share)
    assert got["types"] == ("LazyRows", "LazyRows")
    assert got["rows"] == (["b", [{"role": "assistant", "content": "c"}]], ["q", CHAT2])
    assert got["built"] == [False, True, True]


def test_trls_own_helper_agrees(state, tok):
    """TRL's ``is_conversational`` (which GRPOTrainer asks of ``{"prompt": prompts[0]}``) says the
    chat rows' prompts and completions are conversational and the text rows' are not."""
    data_utils = pytest.importorskip("trl.data_utils")
    batch = rk.rollout(state, rk.load_prompts([CHAT, JSON_TEXT], tok), n=1, max_new_tokens=3)
    seen = []
    rk.score(batch, _recorder(seen))
    (p_chat, p_text), (c_chat, c_text) = seen[0]["prompts"], seen[0]["completions"]
    assert data_utils.is_conversational({"prompt": p_chat, "completion": c_chat})
    assert data_utils.is_conversational({"completion": c_chat})
    assert not data_utils.is_conversational({"prompt": p_text})
    assert not data_utils.is_conversational({"completion": c_text})


@pytest.mark.parametrize("recipe", ["grpo", "dapo"])
def test_a_fit_step_gives_trl_rewards_the_conversational_format(tok, recipe):
    """One step of a recipe through rk.fit (batch_at, rollout with n samples, score, and for DAPO
    its concatenated attempts), on a set mixing chat and text prompts."""
    prompts = rk.load_prompts([{"prompt": CHAT, "answer": "2"}, {"prompt": "5+5=", "answer": "10"},
                               {"prompt": CHAT2, "answer": "4"}, {"prompt": JSON_TEXT, "answer": "6"}], tok)
    calls = []

    def accuracy(prompts, completions, answer, **kwargs):
        for p, c, a in zip(prompts, completions, answer):
            chat = a in ("2", "4")
            assert isinstance(p, list) == chat and isinstance(c, list) == chat, (p, c, a)
            if chat:
                assert p == {"2": CHAT, "4": CHAT2}[a] and len(c) == 1 and c[0]["role"] == "assistant"
            else:
                assert p == {"10": "5+5=", "6": JSON_TEXT}[a]
        calls.append(len(completions))
        return [float(len(c[0]["content"]) if isinstance(c, list) else len(c)) for c in completions]

    model = rk.models.tiny(tok, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    st = rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=tok)
    kw = {"max_attempts": 1, "overlong_buffer": 0} if recipe == "dapo" else {}
    st, history = rk.fit(st, rk.recipes.get(recipe, n=2, max_new_tokens=3, **kw), accuracy, prompts, steps=1, batch_size=4)
    assert st.step == 1 and calls and calls[0] == 8
