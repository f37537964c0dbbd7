"""The metric sinks: the console bar's layout, the Prometheus endpoint and the wandb run."""
import importlib.util
import io
import re
import urllib.error
import urllib.request

import pytest
from rich.console import Console

from rlkit.observe.console import ConsoleSink

METRICS = {"reward/mean": 0.406, "eval/accuracy": 0.43, "actor/entropy": 0.381, "actor/kl": 0.0137, "actor/approx_kl": -2.38e-08,
           "actor/logprob_gap": 3.47e-07}


@pytest.mark.parametrize("width", [60, 80, 140])
def test_console_bar_keeps_its_count_and_times_and_wraps_values_whole(width):
    """A log file renders 80 columns wide: the count and times must not be squeezed out by the
    values, and a value must not be split from its name."""
    out = io.StringIO()
    sink = ConsoleSink(30, "RL (grpo)", console=Console(file=out, width=width, force_terminal=False))
    sink.on_step(30, METRICS)
    sink.close()
    text = out.getvalue()
    lines = text.splitlines()
    assert "30/30" in lines[0] and re.search(r"\d:\d\d:\d\d \d:\d\d:\d\d", lines[0]), text
    tokens = text.split()
    for expected in ("reward=0.406", "acc=0.43", "ent=0.381", "kl=0.0137", "gap=3.47e-07"):
        assert expected in tokens, (expected, text)
    # "kl" is the KL to the reference; PPO's approx_kl (new policy against old) is not shown as it
    assert not any("e-08" in t for t in tokens), text
    assert all(len(line) <= width for line in lines)
    if width >= 140:
        assert len(lines) == 1


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        body = r.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in body.splitlines() if line.startswith("rlkit_")}


def test_prometheus_serves_each_metric_and_frees_its_port_on_close():
    pytest.importorskip("prometheus_client")
    from rlkit.observe.prometheus import PrometheusSink

    sink = PrometheusSink(port=0)
    assert sink.port and sink.port > 0
    sink.on_step(1, {"reward/mean": 0.25, "eval/accuracy": 0.5})
    sink.on_step(2, {"reward/mean": 0.75, "note": "not a number"})
    got = _scrape(sink.port)
    assert got["rlkit_step"] == 2 and got["rlkit_reward_mean"] == 0.75 and got["rlkit_eval_accuracy"] == 0.5
    assert not any("note" in k for k in got)
    with pytest.raises(OSError, match="port=0"):  # the port is taken: the error says what to do
        PrometheusSink(port=sink.port)
    port = sink.port
    sink.close()
    with pytest.raises(urllib.error.URLError):
        _scrape(port)
    again = PrometheusSink(port=port)  # freed: a re-run notebook cell can take it again
    again.on_step(1, {"reward/mean": 1.0})
    assert _scrape(port)["rlkit_reward_mean"] == 1.0
    again.close()
    with pytest.raises(urllib.error.URLError):
        _scrape(port)


def test_wandb_sink_runs_offline_without_a_key_and_logs_each_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from rlkit.observe.wandb_sink import WandbSink

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no `wandb login` either
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's output capture alone
    sink = WandbSink(project="rlkit-test", config={"lr": 3e-4})
    assert sink.run.settings.mode == "offline"
    for step in (1, 2, 3):
        sink.on_step(step, {"reward/mean": step / 4, "eval/accuracy": 0.1 * step})
    # each step is committed as it is logged (not held back until the next one), so a run that
    # dies before close() has still sent its last step
    assert sink.run.summary["reward/mean"] == 0.75 and sink.run.summary["eval/accuracy"] == pytest.approx(0.3)
    assert sink.run.config["lr"] == 3e-4
    run_dir = sink.run.dir
    sink.close()
    assert str(tmp_path) in run_dir
    files = [p.name for p in tmp_path.rglob("*.wandb")]
    assert files, "no offline run file was written"


def test_wandb_sink_follows_wandb_mode_and_a_wandb_login(tmp_path, monkeypatch):
    """The sink passed mode="offline" whenever WANDB_API_KEY was unset: WANDB_MODE=disabled (as
    in CI) still wrote an offline run, and a `wandb login` key in ~/.netrc was ignored."""
    pytest.importorskip("wandb")
    from rlkit.observe import wandb_sink
    from rlkit.observe.wandb_sink import WandbSink

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sink = WandbSink(project="rlkit-test")
    sink.on_step(1, {"reward/mean": 0.5})
    sink.close()
    assert not list(tmp_path.rglob("*.wandb")), "WANDB_MODE=disabled wrote a run"
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert wandb_sink._has_key()  # then wandb decides (online), no mode is forced
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    assert not wandb_sink._has_key()


def test_jsonl_writes_numpy_scalars_and_0d_tensors_as_numbers(tmp_path):
    """An ``eval_fn`` may return numpy scalars or 0-d tensors: they are numbers in the file, and
    non-finite ones are null as a float's are (a strict JSON reader rejects NaN)."""
    import json

    import numpy as np
    import torch

    from rlkit.observe.sinks import JSONLSink

    sink = JSONLSink(tmp_path / "m.jsonl", mode="w")
    sink.on_step(1, {"f32": np.float32(0.5), "i64": np.int64(3), "t": torch.tensor(0.25), "ti": torch.tensor(7),
                     "grad": torch.tensor(2.0, requires_grad=True) * 1, "nan32": np.float32("nan"),
                     "inf_t": torch.tensor(float("inf")), "nan": float("nan"), "s": "text", "none": None, "b": True})
    sink.close()
    line = (tmp_path / "m.jsonl").read_text()
    assert "NaN" not in line and "Infinity" not in line
    row = json.loads(line)
    assert row == {"step": 1, "f32": 0.5, "i64": 3, "t": 0.25, "ti": 7, "grad": 2.0, "nan32": None, "inf_t": None,
                   "nan": None, "s": "text", "none": None, "b": True}
    assert type(row["i64"]) is int and type(row["ti"]) is int


def test_jsonl_is_strict_json_at_every_depth_and_rewinds_only_its_own_run(tmp_path):
    """NaN and inf inside lists, dicts and arrays were written as NaN/Infinity (not JSON); a rewind
    dropped an earlier run's rows appended to the same file; appending after a crash glued the
    first new row onto the line the crash cut short."""
    import json

    import numpy as np
    import torch

    from rlkit.observe.sinks import JSONLSink

    path = tmp_path / "m.jsonl"
    sink = JSONLSink(path, mode="w")
    sink.on_step(1, {"vec": [1.0, float("nan")], "nested": {"x": float("nan"), "y": [float("inf"), 1]},
                     "np": np.array([np.inf, 2.0]), "t": torch.tensor([0.5, float("nan")]), "tup": (1, float("-inf"))})
    sink.close()
    refuse = lambda c: (_ for _ in ()).throw(AssertionError(f"{c} is not JSON"))  # noqa: E731
    assert json.loads(path.read_text(), parse_constant=refuse) == {
        "step": 1, "vec": [1.0, None], "nested": {"x": None, "y": [None, 1]}, "np": [None, 2.0], "t": [0.5, None], "tup": [1, None]}

    # run A logs 1-4; run B appends 1-3, dies mid-row, resumes from step 2
    path.write_text("")
    a = JSONLSink(path)
    for step in range(1, 5):
        a.on_step(step, {"run": "A"})
    a.close()
    b = JSONLSink(path)
    for step in range(1, 4):
        b.on_step(step, {"run": "B"})
    b.close()
    with open(path, "a") as f:
        f.write('{"step": 4, "ru')  # the row a kill cut short
    resumed = JSONLSink(path)
    resumed.rewind(2)
    resumed.on_step(3, {"run": "B"})
    resumed.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["run"]) for r in rows] == [(1, "A"), (2, "A"), (3, "A"), (4, "A"), (1, "B"), (2, "B"), (3, "B")]
    torn = JSONLSink(path)  # appending after a crash without a rewind (a fresh run) drops the cut line too
    torn.close()
    with open(path, "a") as f:
        f.write('{"step": 9, "r')
    fresh = JSONLSink(path)
    fresh.on_step(1, {"run": "C"})
    fresh.close()
    assert json.loads(path.read_text().splitlines()[-1]) == {"step": 1, "run": "C"}


def test_prometheus_exports_numpy_scalars_and_0d_tensors():
    pytest.importorskip("prometheus_client")
    import numpy as np
    import torch

    from rlkit.observe.prometheus import PrometheusSink

    sink = PrometheusSink(start_server=False)
    sink.on_step(2, {"a": np.float32(0.5), "b": np.int64(3), "c": torch.tensor(0.25), "d": 1.5, "note": "x", "none": None})
    got = sink.registry.get_sample_value
    assert (got("rlkit_a"), got("rlkit_b"), got("rlkit_c"), got("rlkit_d"), got("rlkit_step")) == (0.5, 3.0, 0.25, 1.5, 2.0)
    assert got("rlkit_note") is None and got("rlkit_none") is None


def test_prometheus_sink_built_again_on_a_shared_registry_takes_over_its_gauges():
    """A notebook cell run again with registry=prometheus_client.REGISTRY failed with
    'Duplicated timeseries in CollectorRegistry: {rlkit_step}', close() or not."""
    pc = pytest.importorskip("prometheus_client")
    from rlkit.observe.prometheus import PrometheusSink

    shared = pc.CollectorRegistry()
    first = PrometheusSink(start_server=False, registry=shared)
    first.on_step(1, {"reward/mean": 0.25})
    first.close()
    again = PrometheusSink(start_server=False, registry=shared)
    again.on_step(2, {"reward/mean": 0.75})
    assert (shared.get_sample_value("rlkit_step"), shared.get_sample_value("rlkit_reward_mean")) == (2.0, 0.75)
    pc.Counter("rlkit_other", "the caller's own", registry=shared)
    with pytest.raises(ValueError, match="already has a collector named rlkit_other .*prefix="):
        again.on_step(3, {"other": 1.0})


def test_prometheus_name_collisions_keep_the_first_and_warn_once():
    """``reward/mean`` and ``reward_mean`` both sanitise to ``rlkit_reward_mean``: neither may
    overwrite the other's gauge in silence. A metric ``step`` (``rk.update`` reports one) is not
    exported: the step count given to ``on_step`` has that name, and wins without a warning."""
    pytest.importorskip("prometheus_client")
    import warnings

    from rlkit.observe.prometheus import PrometheusSink

    sink = PrometheusSink(start_server=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink.on_step(1, {"reward/mean": 0.5, "reward_mean": 0.9, "step": 99})
        sink.on_step(2, {"reward/mean": 0.6, "reward_mean": 0.8, "step": 98})
    got = sink.registry.get_sample_value
    assert got("rlkit_step") == 2.0 and got("rlkit_reward_mean") == 0.6
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages  # once per colliding key, not once per step
    assert "'reward_mean'" in messages[0] and "'reward/mean'" in messages[0] and "rlkit_reward_mean" in messages[0]


def test_console_and_dashboard_show_a_none_value_as_a_dash(drawn_dashboard):
    import numpy as np

    out = io.StringIO()
    sink = ConsoleSink(3, console=Console(file=out, width=140, force_terminal=False))
    sink.on_step(1, {"reward/mean": None, "eval/accuracy": np.float32(0.5), "actor/entropy": "n/a"})
    sink.close()
    tokens = out.getvalue().split()
    assert "reward=-" in tokens and "acc=0.5" in tokens and "ent=n/a" in tokens, out.getvalue()

    board = drawn_dashboard(total=3, keys=("reward/mean", "eval/accuracy"))
    board.on_step(1, {"reward/mean": 0.5, "eval/accuracy": None})
    board.on_step(2, {"reward/mean": None, "eval/accuracy": 0.25})
    assert board._text.value == "<code>reward/mean: - | eval/accuracy: 0.25</code>"
    assert board._bar.value == 2
    import matplotlib.pyplot as plt

    fig = board.plot()  # the None points are left out of the panels
    assert [list(ax.lines[0].get_xdata()) for ax in fig.axes] == [[1], [2]]
    plt.close(fig)


def test_a_dashboard_watching_a_second_fit_redraws_every_every_steps_and_keeps_the_latest_eval(drawn_dashboard):
    """Reused for a second rk.fit call past its total, a Dashboard redrew at every step (the
    figure grows with the history: 0.1 s a step) and its bar stopped at total; its text dropped
    eval/accuracy at every step that did not evaluate, where ConsoleSink keeps the latest."""
    import matplotlib.pyplot as plt

    board = drawn_dashboard(total=100, every=25, keys=("reward/mean", "eval/accuracy"))
    drawn = []
    plot = board.plot

    def counted(*a, **k):
        drawn.append(board.history[-1]["step"])
        return plot(*a, **k)

    board.plot = counted
    for step in range(1, 201):
        board.on_step(step, {"reward/mean": step / 200, **({"eval/accuracy": step / 1000} if step % 10 == 0 else {})})
        if step == 125:
            assert board._text.value == "<code>reward/mean: 0.625 | eval/accuracy: 0.12</code>"
    assert drawn == [25, 50, 75, 100, 125, 150, 175, 200]
    assert board._bar.value == 200 and board._bar.max == 200
    plt.close("all")


def test_a_single_string_of_keys_is_one_key(drawn_dashboard):
    out = io.StringIO()
    sink = ConsoleSink(3, keys="reward/mean", console=Console(file=out, width=140, force_terminal=False))
    sink.on_step(1, {"reward/mean": 0.5, "r": 1.0, "mean": 2.0})
    sink.close()
    assert sink.keys == ("reward/mean",)
    tokens = out.getvalue().split()
    assert "reward=0.5" in tokens and "r=1" not in tokens and "mean=2" not in tokens, out.getvalue()

    board = drawn_dashboard(total=3, keys="reward/mean")
    assert board.keys == ("reward/mean",)
    board.on_step(1, {"reward/mean": 0.5, "r": 1.0})
    assert board._text.value == "<code>reward/mean: 0.5</code>"
    import matplotlib.pyplot as plt

    fig = board.plot(keys="reward/mean")
    assert [ax.get_title() for ax in fig.axes] == ["reward/mean"]
    plt.close(fig)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_dashboard_every_must_be_a_positive_int(bad):
    from rlkit.observe.notebook import Dashboard

    with pytest.raises(ValueError, match="every"):
        Dashboard(total=5, every=bad)


def test_sinks_check_their_int_arguments():
    from rlkit.observe.notebook import Dashboard

    with pytest.raises(ValueError, match="total"):
        Dashboard(total=-1)
    with pytest.raises(ValueError, match="total"):
        Dashboard(total="10")
    with pytest.raises(ValueError, match="total"):
        ConsoleSink(-1, console=Console(file=io.StringIO()))
    with pytest.raises(ValueError, match="total"):
        ConsoleSink(2.5, console=Console(file=io.StringIO()))
    ConsoleSink(None, console=Console(file=io.StringIO())).close()  # an open count stays allowed
    if importlib.util.find_spec("prometheus_client") is not None:
        from rlkit.observe.prometheus import PrometheusSink

        for bad in (-1, 70000, "9400", 9400.0):
            with pytest.raises(ValueError, match="port"):
                PrometheusSink(port=bad)


def test_jsonl_sink_names_a_folder_path_and_a_closed_sink(tmp_path):
    from rlkit.observe.sinks import JSONLSink

    with pytest.raises(ValueError, match="is a folder; give a file path"):
        JSONLSink(tmp_path)  # was IsADirectoryError
    sink = JSONLSink(tmp_path / "m.jsonl")
    sink.on_step(1, {"a": 1.0})
    sink.close()
    with pytest.raises(ValueError, match="was closed; make a new one"):
        sink.on_step(2, {"a": 2.0})  # was "I/O operation on closed file"


@pytest.mark.parametrize("make", ["list", "dashboard"])
def test_in_memory_sinks_rewind_numpy_and_tensor_steps_as_jsonl_does(tmp_path, make):
    """A loop over np.arange (or tensor steps) logged steps that ListSink and Dashboard kept as
    numpy ints: rewind took them for rows without a step and dropped nothing, while the JSONL file
    of the same run was rewound, and json.dumps of the history failed on an int64."""
    import json

    import numpy as np
    import torch

    from rlkit.observe import JSONLSink, ListSink
    from rlkit.observe.notebook import Dashboard

    sink = ListSink() if make == "list" else Dashboard(total=5)
    path = tmp_path / "m.jsonl"
    with JSONLSink(str(path), mode="w") as file_sink:
        for step in list(np.arange(1, 4)) + [torch.tensor(4), np.int32(5)]:
            for s in (sink, file_sink):
                s.on_step(step, {"a": float(step)})
        sink.rewind(2)
        file_sink.rewind(2)
    assert [row["step"] for row in sink.history] == [1, 2]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert all(type(row["step"]) is int for row in sink.history)
    json.dumps(sink.history)  # plain ints: the history is JSON as it is


def test_a_log_file_of_a_run_stopped_between_records_ends_with_a_record_not_the_bar():
    """Written to a file (a batch job's log), a run stopped between records (SIGTERM, Ctrl-C) ended
    its log with rich's bar, glyphs and all, wrapped over several lines: it ends with the last
    step's one-line record, as the records before it read."""
    out = io.StringIO()
    sink = ConsoleSink(300, console=Console(file=out, width=80), log_every_s=3600)
    for step in range(1, 154):
        sink.on_step(step, {"reward/mean": step / 300, "actor/entropy": 2.0})
    sink.close()  # the run stops at step 153 of 300
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert lines[0].startswith("RL 1/300 ") and "reward=0.00333" in lines[0], lines
    assert lines[-1].startswith("RL 153/300 ") and "reward=0.51" in lines[-1], lines
    assert len(lines) == 2 and "━" not in out.getvalue(), out.getvalue()
    # a run that reached total was recorded there: close prints nothing more
    out = io.StringIO()
    sink = ConsoleSink(2, console=Console(file=out, width=80), log_every_s=3600)
    sink.on_step(1, {"reward/mean": 0.1})
    sink.on_step(2, {"reward/mean": 0.2})
    sink.close()
    assert [line.split()[1] for line in out.getvalue().splitlines() if line.strip()] == ["1/2", "2/2"], out.getvalue()
