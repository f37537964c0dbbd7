"""Sample responses as a metric: ``rk.observe.samples``, a recipe's ``log_samples``, and how each
sink shows (or keeps, or skips) the ``samples`` table."""
import io
import json
import sys
import types

import pytest
import torch
from rich.console import Console

import rlkit as rk
from rlkit.batch import BatchError, make_batch

TASK_N_TRAIN = 32

SAMPLES = [{"prompt": "12+3=", "response": "15", "reward": 1.0, "advantage": 0.5},
           {"prompt": "7*8=", "response": "<b>[bold]56", "reward": 1 / 3, "advantage": None}]


def _batch(**more):
    """Six rows of three prompts whose group ids are not in sorted order (5, 2, 9)."""
    return make_batch([[1, 5], [1, 5], [1, 6], [1, 6], [1, 7], [1, 7]], [[5, 6], [6], [7], [8, 9], [5], [6]],
                      group=[5, 5, 2, 2, 9, 9], rewards=[1.0, 0.0, 0.5, 0.25, 1.0, 0.75], **more)


TEXTS = {"prompt_text": ["a", "a", "b", "b", "c", "c"], "response_text": ["a0", "a1", "b0", "b1", "c0", "c1"]}


def test_samples_take_one_row_per_prompt_first_in_a_fixed_order():
    batch = _batch(columns=TEXTS)
    two = rk.observe.samples(batch, k=2)
    assert two == [{"prompt": "a", "response": "a0", "reward": 1.0}, {"prompt": "b", "response": "b0", "reward": 0.5}]
    # more rows than prompts: the second sample of each group, in the groups' order, then the third...
    assert [s["response"] for s in rk.observe.samples(batch, k=4)] == ["a0", "b0", "c0", "a1"]
    assert [s["response"] for s in rk.observe.samples(batch, k=50)] == ["a0", "b0", "c0", "a1", "b1", "c1"]
    assert rk.observe.samples(batch, k=0) == []
    assert rk.observe.samples(batch, k=3) == rk.observe.samples(batch, k=3)  # no random draw
    assert json.loads(json.dumps(rk.observe.samples(batch, k=6))) == rk.observe.samples(batch, k=6)
    long = "x" * 5000
    batch = _batch(columns={**TEXTS, "response_text": [long] * 6})
    assert rk.observe.samples(batch, k=1)[0]["response"] == long  # nothing clipped in the data


def test_samples_carry_each_rows_mean_advantage_over_its_response_tokens():
    batch = make_batch([[1], [1], [2]], [[5, 6, 7], [5], []], group=[0, 0, 1], rewards=[1.0, 0.0, 0.5],
                       columns={"prompt_text": ["p", "p", "q"], "response_text": ["r0", "r1", ""]})
    batch.set("advantages", torch.tensor([[1.0, 2.0, 6.0], [4.0, 100.0, 100.0], [7.0, 7.0, 7.0]]))  # pads: never read
    got = rk.observe.samples(batch, k=3)
    assert [(s["response"], s["advantage"]) for s in got] == [("r0", 3.0), ("", None), ("r1", 4.0)]
    assert "advantage" not in rk.observe.samples(_batch(columns=TEXTS), k=1)[0]  # not advantaged yet: no key


def test_samples_decode_the_ids_without_text_columns_and_say_how_to_get_them(char_tok):
    enc = [char_tok.encode(t) for t in ("12+3=", "7*8=")]
    pad, eos = char_tok.pad_token_id, char_tok.eos_token_id
    batch = make_batch([enc[0], enc[0], enc[1], enc[1]], [char_tok.encode("15") + [eos], char_tok.encode("9"),
                                                          char_tok.encode("56"), char_tok.encode("5")],
                       group=[0, 0, 1, 1], rewards=[1.0, 0.0, 1.0, 0.0], pad_token_id=pad)
    got = rk.observe.samples(batch, k=2, tokenizer=char_tok)
    # as rk.score decodes for the rewards: special tokens (the EOS) left out
    assert got == [{"prompt": "12+3=", "response": "15", "reward": 1.0}, {"prompt": "7*8=", "response": "56", "reward": 1.0}]
    with pytest.raises(BatchError, match=r"no 'prompt_text' column and no tokenizer.*pass tokenizer="):
        rk.observe.samples(batch, k=2)
    # the columns win over the tokenizer (a reward scored them, not the ids)
    texts = {"prompt_text": ["P"] * 4, "response_text": ["R0", "R1", "R2", "R3"]}
    batch = make_batch([enc[0]] * 4, [[5]] * 4, group=[0, 0, 1, 1], rewards=[0.0] * 4, columns=texts)
    assert [s["response"] for s in rk.observe.samples(batch, k=2, tokenizer=char_tok)] == ["R0", "R2"]


def test_samples_refuse_an_unscored_batch_and_a_bad_k():
    unscored = make_batch([[1], [1]], [[5], [6]], columns={"prompt_text": ["p", "p"], "response_text": ["a", "b"]})
    with pytest.raises(BatchError, match=r"rk.observe.samples: .*'rewards'.*rlkit.score"):
        rk.observe.samples(unscored)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"rk.observe.samples: k must be an int >= 0"):
            rk.observe.samples(_batch(columns=TEXTS), k=bad)


def test_log_samples_is_a_checked_recipe_field_every_rank_compares():
    from rlkit.parallel.agree import _recipe_settings

    for name in rk.recipes.RECIPES:
        assert rk.recipes.get(name).log_samples == 0
        assert rk.recipes.get(name, log_samples=3).log_samples == 3
    assert rk.recipes.get("grpo").with_(log_samples=2).log_samples == 2
    with pytest.raises(ValueError, match=r"GRPO.log_samples must be an int >= 0.*got -1"):
        rk.recipes.get("grpo", log_samples=-1)
    with pytest.raises(ValueError, match=r"DAPO.log_samples must be an int >= 0.*got 2.5"):
        rk.recipes.get("dapo").with_(log_samples=2.5)
    assert _recipe_settings(rk.recipes.get("ppo", log_samples=4))["recipe.log_samples"] == 4


@pytest.mark.parametrize("name", ["grpo", "rloo", "dapo", "ppo"])
def test_each_recipe_step_adds_samples_only_when_asked(name, task):
    prompts = next(iter(task.prompts(batch_size=2, steps=1)))

    def state():
        model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1)
        critic = rk.models.critic(model) if name == "ppo" else None
        return rk.init(model, rk.optim.adamw(lr=3e-4), tokenizer=task.tokenizer, critic=critic)

    fields = dict(n=2, max_new_tokens=4, **({"overlong_buffer": 0, "max_attempts": 1} if name == "dapo" else {}))
    _, metrics = rk.recipes.get(name, **fields).step(state(), prompts, task.reward)
    assert "samples" not in metrics and all(not isinstance(v, list) for v in metrics.values())
    _, metrics = rk.recipes.get(name, log_samples=3, **fields).step(state(), prompts, task.reward)
    got = metrics["samples"]
    assert len(got) == 3 and {s["prompt"] for s in got[:2]} == set(prompts.text)  # both prompts before a second sample
    assert all(isinstance(s["response"], str) and isinstance(s["reward"], float) for s in got)
    assert ("advantage" in got[0]) == (name != "dapo")  # DAPO's rows are its first rollout's: no advantages


@pytest.mark.parametrize("informative", [True, False])
def test_dapo_samples_show_the_first_rollout_and_its_reward_before_the_overlong_penalty(informative, task, fresh_state):
    """Trained (some group's rewards differ) or skipped (none do), DAPO's samples are its first
    rollout's rows, with the verifier's reward, as its reward/* metrics are."""
    prompts = next(iter(task.prompts(batch_size=2, steps=1)))
    scored = []

    def reward(completions, prompts, **kw):
        values = [float(i % 2) if informative else 1.0 for i in range(len(completions))]
        scored.extend(zip(prompts, completions, values))
        return values

    recipe = rk.recipes.get("dapo", log_samples=4).with_(n=2, max_new_tokens=4, overlong_buffer=4, max_attempts=1)
    _, metrics = recipe.step(fresh_state(), prompts, reward)
    assert metrics["dapo/skipped_steps"] == (0.0 if informative else 1.0)
    assert metrics["dapo/overlong_penalty_mean"] < 0  # every response is penalised: the samples' rewards are not
    assert [(s["prompt"], s["response"], s["reward"]) for s in metrics["samples"]] == [scored[i] for i in (0, 2, 1, 3)]


def test_fit_history_carries_the_responses_the_reward_scored(task, fresh_state, tmp_path):
    scored = []

    def reward(completions, prompts, **kw):
        values = [float(len(c) % 3) for c in completions]
        scored.append(list(zip(prompts, completions, values)))
        return values

    recipe = rk.recipes.get("grpo", log_samples=2).with_(n=2, max_new_tokens=4)
    listed, jsonl = rk.observe.ListSink(), rk.observe.JSONLSink(tmp_path / "m.jsonl")
    _, history = rk.fit(fresh_state(), recipe, reward, task.train, steps=2, batch_size=2, sinks=[listed, jsonl])
    jsonl.close()
    assert len(history) == 2 and len(scored) == 2
    for row, rows in zip(history, scored):
        first = {}  # each prompt's first scored row: what samples shows, one per prompt
        for prompt, response, value in rows:
            first.setdefault(prompt, {"prompt": prompt, "response": response, "reward": value})
        shown = [{k: v for k, v in s.items() if k != "advantage"} for s in row["samples"]]
        assert shown == list(first.values())[:2]
        assert all(isinstance(s["advantage"], float) for s in row["samples"])  # GRPO's: each row's one value
    assert [h["samples"] for h in listed.history] == [h["samples"] for h in history]
    with open(tmp_path / "m.jsonl") as f:
        assert [json.loads(line)["samples"] for line in f] == [h["samples"] for h in history]


def test_jsonl_and_list_sinks_keep_the_samples_as_json_through_a_rewind(tmp_path):
    jsonl, listed = rk.observe.JSONLSink(tmp_path / "m.jsonl"), rk.observe.ListSink()
    for step in (1, 2, 3):
        rk.observe.broadcast([jsonl, listed], step, {"reward/mean": step / 4, "samples": SAMPLES[: step % 2 + 1]})
    jsonl.rewind(2)
    listed.rewind(2)
    jsonl.close()
    with open(tmp_path / "m.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert rows == [{"step": 1, "reward/mean": 0.25, "samples": SAMPLES},
                    {"step": 2, "reward/mean": 0.5, "samples": SAMPLES[:1]}]
    assert listed.history == rows


def test_emit_streams_the_samples_to_the_callers_sinks(tmp_path, monkeypatch):
    """rk.launch(plan): the workers' _Emit writes each step as JSON, the caller's _Feed hands it on."""
    from rlkit.launch import RUN_DIR_ENV
    from rlkit.launch_fit import _Emit, _Feed

    (tmp_path / "metrics").mkdir()
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    _Emit().on_step(3, {"reward/mean": 0.5, "samples": SAMPLES})
    with open(tmp_path / "metrics" / "rank0.jsonl") as f:
        record = json.loads(f.read())
    listed = rk.observe.ListSink()
    _Feed([listed], None)(0, record)
    assert listed.history == [{"step": 3, "reward/mean": 0.5, "samples": SAMPLES}]


def test_prometheus_skips_the_samples():
    pytest.importorskip("prometheus_client")
    from rlkit.observe.prometheus import PrometheusSink

    sink = PrometheusSink(start_server=False)
    sink.on_step(1, {"reward/mean": 0.5, "samples": SAMPLES})
    assert sink.registry.get_sample_value("rlkit_reward_mean") == 0.5
    names = {m.name for m in sink.registry.collect()}
    assert names == {"rlkit_step", "rlkit_reward_mean"}


def test_console_keeps_the_samples_out_of_its_bar_and_prints_them_every_n_steps():
    from rlkit.observe.console import ConsoleSink, samples_table

    out = io.StringIO()
    sink = ConsoleSink(4, console=Console(file=out, width=160, force_terminal=False), keys=("reward/mean", "samples"), log_every_s=0)
    sink.on_step(1, {"reward/mean": 0.5, "samples": SAMPLES})
    sink.close()
    text = out.getvalue()
    assert "samples=<2 rows>" in text and "12+3=" not in text  # no table by default, no texts in the bar

    out = io.StringIO()
    sink = ConsoleSink(4, console=Console(file=out, width=160, force_terminal=False), log_every_s=None, samples_every=2,
                       sample_chars=8)
    long = [{**SAMPLES[0], "response": "0123456789ABCDEF"}, SAMPLES[1]]
    for step in (1, 2, 3):
        sink.on_step(step, {"reward/mean": 0.5, "samples": long})
    sink.close()
    text = out.getvalue()
    assert text.count("samples (step 2)") == 1 and "step 1)" not in text and "step 3)" not in text
    assert "0123456…" in text and "89AB" not in text  # clipped for display
    assert "<b>[bol…" in text and "0.333" in text  # markup shown as text; numbers to 3 digits
    assert [c.header for c in samples_table(SAMPLES).columns] == ["prompt", "response", "reward", "advantage"]
    with pytest.raises(ValueError, match="samples_every must be a positive int"):
        ConsoleSink(4, console=Console(file=io.StringIO()), samples_every=0)


def test_samples_html_escapes_clips_and_formats():
    from rlkit.observe.notebook import samples_html

    rows = [{"prompt": "a<b & c", "response": "x" * 30, "reward": 1 / 3, "advantage": None},
            {"prompt": "p", "response": "</td><b>", "reward": 2}]
    page = samples_html(rows, max_chars=10, title="samples <step 3>")
    assert "a&lt;b &amp; c" in page and "&lt;/td&gt;&lt;b&gt;" in page and "<b>" not in page
    assert "x" * 9 + "…" in page and "x" * 10 not in page
    assert "<caption" in page and "samples &lt;step 3&gt;" in page
    heads = [h.split(">", 1)[1].split("</th")[0] for h in page.split("<th style")[1:]]
    assert heads == ["prompt", "response", "reward", "advantage"]
    cells = [c.split(">", 1)[1].split("</td")[0] for c in page.split("<td")[1:]]
    assert cells[2:4] == ["0.333", "-"] and cells[6:8] == ["2", "-"]  # a missing key shows as "-" too
    assert samples_html([]) == ""


def test_a_dashboard_in_a_kernel_shows_the_latest_samples_under_its_plot(monkeypatch, stub_widget):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlkit.observe.notebook import Dashboard

    plt.close(plt.figure())  # the backend settled before the fake kernel: pyplot would hook into it otherwise
    shown = []
    widgets = types.SimpleNamespace(IntProgress=stub_widget, HTML=stub_widget, Output=stub_widget, VBox=stub_widget)
    ipython = types.ModuleType("IPython")
    shell = types.SimpleNamespace(kernel=object(), events=types.SimpleNamespace(register=lambda *a: None))  # pyplot hooks into it
    ipython.get_ipython = lambda: shell
    display = types.ModuleType("IPython.display")
    display.display = shown.append
    monkeypatch.setitem(sys.modules, "ipywidgets", widgets)
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display)

    board = Dashboard(total=3, keys="reward/mean", sample_chars=6)
    assert shown and shown[0].children[-1] is board._samples  # under the bar, the text and the plot
    board.on_step(1, {"reward/mean": 0.5, "samples": [{"prompt": "p", "response": "first<", "reward": 1.0}]})
    assert "first&lt;" in board._samples.value and "samples (step 1)" in board._samples.value
    board.on_step(2, {"reward/mean": 0.25})  # a step without samples keeps the latest ones shown
    assert "first&lt;" in board._samples.value
    board.on_step(3, {"reward/mean": 0.75, "samples": [{"prompt": "p", "response": "second answer", "reward": 0.0}]})
    assert "secon…" in board._samples.value and "first" not in board._samples.value and "(step 3)" in board._samples.value
    assert board._text.value == "<code>reward/mean: 0.75</code>"
    assert board.history[-1]["samples"][0]["response"] == "second answer"  # kept whole
    plt.close("all")


def test_a_dashboard_outside_a_kernel_keeps_the_samples_in_its_history():
    from rlkit.observe.notebook import Dashboard

    board = Dashboard(total=2)
    board.on_step(1, {"reward/mean": 0.5, "samples": SAMPLES})
    assert board._samples is None and board.history == [{"step": 1, "reward/mean": 0.5, "samples": SAMPLES}]


class _FakeTable:
    def __init__(self, columns, data):
        self.columns, self.data = columns, data


def test_wandb_logs_the_samples_as_a_table(monkeypatch):
    logged = []
    run = types.SimpleNamespace(log=lambda row, step, commit: logged.append((step, row, commit)), finish=lambda: None)
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: run
    fake.Table = _FakeTable
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from rlkit.observe.wandb_sink import WandbSink

    sink = WandbSink(project="t", mode="disabled")
    sink.on_step(4, {"reward/mean": 0.5, "note": "text", "samples": SAMPLES})
    (step, row, commit), = logged
    assert step == 4 and commit and row["reward/mean"] == 0.5 and row["note"] == "text"
    table = row["samples"]
    assert table.columns == ["step", "prompt", "response", "reward", "advantage"]
    assert table.data == [[4, "12+3=", "15", 1.0, 0.5], [4, "7*8=", "<b>[bold]56", 1 / 3, None]]
    sink.on_step(5, {"reward/mean": 0.25})
    assert logged[-1][1] == {"reward/mean": 0.25}  # numbers as before


def test_a_real_offline_wandb_run_takes_the_samples_table(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from rlkit.observe.wandb_sink import WandbSink

    for name, value in {"WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_MODE": "offline"}.items():
        monkeypatch.setenv(name, value)
    sink = WandbSink(project="rlkit-test")
    sink.on_step(1, {"reward/mean": 0.5, "samples": SAMPLES})
    assert sink.run.summary["reward/mean"] == 0.5 and sink.run.summary["samples"]["_type"] == "table-file"
    sink.close()
    import wandb

    wandb.teardown()  # wandb keeps the settings it read (WANDB_DIR) for the process: a later test reads its own


def test_launchs_default_metrics_line_shows_a_samples_table_as_its_row_count(capsys):
    # rk.launch(fn)'s default on_metrics prints one line per record: a samples metric (texts that may
    # be pages long) shows as its row count, numbers as they did
    from rlkit.launch import print_metrics

    print_metrics(0, {"reward/mean": 0.123456, "samples": [{"prompt": "1+1=", "response": "2" * 500, "reward": 1.0}] * 2, "step": 3})
    line = capsys.readouterr().out.strip()
    assert line == "[rank 0] reward/mean=0.1235 samples=<2 rows> step=3", line
