"""The `rlkit` command: doctor, and the built-in job on 1 and 2 processes."""
import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _rlkit(*args, timeout=300, env=None):
    proc = subprocess.run([sys.executable, "-m", "rlkit.cli", *args], capture_output=True, text=True, timeout=timeout, env=env or ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_doctor_reports_versions_and_devices():
    out = json.loads(_rlkit("doctor", "--json").stdout.strip().splitlines()[-1])
    for key in ("rlkit", "torch", "transformers", "cuda available", "gpu count", "vllm"):
        assert key in out, key


@pytest.mark.distributed
def test_run_on_two_processes_writes_a_loadable_model(tmp_path, child_env):
    proc = _rlkit("run", "arithmetic", "--nproc-per-node", "2", "--steps", "3", "--sft-steps", "20", "--eval-every", "3",
                  "--batch-size", "4", "--n", "4", "--eval-size", "16", "--json", "--quiet", "--out", str(tmp_path), env=child_env(2))
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["processes"] == 2
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sync/bytes"] > 0 for r in rows[1:])  # weights moved into the generation layout
    import rlkit as rk

    model = rk.models.load_model(tmp_path / "model")
    assert sum(p.numel() for p in model.parameters()) > 0
