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
