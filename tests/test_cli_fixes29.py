"""``rlkit run --nproc-per-node N``: a worker's bad-input error (resuming a checkpoint into another
model size) is the one line and exit status 2 that one process gives, not torch elastic's
30-line log of the worker's traceback followed by a "worker rank 1 failed" line and status 1;
the traceback stays in the launch's run directory, and the message says where."""
import logging
import re
import subprocess
import sys

import pytest

TINY = {"sft_steps": 0, "steps": 1, "batch_size": 2, "n": 2, "eval_size": 4, "eval_every": 0, "quiet": True}

#: torch's log lines ("E1203 13:49:29.007000 6624 .../api.py:836] ...", "W1203 ... spawn.py:165] ...")
TORCH_LOG = re.compile(r"^[EWI]\d{4} \d\d:\d\d:\d\d", re.M)


def _cli(args, env):
    return subprocess.run([sys.executable, "-m", "rlkit.cli", *args], capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.distributed
def test_a_bad_resume_on_two_processes_is_the_one_line_and_status_of_one_process(tmp_path, child_env):
    from rlkit.jobs import run_task

    saved = tmp_path / "saved"
    run_task("arithmetic", {**TINY, "out": str(saved)})  # a checkpoint of the default (tiny) size
    args = ["run", "arithmetic", "--resume", str(saved), "--size", "small", "--steps", "2", "--batch-size", "2",
            "--n", "2", "--eval-size", "4", "--quiet"]
    one = _cli(args, child_env(1))
    two = _cli(args + ["--nproc-per-node", "2"], child_env(2))
    assert one.returncode == 2, one.stderr[-3000:]
    line = one.stderr.splitlines()[0]
    assert line.startswith("rlkit run: error: checkpoint ") and "was saved from a different model" in line

    assert two.returncode == 2, two.stderr[-3000:]
    assert not TORCH_LOG.search(two.stderr), two.stderr[-3000:]  # none of torch elastic's log of the failure
    assert "Traceback" not in two.stderr and "api.py" not in two.stderr
    lines = two.stderr.splitlines()
    assert lines[0] == line and len(lines) == 2, two.stderr[-3000:]
    # the worker's traceback is kept, and the message says where
    where = re.fullmatch(r"\(rank (\d+)'s traceback is in (\S+); RLKIT_TRACEBACK=1 prints it\)", lines[1])
    assert where, lines[1]
    text = open(where.group(2), encoding="utf-8").read()
    assert text.startswith("Traceback (most recent call last):") and "CheckpointMismatchError" in text


def _failing_launch(error):
    def launch(*a, **k):
        raise error

    return launch


@pytest.mark.parametrize("types, status", [
    (("rlkit.checkpoint.CheckpointMismatchError", "rlkit.checkpoint.CheckpointError", "builtins.RuntimeError",
      "builtins.ValueError", "builtins.Exception", "builtins.BaseException", "builtins.object"), 2),
    (("rlkit.checkpoint.CheckpointCorruptError", "rlkit.checkpoint.CheckpointError", "builtins.RuntimeError",
      "builtins.Exception", "builtins.BaseException", "builtins.object"), 2),
    (("builtins.ValueError", "builtins.Exception", "builtins.BaseException", "builtins.object"), 2),
    (("torch.OutOfMemoryError", "builtins.RuntimeError", "builtins.Exception", "builtins.BaseException", "builtins.object"), 1),
    ((), 1),  # no Python exception: killed by a signal
])
def test_a_worker_error_gets_the_status_its_exception_gets_in_one_process(monkeypatch, capsys, tmp_path, types, status):
    """Bad input (ValueError, CheckpointError, as ``except`` catches them in one process) -> 2 and
    the exception's own message; a crash keeps status 1 and the "worker rank R failed" line."""
    import importlib

    from rlkit.cli import main
    from rlkit.launch import WorkerError

    (tmp_path / "errors").mkdir()
    text = "Traceback (most recent call last):\n  File \"w.py\", line 1, in <module>\nX: the message\n"
    (tmp_path / "errors" / "rank1.txt").write_text(text)
    error = WorkerError(1, text, {1: text, 0: text}, exception_types=types,
                        exception_message="the message" if types else None, run_dir=str(tmp_path))
    monkeypatch.setattr(importlib.import_module("rlkit.launch"), "launch", _failing_launch(error))
    monkeypatch.delenv("RLKIT_TRACEBACK", raising=False)
    assert main(["run", "arithmetic", "--quiet", "--nproc-per-node", "2"]) == status
    err = capsys.readouterr().err
    where = f"(rank 1's traceback is in {tmp_path / 'errors' / 'rank1.txt'}; RLKIT_TRACEBACK=1 prints it)\n"
    if status == 2:
        assert err == "rlkit run: error: the message\n" + where
    else:
        assert err == "rlkit run: error: worker rank 1 failed (ranks [0] failed too): X: the message\n" + where


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_only_torchs_report_of_the_failed_worker_is_dropped_and_only_during_the_launch():
    from rlkit.launch import _quiet_failure_report

    elastic = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    spawn = logging.getLogger("torch.multiprocessing.spawn")
    records = _Records()
    for logger in (elastic, spawn):
        logger.addHandler(records)
    filters = (list(elastic.filters), list(spawn.filters))

    def log_all():
        try:
            raise RuntimeError("worker")
        except RuntimeError:
            elastic.exception("failed (exitcode: %s) local_rank: %s", 1, 0)
        elastic.error("Process %s did not exit after %s within %ss", 7, "SIGKILL", 30)
        elastic.warning("Received Signals.SIGTERM death signal, shutting down workers")
        spawn.warning("Terminating process %s via signal SIGTERM", 7)
        spawn.warning("Unable to shutdown process %s via SIGTERM , forcefully exiting via SIGKILL", 7)

    try:
        with _quiet_failure_report():
            log_all()
        assert records.messages == ["Process 7 did not exit after SIGKILL within 30s",
                                    "Received Signals.SIGTERM death signal, shutting down workers",
                                    "Unable to shutdown process 7 via SIGTERM , forcefully exiting via SIGKILL"]
        assert (elastic.filters, spawn.filters) == filters  # restored
        records.messages.clear()
        with _quiet_failure_report(enabled=False):  # max_restarts > 0: the log is a recovered failure's only trace
            log_all()
        log_all()
        assert len(records.messages) == 10 and records.messages[0] == "failed (exitcode: 1) local_rank: 0"
    finally:
        for logger in (elastic, spawn):
            logger.removeHandler(records)


@pytest.mark.distributed
def test_launch_records_the_workers_exception_and_keeps_elastics_log_of_it_off_stderr(tmp_path, capfd, child_env, monkeypatch):
    import rlkit as rk
    from rlkit.launch import WorkerError

    def raises_bad_input():  # defined here: cloudpickle ships it by value
        raise ValueError("option 'x' is 3; give 2")

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(WorkerError) as info:
        rk.launch(raises_bad_input, nproc_per_node=2, run_dir=str(tmp_path))
    error = info.value
    assert error.exception_message == "option 'x' is 3; give 2"
    assert error.exception_types[:2] == ("builtins.ValueError", "builtins.Exception")
    assert error.run_dir == str(tmp_path)
    assert error.traceback_file == str(tmp_path / "errors" / f"rank{error.rank}.txt")
    assert "ValueError: option 'x' is 3; give 2" in open(error.traceback_file).read()
    err = capfd.readouterr().err
    assert not TORCH_LOG.search(err) and "Traceback" not in err, err[-3000:]
