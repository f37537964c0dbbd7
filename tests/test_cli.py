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


@pytest.mark.parametrize("args, message", [
    (["--n", "1"], "option 'n' is 1, but --algo grpo compares the samples of each prompt.*--n 2"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--kl", "-0.1"], "option 'kl' must be >= 0"),
    (["--nproc-per-node", "0"], "option 'nproc_per_node' must be >= 1"),
    (["--device", "gpu"], "device='gpu' is not a device"),
    (["--temperature", "0"], "temperature must be > 0 for RL sampling"),
    (["--lr", "0"], "optimizer lr must be a positive finite number"),
    (["--out", __file__], "option 'out' is .*, an existing file"),
])
def test_run_refuses_bad_options_before_the_warm_up_with_a_message(args, message, monkeypatch, capsys):
    """These options used to fail at the first RL step, after the warm-up (about 1.5 min by
    default), with a traceback; now they stop at once, with the message and exit status 2."""
    import re

    import rlkit.sft
    from rlkit.cli import main

    def no_warmup(*a, **k):
        raise AssertionError("the warm-up ran before the options were checked")

    monkeypatch.setattr(rlkit.sft, "warmup", no_warmup)
    monkeypatch.delenv("RLKIT_TRACEBACK", raising=False)
    assert main(["run", "arithmetic", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlkit run: error: ") and re.search(message, err) and "Traceback" not in err
    monkeypatch.setenv("RLKIT_TRACEBACK", "1")
    with pytest.raises(ValueError, match=message):
        main(["run", "arithmetic", "--quiet", *args])
