"""The metric sinks: the console bar's layout, the Prometheus endpoint and the wandb run."""
import io
import re
import urllib.error
import urllib.request

import pytest
from rich.console import Console

from rlkit.observe.console import ConsoleSink

METRICS = {"reward/mean": 0.406, "eval/accuracy": 0.43, "actor/entropy": 0.381, "actor/approx_kl": -2.38e-08,
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
    for expected in ("reward=0.406", "acc=0.43", "ent=0.381", "kl=-2.38e-08", "gap=3.47e-07"):
        assert expected in tokens, (expected, text)
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
