"""Notebook-facing fixes: bounded reprs of data values, and in-memory sinks rewinding like JSONLSink."""
import copy
import dataclasses
import json

import rlkit as rk
from rlkit.data import Prompts, PromptSet
from rlkit.observe import JSONLSink, ListSink, rewind_all
from rlkit.observe.notebook import Dashboard
from rlkit.tasks.base import Task


def _prompt_set(n, text=lambda i: f"{i}+{i}="):
    return PromptSet([text(i) for i in range(n)], [[1, 2, 3]] * n, {"answer": [str(2 * i) for i in range(n)]})


def test_prompt_set_and_prompts_reprs_show_size_columns_and_first_prompt_not_every_row():
    """The dataclass repr printed every prompt, id row and column value: ~2.9 MB for 50,000
    prompts, in a notebook cell's output, a debugger's variable view or a traceback."""
    big = _prompt_set(50_000)
    assert repr(big) == "PromptSet(n=50000, columns=['answer'], first='0+0=')"
    batch = big.take(range(512))
    assert repr(batch) == "Prompts(n=512, columns=['answer'], first='0+0=')"
    # a long prompt is clipped, and a long batch of long prompts stays small
    long = _prompt_set(300, text=lambda i: "Q" * 10_000)
    assert len(repr(long)) < 200 and "..." in repr(long)
    assert len(repr(long.take(range(300)))) < 200
    assert repr(PromptSet([], [], {})) == "PromptSet(n=0, columns=[])"
    # only the repr changed: equality is still the dataclass's, field by field
    assert big == copy.deepcopy(big)
    assert _prompt_set(3) != _prompt_set(3, text=lambda i: f"{i}-{i}=")
    assert Prompts(["a"], [[1]], {"x": [1]}) == Prompts(["a"], [[1]], {"x": [1]})
    assert Prompts(["a"], [[1]]) != Prompts(["b"], [[1]])


def test_task_repr_lists_small_fields_and_summarizes_data_tokenizer_and_examples():
    """repr(rk.tasks.arithmetic()) was ~240 kB (every train/test prompt and warm-up example, and
    the tokenizer's own repr, which lists every added token)."""
    task = rk.tasks.arithmetic(digits=2)
    text = repr(task)
    assert len(text) < 1000, len(text)
    assert text.startswith("Task(name='arithmetic', ")
    for part in ("train=PromptSet(n=4000, columns=['answer'], first=", "test=PromptSet(n=200, columns=['answer'], first=",
                 "reward=<function exact_match>", f"sft_examples=<{len(task.sft_examples)} pairs>",
                 f"max_new_tokens={task.max_new_tokens}", "'teacher_noise': 'verbose'", "vocab="):
        assert part in text, (part, text)

    class HugeTokenizer:
        name_or_path = "org/some-chat-model"

        def __len__(self):
            return 151_665

        def __repr__(self):
            return "HugeTokenizer(" + "added_token, " * 20_000 + ")"

    small = Task("mine", HugeTokenizer(), _prompt_set(10), _prompt_set(2), reward=len,
                 sft_examples=[("p", "c")] * 5000, info={"notes": "n" * 10_000, "k": list(range(10_000))})
    text = repr(small)
    assert len(text) < 1000, len(text)
    assert "tokenizer=<HugeTokenizer 'org/some-chat-model' vocab=151665>" in text
    assert "sft_examples=<5000 pairs>" in text and "train=PromptSet(n=10," in text
    # only the repr changed: equality is still the dataclass's
    assert small == copy.copy(small)
    assert small != dataclasses.replace(small, max_new_tokens=small.max_new_tokens + 1)


def test_in_memory_sinks_rewind_only_the_latest_run_as_jsonl_does(tmp_path):
    """One ListSink / Dashboard watching run A (steps 1-6) then a fresh run B (steps 1-4) continued
    from its exception's state: fit's rewind(4) dropped A's steps 5-6 from memory, while the JSONL
    file (and fit's docstring: only "what they logged for later steps, which this run redoes") kept them."""
    path = tmp_path / "m.jsonl"
    sinks = [ListSink(), Dashboard(total=10, keys=("run",)), JSONLSink(path, mode="w")]
    for step in range(1, 7):
        for s in sinks:
            s.on_step(step, {"run": "A", "a_only": step})
    for step in range(1, 5):
        for s in sinks:
            s.on_step(step, {"run": "B"})
    rewind_all(sinks, 4)
    sinks[2].close()
    expected = [(s, "A") for s in range(1, 7)] + [(s, "B") for s in range(1, 5)]
    rows = lambda history: [(h["step"], h["run"]) for h in history]
    assert rows(json.loads(line) for line in path.read_text().splitlines()) == expected
    assert rows(sinks[0].history) == expected
    assert rows(sinks[1].history) == expected
    assert sinks[1].latest == {"run": "B", "a_only": 6}  # rebuilt from what is kept

    # within the latest run, rows after the step rewound to still go (a resumed run logs them again)
    for s in sinks[:2]:
        s.on_step(5, {"run": "B"})
        s.on_step(6, {"run": "B"})
        s.rewind(5)
        assert rows(s.history) == expected + [(5, "B")]
    # a single run: everything after the step goes
    one = ListSink()
    for step in range(1, 6):
        one.on_step(step, {"x": step})
    one.rewind(2)
    assert [h["step"] for h in one.history] == [1, 2]
