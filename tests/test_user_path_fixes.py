"""What a notebook user meets around the core: prompt files saved with a UTF-8 byte-order mark
(Excel's "CSV UTF-8"), a datasets.Dataset formatted as torch, one sink given to the SFT warm-up,
a numpy step in JSONLSink, and `python -m rlkit`."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import rlkit as rk
from rlkit.rewards import exact_match


@pytest.fixture(scope="module")
def task():
    return rk.tasks.arithmetic(digits=1, n_train=20, n_test=5)


@pytest.mark.parametrize("ext", [".csv", ".jsonl", ".json"])
def test_prompt_files_with_a_byte_order_mark_read_as_without(tmp_path, task, ext):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "4+5=", "answer": "9"}]
    if ext == ".csv":
        text = "prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows)
    elif ext == ".jsonl":
        text = "".join(json.dumps(r) + "\n" for r in rows)
    else:
        text = json.dumps(rows)
    plain, marked = tmp_path / f"plain{ext}", tmp_path / f"marked{ext}"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    assert marked.read_bytes()[:3] == b"\xef\xbb\xbf"
    a, b = rk.load_prompts(plain, task.tokenizer), rk.load_prompts(marked, task.tokenizer)
    assert a.text == b.text == ["1+2=", "4+5="] and a.ids == b.ids
    assert b.columns["answer"] == ["3", "9"]


def test_a_dataset_formatted_as_torch_gives_the_rewards_plain_values(task):
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"prompt": ["1+2=", "4+5="], "answer": [3, 9]})
    for fmt in ("torch", "numpy"):
        prompts = rk.load_prompts(data.with_format(fmt), task.tokenizer)
        answers = prompts.columns["answer"]
        assert answers == [3, 9] and all(type(a) is int for a in answers), fmt
        assert exact_match(["3", "9"], answer=answers) == [1.0, 1.0]


def test_sft_warmup_takes_one_sink_as_fit_does(task):
    model = rk.models.tiny(task.tokenizer, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1, seed=0)
    sink = rk.observe.ListSink()
    rk.sft.warmup(model, task.tokenizer, task.sft_examples, steps=2, batch_size=4, sinks=sink)
    assert [row["step"] for row in sink.history] == [1, 2] and "sft/loss" in sink.history[0]
    with pytest.raises(TypeError, match="sft.warmup: every sink needs an on_step"):
        rk.sft.warmup(model, task.tokenizer, task.sft_examples, steps=1, batch_size=4, sinks=[object()])


def test_jsonl_sink_writes_a_numpy_or_tensor_step_as_an_int(tmp_path):
    path = tmp_path / "m.jsonl"
    with rk.observe.JSONLSink(path) as sink:
        for step in np.arange(1, 3):
            sink.on_step(step, {"loss": 0.5})
        sink.on_step(torch.tensor(3), {"loss": 0.25})
        sink.rewind(2)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.5}]


def test_python_dash_m_rlkit_is_the_rlkit_command():
    out = subprocess.run([sys.executable, "-m", "rlkit", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: rlkit" in out.stdout and "run" in out.stdout


def test_fit_on_a_reloaded_model_without_a_tokenizer_names_rk_init_before_any_step(tmp_path, task):
    """A model saved and loaded back (rk.models.load_model) carries no tokenizer: fit with a text
    reward failed after the first rollout with score's "pass tokenizer=" (fit has no such argument).
    It now says so before any work; a reward on the batch's ids alone still trains without one."""
    tiny = rk.models.tiny(task.tokenizer, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                          num_key_value_heads=1, seed=0)
    tiny.save_pretrained(tmp_path / "model")
    state = rk.init(rk.models.load_model(str(tmp_path / "model")), rk.optim.adamw(lr=1e-3))
    assert state.tokenizer is None
    recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=task.max_new_tokens)
    with pytest.raises(ValueError, match=r"fit: the reward 'exact_match' reads the responses as text.*"
                                         r"Fix: rk.init\(model, \.\.\., tokenizer=rk.models.load_tokenizer\(path\)\)"):
        rk.fit(state, recipe, task.reward, task.train, steps=1, batch_size=2)
    assert not state.is_donated and state.step == 0

    def length(batch):  # batch-style: reads ids, needs no tokenizer
        return batch["response_mask"].sum(-1).float().tolist()

    state, history = rk.fit(state, recipe, length, task.train, steps=1, batch_size=2)
    assert state.step == 1 and len(history) == 1
    # and with the tokenizer given, the text reward trains
    state, _ = rk.fit(state.replace(tokenizer=task.tokenizer), recipe, task.reward, task.train, steps=2, batch_size=2)
    assert state.step == 2
