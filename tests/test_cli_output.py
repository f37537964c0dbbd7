"""What ``rlkit run`` prints: stopped by Ctrl-C or SIGTERM it says where it stopped and how to
continue, in one line on stderr with the shell's exit status (130, 143), not a traceback through
the model's forward; with ``--quiet`` it prints nothing."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def _stop_after_first_checkpoint(out, sig) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rlkit.cli", "run", "arithmetic", "--sft-steps", "0", "--steps", "500", "--batch-size", "4",
           "--n", "4", "--eval-size", "4", "--eval-every", "0", "--checkpoint-every", "1", "--quiet", "--out", str(out)]
    # SIGINT back to its default in the child: under a job started in the background by a
    # non-interactive shell it is ignored, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = out / "checkpoints" / "step_000001" / "COMPLETE"
    deadline = time.monotonic() + 120
    while not first.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint after 120 s"
        time.sleep(0.02)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_ctrl_c_names_the_step_and_the_checkpoint_to_resume(tmp_path):
    done = _stop_after_first_checkpoint(tmp_path / "out", signal.SIGINT)
    assert done.returncode == 130, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "sys.last_value" not in done.stderr
    line = [l for l in done.stderr.splitlines() if l.startswith("rlkit run: interrupted")][-1]
    assert "after step" in line and str(tmp_path / "out" / "checkpoints" / "step_") in line and "--resume auto" in line


def test_sigterm_names_the_checkpoint_it_saved(tmp_path):
    done = _stop_after_first_checkpoint(tmp_path / "out", signal.SIGTERM)
    assert done.returncode == 143, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    line = [l for l in done.stderr.splitlines() if l.startswith("rlkit run: stopped by SIGTERM")][-1]
    assert f"saved {tmp_path / 'out' / 'checkpoints' / 'step_'}" in line and "--resume auto" in line


def test_quiet_prints_no_bar_but_the_result(tmp_path):
    """transformers' "Writing model shards" bar showed when the run saved its model, under --quiet;
    and --quiet hid the result too (the accuracies and the summary table): it hides the bars only."""
    cmd = [sys.executable, "-m", "rlkit.cli", "run", "arithmetic", "--sft-steps", "0", "--steps", "1", "--batch-size", "4",
           "--n", "4", "--eval-size", "4", "--quiet", "--out", str(tmp_path / "out")]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "model").is_dir()
    assert done.stdout == ""
    assert "Writing model shards" not in done.stderr and "RL (grpo)" not in done.stderr
    assert "held-out accuracy after RL" in done.stderr, done.stderr[-3000:]
