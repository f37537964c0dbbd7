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
    """--json printed every value as text: "False" (truthy) for no CUDA, "0" for the GPU count."""
    import torch

    out = json.loads(_rlkit("doctor", "--json").stdout.strip().splitlines()[-1])
    assert out["torch"] == torch.__version__ and isinstance(out["rlkit"], str) and isinstance(out["transformers"], str)
    assert out["cuda_available"] is torch.cuda.is_available() and out["gpu_count"] == len(out["gpus"])
    assert out["gpu_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert isinstance(out["cpu_threads"], int) and out["cpu_threads"] >= 1
    assert out["distributed"]["gloo"] is torch.distributed.is_gloo_available()
    assert set(out["packages"]) >= {"tensordict", "vllm", "wandb"} and out["packages"]["tensordict"]
    for gpu in out["gpus"]:
        assert isinstance(gpu["memory_gib"], float) and gpu["name"]


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
    (["--temperature", "-1"], "temperature must be > 0 for RL sampling, got -1.0"),
    (["--kl", "-0.1"], "option 'kl' must be >= 0"),
    (["--nproc-per-node", "0"], "option 'nproc_per_node' must be >= 1"),
    (["--device", "gpu"], "device='gpu' is not a device"),
    (["--device", "meta"], "device='meta': this torch .* has no usable 'meta' device; use 'cpu', 'cuda'"),
    (["--temperature", "0"], "temperature must be > 0 for RL sampling"),
    (["--lr", "0"], r"option 'lr' \(--lr\) must be a positive finite number, got 0.0"),
    (["--sft-lr", "nan"], r"option 'sft_lr' \(--sft-lr\) must be a positive finite number, got nan"),
    (["--out", __file__], "option 'out' is .*, an existing file"),
    (["--out", __file__ + "/sub"], r"option 'out' \(--out .*sub\) cannot be created or written to \(NotADirectoryError"),
    (["--eval-every", "-1"], r"option 'eval_every' \(--eval-every\) must be >= 0 .*got -1"),
    (["--keep-checkpoints", "-1"], r"option 'keep_checkpoints' \(--keep-checkpoints\) must be >= 0 .*got -1"),
    (["--batch-size", "5000"], r"option 'batch_size' \(--batch-size\) is 5000, more than the 4000 training prompts.*--batch-size 4000 or less"),
    (["--size", "huge"], r"option 'size' \(--size\) is 'huge'; the model presets are \['qwen2.5-0.5b', 'small', 'tiny'\]"),
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


def test_run_on_several_processes_checks_options_before_starting_them(monkeypatch, capsys):
    """``--nproc-per-node 2`` with a bad option: refused in the calling process, not as a worker's traceback."""
    import importlib

    from rlkit.cli import main

    def no_launch(*a, **k):
        raise AssertionError("the workers were started before the options were checked")

    monkeypatch.setattr(importlib.import_module("rlkit.launch"), "launch", no_launch)
    monkeypatch.delenv("RLKIT_TRACEBACK", raising=False)
    assert main(["run", "arithmetic", "--quiet", "--nproc-per-node", "2", "--eval-every", "-1"]) == 2
    assert "option 'eval_every' (--eval-every) must be >= 0" in capsys.readouterr().err
    # a batch the processes cannot share failed in every worker, after the warm-up
    assert main(["run", "arithmetic", "--quiet", "--nproc-per-node", "2", "--batch-size", "15"]) == 2
    assert "--batch-size 15 must be a multiple of the 2 processes (--nproc-per-node); e.g. --batch-size 14" in capsys.readouterr().err


def test_a_failed_worker_is_one_line_not_the_launchers_traceback(monkeypatch, capsys):
    """A worker of --nproc-per-node N that raised came back as the WorkerError's whole traceback text."""
    import importlib

    from rlkit.cli import main
    from rlkit.launch import WorkerError

    text = "Traceback (most recent call last):\n  File \"w.py\", line 1, in <module>\nRuntimeError: CUDA out of memory\n"

    def failing_launch(*a, **k):
        raise WorkerError(1, text, {1: text, 0: text})

    monkeypatch.setattr(importlib.import_module("rlkit.launch"), "launch", failing_launch)
    monkeypatch.delenv("RLKIT_TRACEBACK", raising=False)
    assert main(["run", "arithmetic", "--quiet", "--nproc-per-node", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rlkit run: error: worker rank 1 failed (ranks [0] failed too): RuntimeError: CUDA out of memory\n")
    assert "Traceback" not in err and "RLKIT_TRACEBACK=1" in err
    monkeypatch.setenv("RLKIT_TRACEBACK", "1")
    with pytest.raises(WorkerError):
        main(["run", "arithmetic", "--quiet", "--nproc-per-node", "2"])


TINY = {"sft_steps": 0, "steps": 2, "batch_size": 2, "n": 2, "eval_size": 4, "eval_every": 0, "quiet": True}


def _steps(path):
    return [json.loads(line)["step"] for line in open(path)]


def test_a_fresh_run_into_a_used_out_moves_the_earlier_run_aside(tmp_path, capsys):
    """A second run without --resume into the same --out used to append to the first run's
    metrics.jsonl (steps 1, 2, 1, 2) and overwrite its summary and model: now the first run moves,
    whole, to OUT/previous-1 (stderr says so) and OUT holds only the new run."""
    from rlkit.jobs import run_task

    out = tmp_path / "out"
    first = run_task("arithmetic", {**TINY, "out": str(out), "seed": 1})
    capsys.readouterr()
    run_task("arithmetic", {**TINY, "out": str(out), "seed": 2})
    err = capsys.readouterr().err
    assert _steps(out / "metrics.jsonl") == [1, 2]
    old = out / "previous-1"
    assert _steps(old / "metrics.jsonl") == [1, 2]
    assert json.loads((old / "summary.json").read_text())["seed"] == 1 == first["seed"]
    assert json.loads((out / "summary.json").read_text())["seed"] == 2
    assert (old / "model" / "config.json").exists() and (out / "model" / "config.json").exists()
    assert str(old) in err and "--resume auto" in err
    run_task("arithmetic", {**TINY, "steps": 1, "out": str(out), "seed": 3})  # a third run: previous-2, previous-1 untouched
    assert json.loads((out / "previous-2" / "summary.json").read_text())["seed"] == 2
    assert json.loads((old / "summary.json").read_text())["seed"] == 1


def test_resuming_the_run_in_out_continues_its_metrics(tmp_path):
    """--resume auto from OUT's own checkpoint continues the run there: nothing is moved aside."""
    from rlkit.jobs import run_task

    out = tmp_path / "out"
    run_task("arithmetic", {**TINY, "steps": 1, "checkpoint_every": 1, "out": str(out)})
    # another --seed on resume: the run goes on with its checkpoint's (load warns), and the summary says which
    with pytest.warns(RuntimeWarning, match="saved with seed=0 but the state has seed=5"):
        summary = run_task("arithmetic", {**TINY, "steps": 2, "checkpoint_every": 1, "out": str(out), "resume": "auto",
                                          "seed": 5})
    assert summary["steps"] == 2 and "resumed_from" in summary and summary["seed"] == 0
    assert _steps(out / "metrics.jsonl") == [1, 2]
    assert not list(out.glob("previous-*"))
    # --steps is the step to reach: below the checkpoint's it is refused before anything runs,
    # naming the value that would train that many more steps (it used to say only "already past it")
    with pytest.raises(ValueError, match=r"--steps 1 is below step 2 of the checkpoint .*pass --steps 3 for 1 more"):
        run_task("arithmetic", {**TINY, "steps": 1, "out": str(out), "resume": "auto"})


def _strict_json(text):
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_summary_is_strict_json_when_the_checkpoint_lacks_the_accuracy_before_rl(tmp_path, capsys):
    """A checkpoint saved by the user's own code has no job/accuracy_before_rl: --json and
    summary.json used to print NaN there (not JSON; strict parsers reject it); now null."""
    import rlkit as rk
    from rlkit.checkpoint import save
    from rlkit.cli import main
    from rlkit.models import tiny

    task = rk.tasks.arithmetic()
    state = rk.init(tiny(task.tokenizer, size="tiny", seed=0), rk.optim.adamw(lr=3e-4, weight_decay=0.0), tokenizer=task.tokenizer)
    save(state, tmp_path / "own" / "checkpoints")
    out = tmp_path / "out"
    assert main(["run", "arithmetic", "--quiet", "--json", "--resume", str(tmp_path / "own"), "--steps", "1", "--batch-size", "2",
                 "--n", "2", "--eval-size", "4", "--eval-every", "0", "--out", str(out)]) == 0
    printed = _strict_json(capsys.readouterr().out.strip().splitlines()[-1])
    saved = _strict_json((out / "summary.json").read_text())
    for summary in (printed, saved):
        assert summary["accuracy_before_rl"] is None and summary["accuracy_gain"] is None
        assert isinstance(summary["accuracy_after_rl"], float) and summary["steps"] == 1


@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "0"], "--nproc-per-node is 0; give a number of workers on this machine >= 1"),
    (["--nproc-per-node", "-2"], "--nproc-per-node is -2; give a number of workers"),
    (["--nproc-per-node", "two"], "--nproc-per-node is 'two'; give a number of workers .* or one of auto, cpu, gpu, xpu"),
    (["--nnodes", "0"], "--nnodes is '0'; give a number of machines >= 1"),
    (["--nnodes", "2:1"], "--nnodes is '2:1'; .*1 <= MIN <= MAX"),
    (["--nnodes", "x"], "--nnodes is 'x'; give a number of machines"),
])
def test_launch_refuses_bad_sizes_before_torch_elastic_starts(args, message, monkeypatch, capsys, tmp_path):
    """torch elastic met these with a bare AssertionError (or ValueError) traceback and status 1."""
    import re

    import torch.distributed.run

    from rlkit.cli import main

    def no_torchrun(*a, **k):
        raise AssertionError("torch elastic started with a bad size")

    monkeypatch.setattr(torch.distributed.run, "main", no_torchrun)
    script = tmp_path / "hi.py"
    script.write_text("print('hi')\n")
    with pytest.raises(SystemExit) as info:
        main(["launch", *args, str(script)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("rlkit launch: error: ") and re.search(message, err) and "Traceback" not in err


def test_bad_checkpoint_every_creates_no_out_directory(tmp_path):
    """--checkpoint-every -1 --out X created X (the writability probe) before refusing the option."""
    from rlkit.jobs import check_options

    out = tmp_path / "never"
    with pytest.raises(ValueError, match=r"--checkpoint-every must be >= 0 .*got -1"):
        check_options("arithmetic", {"checkpoint_every": -1, "out": str(out)})
    assert not out.exists()
    with pytest.raises(ValueError, match="--checkpoint-every needs --out DIR"):
        check_options("arithmetic", {"checkpoint_every": 2})
