"""Session 33: the benchmark scripts refuse bad flags before running (a TRL median of one cold
step, a --json folder, --engine-only that timed nothing, an unknown --device); `rlkit run` checks
--seed before the warm-up and says what a SIGTERM outside training left."""
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import cpu_bounds  # noqa: E402
import grpo_step  # noqa: E402


@pytest.mark.parametrize("argv, says", [
    (["--compare", "trl", "--trl-steps", "1"], "--trl-steps must be >= 2"),  # its median was the cold first step
    (["--json", "{tmp}"], "is a folder"),                                      # IsADirectoryError after the run
    (["--engine-only"], "needs --variants"),                                   # exited 0 having timed nothing
    (["--engine-only", "--variants", "--device", "cpu"], "on the CPU it would time nothing"),
    (["--device", "gpu"], "--device gpu: not a device"),                       # a RuntimeError traceback
])
def test_grpo_step_refuses_bad_flags_before_running(argv, says, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as stop:
        grpo_step.main(["--preset", "cpu", *argv])
    assert stop.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [(["--repeats", "0"], "--repeats must be >= 1"),
                                        (["--threads", "0"], "--threads must be >= 1")])
def test_cpu_bounds_refuses_bad_flags(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        cpu_bounds.main(argv)
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_cpu_bounds_help_is_its_whole_first_paragraph(capsys):
    with pytest.raises(SystemExit):
        cpu_bounds.main(["--help"])
    assert "CPU target (3x TRL's throughput on 2 cores)" in " ".join(capsys.readouterr().out.split())


def test_rlkit_run_checks_the_seed_before_the_warm_up(capsys):
    from rlkit.cli import main

    started = time.perf_counter()
    assert main(["run", "arithmetic", "--seed", "-1", "--sft-steps", "50", "--steps", "1"]) == 2
    assert "option 'seed' (--seed) must be in [0, 2**63), got -1" in capsys.readouterr().err
    assert main(["run", "arithmetic", "--seed", str(10**20), "--sft-steps", "50", "--steps", "1"]) == 2
    assert "(--seed)" in capsys.readouterr().err
    assert time.perf_counter() - started < 5  # no warm-up ran


def test_sigterm_during_the_warm_up_says_nothing_was_saved(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rlkit", "run", "arithmetic", "--out", str(out), "--sft-steps", "100000"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while not (out / "checkpoints").parent.exists() and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # into the warm-up
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "rlkit run: stopped by SIGTERM; no checkpoint in" in err, err[-500:]
