"""Fault recovery: under `rlkit launch`, a worker killed mid-run is restarted by the elastic agent
and the job continues from the last checkpoint to the same final step count."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).parent / "scripts" / "elastic_job.py"


def test_killed_worker_is_restarted_and_the_job_finishes(tmp_path, child_env):
    env = child_env(2)
    cmd = [sys.executable, "-m", "rlkit.cli", "launch", "--nproc-per-node", "2", "--max-restarts", "1",
           str(SCRIPT), str(tmp_path), "6", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    done = json.loads((tmp_path / "done.json").read_text())
    assert done == {"step": 6, "attempt": 1, "resumed_at": 2}, done
    # rank 1's log: steps 1-3 on the first attempt (killed after 3), then 3-6 after resuming from step 2
    lines = [tuple(map(int, line.split())) for line in (tmp_path / "steps.rank1").read_text().splitlines()]
    assert lines == [(0, 1), (0, 2), (0, 3), (1, 3), (1, 4), (1, 5), (1, 6)], lines


def _launch(out, steps, env):
    cmd = [sys.executable, "-m", "rlkit.cli", "launch", "--nproc-per-node", "2", str(SCRIPT), str(out), str(steps), "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((Path(out) / "done.json").read_text())


def test_two_process_resume_equals_uninterrupted(tmp_path, child_env):
    """2 processes: 4 steps == 2 steps + a new job resuming from the step-2 checkpoint + 2 steps."""
    import torch

    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _launch(straight, 4, child_env(2))["step"] == 4
    assert _launch(split, 2, child_env(2))["step"] == 2
    assert _launch(split, 4, child_env(2)) == {"step": 4, "attempt": 0, "resumed_at": 2}
    a, b = torch.load(straight / "final.pt"), torch.load(split / "final.pt")
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-5, msg=name)
