"""Prompt values: a batch (``Prompts``) indexes, iterates and converts like a sequence of rows;
``load_prompts``, ``rollout`` and ``fit`` take prompts in every form the others hand out."""
import contextlib
import itertools
import signal

import pytest

import rlkit as rk
from rlkit.data import Prompts, PromptSet, as_prompts


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging: the old code looped forever on these calls."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def task():
    return rk.tasks.arithmetic(n_train=32, n_test=8)


def test_a_batch_of_prompts_indexes_and_iterates_like_a_sequence(task):
    batch = task.train.batch_at(0, 4, shuffle=False)
    rows = list(itertools.islice(batch, 10))  # was endless: [i] past the end returned an empty batch
    assert len(rows) == 4 and all(isinstance(r, Prompts) and len(r) == 1 for r in rows)
    assert [r.text[0] for r in rows] == batch.text and [r.ids[0] for r in rows] == batch.ids
    assert [r.columns["answer"][0] for r in rows] == batch.columns["answer"]
    assert batch[-1].text == batch.text[-1:] and batch[1:3].text == batch.text[1:3]
    with pytest.raises(IndexError, match="prompt 4 out of range for 4 prompts"):
        batch[4]
    with pytest.raises(IndexError):
        batch[-5]
    with pytest.raises(TypeError):
        batch["answer"]


def test_load_prompts_and_rollout_take_what_the_library_hands_out(task):
    batch = task.train.batch_at(0, 4, shuffle=False)
    with deadline(30):
        loaded = rk.load_prompts(batch, task.tokenizer)  # used to loop forever
    assert isinstance(loaded, PromptSet) and loaded.text == batch.text and loaded.ids == batch.ids
    assert loaded.columns == batch.columns
    assert rk.load_prompts(task.train, task.tokenizer) is task.train
    every = as_prompts(task.test, task.tokenizer)  # a whole set: every prompt (was a TypeError)
    assert every.text == task.test.text and every.ids == task.test.ids
    state = rk.init(rk.models.tiny(task.tokenizer, seed=0, hidden_size=64, intermediate_size=128),
                    rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)
    out = rk.rollout(state, task.test, n=2, max_new_tokens=3)
    assert out.batch_size[0] == 2 * len(task.test)
    assert rk.column(out, "prompt_text")[::2] == task.test.text


def test_fit_on_one_batch_of_prompts_equals_fit_on_its_prompt_set(task):
    """``fit`` with a Prompts value (e.g. ``task.train.batch_at(...)``) hung; it is now the same
    run as with the PromptSet made from it."""
    batch = task.train.batch_at(0, 8, shuffle=False)
    recipe = rk.recipes.get("grpo", n=2, max_new_tokens=3)

    def run(prompts):
        state = rk.init(rk.models.tiny(task.tokenizer, seed=0, hidden_size=64, intermediate_size=128),
                        rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)
        return rk.fit(state, recipe, task.reward, prompts, steps=2, batch_size=4)[1]

    with deadline(60):
        a = run(batch)
    b = run(PromptSet(batch.text, batch.ids, batch.columns))
    keys = ("reward/mean", "actor/pg_loss", "actor/entropy")
    assert [[h[k] for k in keys] for h in a] == [[h[k] for k in keys] for h in b]


def _chat_tokenizer():
    from rlkit.models.tokenizers import char_tokenizer

    tok = char_tokenizer("0123456789+=: abcdefghijklmnopqrstuvwxyz")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    return tok


def test_chat_prompts_become_the_token_ids_of_the_rendered_conversation():
    """transformers 5 returns a BatchEncoding from apply_chat_template: its keys became the
    prompt ('input_ids', 'attention_mask'), and a rollout then failed comparing str and int."""
    tok = _chat_tokenizer()
    rendered = "user:1+1= assistant:"
    expected = tok(rendered, add_special_tokens=False)["input_ids"]
    assert rk.load_prompts(["1+1="], tok, chat=True).ids == [expected]
    messages = [{"role": "user", "content": "1+1="}]
    assert rk.load_prompts([messages], tok).ids == [expected]
    state = rk.init(rk.models.tiny(tok, seed=0, hidden_size=32, intermediate_size=64), rk.optim.adamw(lr=1e-3), tokenizer=tok)
    batch = rk.rollout(state, [messages], n=2, max_new_tokens=3)
    assert batch["prompt_ids"][0][batch["prompt_mask"][0]].tolist() == expected


def test_a_dict_of_columns_is_read_as_rows(task):
    tok = task.tokenizer
    ps = rk.load_prompts({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}, tok)
    assert ps.text == ["1+1=", "2+2="] and ps.columns == {"answer": ["2", "4"]}  # was: prompts 'prompt', 'answer'
    one = rk.load_prompts({"prompt": "1+1=", "answer": "2"}, tok)
    assert one.text == ["1+1="] and one.columns == {"answer": ["2"]}
    with pytest.raises(rk.data.DataError, match="one list per column, all of one length"):
        rk.load_prompts({"prompt": ["1+1=", "2+2="], "answer": ["2"]}, tok)
    with pytest.raises(rk.data.DataError, match="no 'prompt' column"):
        rk.load_prompts({"question": ["1+1="]}, tok)


@pytest.mark.parametrize("name", ["prompt_text", "response_text", "group", "rewards", "truncated", "completions", "completion_ids", "reward/x"])
def test_data_columns_cannot_take_the_batchs_own_names(task, name):
    """They silently overwrote the batch's field (prompt_text, completion_ids) or failed later
    with a misleading error (group, truncated, completions)."""
    with pytest.raises(rk.data.DataError, match=f"prompt columns \\['{name}'\\] are names rlkit's batch uses"):
        rk.load_prompts([{"prompt": "1+1=", name: "A"}], task.tokenizer)
    if name not in ("prompt_text", "response_text"):  # the batch's own text columns may be given to make_batch
        with pytest.raises(rk.BatchError, match="reserved"):
            rk.make_batch([[1]], [[2]], columns={name: ["A"]})


def test_prompt_set_arguments_are_checked(task, tmp_path):
    tok = task.tokenizer
    path = tmp_path / "p.jsonl"
    path.write_text('"1+1="\n"2+2="\n')
    assert rk.load_prompts(str(path), tok).text == ["1+1=", "2+2="]  # JSON strings per line, as a list takes them
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_prompt_tokens must be a positive int"):
            rk.load_prompts(["22+33="], tok, max_prompt_tokens=bad, truncate=True)  # 0 kept every token, -1 dropped one
    assert rk.load_prompts(["22+33="], tok, max_prompt_tokens=2, truncate=True).ids == [tok("3=", add_special_tokens=False)["input_ids"]]
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        next(task.train.batches(0, 2))  # was ZeroDivisionError
    with pytest.raises(ValueError, match="start must be an int >= 0"):
        task.train.batches(2, 3, start=-1)
    assert len(list(task.train.batches(2, 5, start=3))) == 2  # positions 3 and 4: what a resumed run has left
    with pytest.raises(rk.data.DataError, match="needs a tokenizer"):
        rk.load_prompts(["1+1="], None)
    with pytest.raises(rk.data.DataError, match="2 rows of ids but \\{'text': 1\\}"):
        Prompts(["a"], [[1], [2]])
