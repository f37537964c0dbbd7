"""rlkit.launch: elastic workers from Python (as a notebook would), and the torchrun-style shell entry."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from rlkit.launch import WorkerError, _jsonable, emit, launch, torchrun_argv

pytestmark = pytest.mark.distributed

# Run as __main__ of a fresh interpreter, like a notebook kernel: the functions below exist only
# in __main__, so they reach the workers by value (cloudpickle), not by import.
NOTEBOOK = textwrap.dedent(
    '''
    import json, os, sys, time
    from rlkit.launch import WorkerError, emit, launch

    run_dir = sys.argv[1]

    def train(steps, scale=1.0):
        import torch
        import torch.distributed as dist
        from rlkit.parallel.mesh import init_distributed

        info = init_distributed(timeout=60)
        for step in range(steps):
            total = torch.tensor([float(info.rank)])
            dist.all_reduce(total)
            emit({"step": step, "rank_sum": total, "value": scale * step})
        # Streaming, not collected at exit: wait until the caller has seen our metrics.
        ack = os.path.join(run_dir, f"ack{info.rank}")
        deadline = time.time() + 60
        while not os.path.exists(ack) and time.time() < deadline:
            time.sleep(0.05)
        return {"rank": info.rank, "world": info.world_size, "acked": os.path.exists(ack)}

    def on_metrics(rank, metrics):
        seen.append([rank, metrics])
        if metrics["step"] == 2:
            open(os.path.join(run_dir, f"ack{rank}"), "w").close()

    def broken():
        def inner_failure():
            raise ValueError("boom from worker " + os.environ["RANK"])

        if os.environ["RANK"] == "1":
            inner_failure()
        return "rank 0 is fine"

    if __name__ == "__main__":
        seen = []
        result = launch(train, 3, nproc_per_node=2, on_metrics=on_metrics, run_dir=run_dir, scale=2.0)
        try:
            launch(broken, nproc_per_node=2)
            error = None
        except WorkerError as e:
            error = {"rank": e.rank, "traceback": e.worker_traceback, "message": str(e)}
        print("RESULT " + json.dumps({"result": result, "seen": seen, "error": error}), flush=True)
    '''
)

WORKER_SCRIPT = textwrap.dedent(
    '''
    import json, os, sys
    import torch
    import torch.distributed as dist
    from rlkit.parallel.mesh import init_distributed, shutdown

    info = init_distributed(timeout=60)
    total = torch.tensor([info.rank + 1.0])
    dist.all_reduce(total)
    with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as f:
        json.dump({"rank": info.rank, "world": info.world_size, "sum": total.item(), "node": os.environ["GROUP_RANK"]}, f)
    shutdown()
    '''
)


def test_launch_from_python_returns_rank0_result_streams_metrics_and_raises_worker_traceback(tmp_path, child_env):
    script = tmp_path / "notebook.py"
    script.write_text(NOTEBOOK)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(script), str(run_dir)], capture_output=True, text=True, timeout=150, env=child_env(2)
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])

    assert out["result"] == {"rank": 0, "world": 2, "acked": True}
    seen = out["seen"]
    assert sorted({rank for rank, _ in seen}) == [0, 1]
    for rank in (0, 1):
        steps = [m for r, m in seen if r == rank]
        assert [m["step"] for m in steps] == [0, 1, 2]
        assert [m["value"] for m in steps] == [0.0, 2.0, 4.0]
        assert all(m["rank_sum"] == 1.0 for m in steps)  # tensors arrive as numbers; 0 + 1 over both ranks

    error = out["error"]
    assert error is not None and error["rank"] == 1
    assert "ValueError: boom from worker 1" in error["traceback"]
    assert "inner_failure" in error["traceback"]  # the worker's own frames, not the launcher's
    assert "boom from worker 1" in error["message"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shell_launch_two_nodes_one_rendezvous(tmp_path, child_env):
    script = tmp_path / "job.py"
    script.write_text(WORKER_SCRIPT)
    port = _free_port()
    cmd = [
        sys.executable, "-m", "rlkit.launch", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", str(script), str(tmp_path),
    ]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(2)) for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=150)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    records = sorted((json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)), key=lambda d: d["rank"])
    assert [d["world"] for d in records] == [2, 2]
    assert [d["sum"] for d in records] == [3.0, 3.0]  # 1 + 2: the all-reduce crossed the two agents
    assert sorted(d["node"] for d in records) == ["0", "1"]  # one worker per agent ("node")


@pytest.fixture
def scripts(tmp_path, monkeypatch):
    """A working directory holding the scripts the torchrun_argv tests name."""
    monkeypatch.chdir(tmp_path)
    for name in ("train.py", "t.py"):
        (tmp_path / name).write_text("print('hi')\n")
    return tmp_path


def test_torchrun_argv_defaults(scripts):
    assert torchrun_argv(["--nproc-per-node", "2", "train.py"])[0] == "--standalone"
    multi = torchrun_argv(["--nnodes", "2", "--rdzv-endpoint", "h:1", "train.py", "--lr", "1"])
    assert multi[0] == "--rdzv-backend=c10d" and multi[-3:] == ["train.py", "--lr", "1"]
    explicit = ["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "t.py"]
    assert torchrun_argv(explicit) == explicit


def test_torchrun_argv_refuses_bad_sizes_naming_the_flag(scripts):
    # torch elastic meets these with a bare AssertionError / ValueError traceback
    for argv, flag in [(["--nproc-per-node", "0"], "--nproc-per-node"), (["--nproc-per-node", "-1"], "--nproc-per-node"),
                       (["--nproc-per-node", "many"], "--nproc-per-node"), (["--nnodes", "0"], "--nnodes"),
                       (["--nnodes", "3:2"], "--nnodes"), (["--nnodes", "1:2:3"], "--nnodes"),
                       (["--max-restarts", "-1"], "--max-restarts")] + (
                          [] if getattr(__import__("torch"), "xpu", None) and __import__("torch").xpu.is_available()
                          else [(["--nproc-per-node", "xpu"], "--nproc-per-node")]):
        with pytest.raises(ValueError, match=f"^{flag} is "):
            torchrun_argv([*argv, "train.py"])
    for ok in (["--nproc-per-node", "auto"], ["--nproc-per-node", "cpu"], ["--nnodes", "1:2", "--rdzv-endpoint", "h:1"]):
        assert torchrun_argv([*ok, "train.py"])[-1] == "train.py"
    # several machines need a meeting point: torchrun's static default (this machine) waited silently
    for nnodes in ("2", "1:4"):
        with pytest.raises(ValueError, match=f"^--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT"):
            torchrun_argv(["--nnodes", nnodes, "--nproc-per-node", "2", "train.py"])
    assert torchrun_argv(["--nnodes", "2", "--master-addr", "10.0.0.1", "--node-rank", "1", "train.py"])[-1] == "train.py"
    # an out-of-tree backend's name, as torchrun takes it, once the backend has renamed privateuse1
    with pytest.raises(ValueError, match="^--nproc-per-node is 'privateuseone'"):
        torchrun_argv(["--nproc-per-node", "privateuseone", "train.py"])


def test_rlkit_launch_names_a_missing_script_and_itself(scripts, capsys):
    """A missing script failed in every worker and came back as torch elastic's 50-line
    ChildFailedError; argparse's usage and errors said "rlkit", torchrun's own description."""
    from rlkit.launch import main_launch

    with pytest.raises(ValueError, match="^script 'missing.py' not found .*-m MODULE"):
        torchrun_argv(["--nproc-per-node", "2", "missing.py"])
    assert torchrun_argv(["--nproc-per-node", "2", "-m", "some.module"])[-1] == "some.module"  # a module is not a file
    with pytest.raises(SystemExit) as exit_info:
        main_launch(["--nproc-per-node", "2", "missing.py"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("rlkit launch: error: script 'missing.py' not found")
    with pytest.raises(SystemExit):
        main_launch(["--help"])
    assert capsys.readouterr().out.startswith("usage: rlkit launch ")


def test_torchrun_argv_takes_a_registered_backend_name(monkeypatch, scripts):
    import torch

    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "npu")
    assert torchrun_argv(["--nproc-per-node", "npu", "train.py"])[-1] == "train.py"


def test_emit_outside_launch_is_a_no_op(monkeypatch, tmp_path):
    monkeypatch.delenv("RLKIT_RUN_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    emit({"loss": 1.0})
    assert list(tmp_path.iterdir()) == []


def test_jsonable_turns_tensors_into_numbers():
    import torch

    record = _jsonable({"a": torch.tensor(1.5), "b": torch.tensor([1, 2]), "c": float("nan"), "d": (1, 2.0)})
    assert record == {"a": 1.5, "b": [1, 2], "c": "nan", "d": [1, 2.0]}
    json.dumps(record)


def test_the_module_is_callable_like_the_function():
    import importlib

    module = importlib.import_module("rlkit.launch")  # what `rlkit.launch` is after `from rlkit.launch import emit`
    with pytest.raises(ValueError, match="nproc_per_node"):
        module(print, nproc_per_node=0)


def test_launch_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        launch(print, nnodes=2)
    with pytest.raises(ValueError, match="nproc_per_node"):
        launch(print, nproc_per_node=0)
    assert issubclass(WorkerError, RuntimeError)
    # wrong types fail here, naming the argument, not as a TypeError inside torch elastic
    for kwargs, name in [
        (dict(nproc_per_node="1"), "nproc_per_node"), (dict(nproc_per_node=True), "nproc_per_node"),
        (dict(nproc_per_node=1.0), "nproc_per_node"), (dict(nnodes=0), "nnodes"), (dict(nnodes="2:1"), "nnodes"),
        (dict(nnodes="two"), "nnodes"), (dict(nnodes=1.5), "nnodes"), (dict(max_restarts=-1), "max_restarts"),
        (dict(rdzv_endpoint=29400), "rdzv_endpoint"), (dict(rdzv_backend=None), "rdzv_backend"),
        (dict(run_id=7), "run_id"), (dict(on_metrics="print"), "on_metrics"), (dict(run_dir=3), "run_dir"),
    ]:
        with pytest.raises(ValueError, match=name):
            launch(print, **kwargs)
    # run_dir naming a file (or under one): a ValueError, and the file is left alone
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    for run_dir in (existing, str(existing), str(existing / "run")):
        with pytest.raises(ValueError, match="run_dir"):
            launch(print, nproc_per_node=1, run_dir=run_dir)
    assert existing.read_text() == "keep me"


def test_a_worker_that_exits_with_status_0_is_a_worker_error(tmp_path, monkeypatch):
    """sys.exit(0) inside fn ends the process "successfully" for torch elastic, with no result:
    launch must say which rank did it, not fail on the missing result."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def quits_early():  # a local function: it reaches the workers by value
        import os
        import sys

        if os.environ["RANK"] == "1":
            sys.exit(0)
        return "rank 0 is fine"

    with pytest.raises(WorkerError) as info:
        launch(quits_early, nproc_per_node=2, run_dir=str(tmp_path), echo_logs=False)
    error = info.value
    assert error.rank == 1 and sorted(error.failures) == [1]
    assert "SystemExit" in error.worker_traceback and "quits_early" in error.worker_traceback
    assert "rank(s) [1]" in str(error) and "without returning" in str(error)


def _script_result(source: str, tmp_path, child_env, timeout: float = 180):
    """Run ``source`` as a script (argv[1]: a run_dir) in a fresh process; the JSON of its last
    ``RESULT`` line."""
    script = tmp_path / "job.py"
    script.write_text(source)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=timeout, env=child_env(1))
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


VANISHING = textwrap.dedent(
    """
    import json, os, sys
    from rlkit.launch import WorkerError, launch

    def ends_without_a_word():
        if os.environ["RANK"] == "1":
            os._exit(0)  # no exception, no return: torch elastic waited for its result forever
        return "rank 0 is fine"

    if __name__ == "__main__":
        try:
            launch(ends_without_a_word, nproc_per_node=2, run_dir=sys.argv[1], echo_logs=False)
            print("RESULT null", flush=True)
        except WorkerError as e:
            print("RESULT " + json.dumps({"rank": e.rank, "failures": sorted(e.failures), "message": str(e)}), flush=True)
    """
)


def test_a_worker_that_ends_without_returning_or_raising_stops_the_launch(tmp_path, child_env):
    """os._exit(0) inside fn: the process ends with status 0 and no result, which torch elastic
    polls for forever (the launch hung). A watchdog in the caller sees the process gone without
    leaving fn and stops the run with a WorkerError naming the rank."""
    out = _script_result(VANISHING, tmp_path, child_env)
    assert out["rank"] == 1 and out["failures"] == [1]
    assert "rank(s) [1] ended while running fn" in out["message"] and "os._exit" in out["message"]


VANISHING_WITH_RESTARTS = VANISHING.replace("nproc_per_node=2,", "nproc_per_node=2, max_restarts=2,")


def test_os_exit_0_stops_a_launch_with_restarts_too(tmp_path, child_env):
    """With max_restarts > 0 the watchdog was off (a restart's SIGTERM to the survivors looks like
    a worker vanishing), so os._exit(0) inside fn hung the launch forever. The worker now notes
    an os._exit of its own before the process ends, and that note is certain with restarts too."""
    assert "max_restarts=2" in VANISHING_WITH_RESTARTS
    out = _script_result(VANISHING_WITH_RESTARTS, tmp_path, child_env, timeout=120)
    assert out["rank"] == 1 and out["failures"] == [1]
    assert "rank(s) [1] ended while running fn" in out["message"] and "os._exit" in out["message"]


RESTARTED = textwrap.dedent(
    """
    import json, os, sys, time
    from rlkit.launch import launch

    def fails_once():
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if os.environ["RANK"] == "0" and attempt == 0:
            time.sleep(0.5)
            raise RuntimeError("transient failure on the first attempt")
        if os.environ["RANK"] == "1" and attempt == 0:
            time.sleep(6)  # still running when rank 0 fails: torch elastic stops it with SIGTERM to restart
        return attempt

    if __name__ == "__main__":
        print("RESULT " + json.dumps(launch(fails_once, nproc_per_node=2, max_restarts=1, run_dir=sys.argv[1], echo_logs=False)), flush=True)
    """
)


def test_a_restarted_run_is_not_taken_for_a_vanished_worker(tmp_path, child_env):
    """With max_restarts, torch elastic stops the surviving workers with SIGTERM before they leave
    fn; the os._exit watchdog took that for a worker that vanished and ended the launch instead
    of letting the group restart."""
    assert _script_result(RESTARTED, tmp_path, child_env) == 1  # rank 0's result on the second attempt


TERMINATED = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    from rlkit.launch import Terminated, launch

    def sleeps():
        time.sleep(60)

    if __name__ == "__main__":
        before = signal.getsignal(signal.SIGINT)
        assert launch(len, [1, 2], nproc_per_node=1, run_dir=sys.argv[1] + "-ok", echo_logs=False) == 2
        restored = signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        threading.Timer(8, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()  # a scheduler's stop
        t0 = time.monotonic()
        try:
            launch(sleeps, nproc_per_node=2, run_dir=sys.argv[1], echo_logs=False)
            code = None
        except Terminated as e:
            code = e.code
        print("RESULT " + json.dumps({"restored": restored, "code": code, "seconds": time.monotonic() - t0,
                                      "handler_after": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL}), flush=True)
    """
)


def test_sigterm_to_a_launch_is_terminated_and_the_signal_handlers_are_restored(tmp_path, child_env):
    """torch elastic raised its own SignalException for a SIGTERM (rlkit run --nproc-per-node 2
    printed its traceback and exited 1, not 143) and left its handlers installed after the launch
    returned, so a later Ctrl-C in the caller's code raised SignalException, not KeyboardInterrupt."""
    out = _script_result(TERMINATED, tmp_path, child_env)
    assert out["restored"] and out["handler_after"]
    assert out["code"] == 143 and out["seconds"] < 50


def test_a_reused_run_dir_echoes_only_this_runs_output(tmp_path, monkeypatch, capsys):
    """Every earlier run's worker logs under run_dir/logs were echoed again before this run's own."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def say(word):  # a local function: it reaches the worker by value
        print("WORKER SAYS", word, flush=True)
        return word

    assert launch(say, "first", nproc_per_node=1, run_dir=str(tmp_path)) == "first"
    assert "WORKER SAYS first" in capsys.readouterr().out
    assert launch(say, "second", nproc_per_node=1, run_dir=str(tmp_path)) == "second"
    out = capsys.readouterr().out
    assert "WORKER SAYS second" in out and "WORKER SAYS first" not in out


def test_rk_launch_is_callable_and_holds_its_names():
    """rk.launch was the function, so the tutorial's rk.launch.WorkerError and rk.launch.emit were
    AttributeErrors."""
    import rlkit as rk

    assert callable(rk.launch) and rk.launch.WorkerError is WorkerError and rk.launch.emit is emit
    assert rk.launch.launch is launch
    # a launched function that writes rk.launch.emit holds the module: it must travel to the workers
    # (cloudpickle failed: "cannot pickle '_CallableModule' object", before any worker started)
    import cloudpickle

    import rlkit.launch  # noqa: F401 - imported, as rk.launch(...) has imported it by then

    notebook = {"rk": rk, "__name__": "__main__"}  # a notebook's function: cloudpickle ships it by value
    exec("def train():\n    rk.launch.emit({'step': 0})\n", notebook)
    assert cloudpickle.loads(cloudpickle.dumps(notebook["train"])).__globals__["rk"].launch is rk.launch
    # python -m rlkit.launch: runpy warned that the module was already imported by the package
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "rlkit.launch", "--nproc-per-node", "0", "x.py"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "RuntimeWarning" not in proc.stderr, proc.stderr


def test_a_rank_that_reports_a_peers_reward_failure_is_not_named_as_its_cause(tmp_path):
    """shard_reward gathers every rank's reward error and raises "failed on rank 1" on rank 0 too;
    rank 0 wrote its traceback first, so the WorkerError named rank 0 for rank 1's own error."""
    import os
    from types import SimpleNamespace

    from rlkit.launch import _worker_error

    errors = tmp_path / "errors"
    errors.mkdir()
    (errors / "rank0.txt").write_text("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
                                      "RuntimeError: reward 'bad' failed on rank 1: RuntimeError: exploded\n")
    (errors / "rank1.txt").write_text("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
                                      "RuntimeError: reward 'bad' raised RuntimeError: exploded\n")
    os.utime(errors / "rank0.txt", (1000, 1000))  # rank 0 first, as in the runs that named it
    os.utime(errors / "rank1.txt", (2000, 2000))
    error = _worker_error(str(tmp_path), SimpleNamespace(failures={}))
    assert error.rank == 1 and sorted(error.failures) == [0, 1]
    # a rank whose error names itself, or a rank that did not fail, is not a reporter
    (errors / "rank0.txt").write_text("RuntimeError: reward 'bad' failed on rank 7: boom\n")
    os.utime(errors / "rank0.txt", (1000, 1000))
    assert _worker_error(str(tmp_path), SimpleNamespace(failures={})).rank == 0


STALE = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from rlkit.launch import WorkerError, launch

    def raises_then_is_killed():
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if os.environ["RANK"] == "1":
            if attempt == 0:
                raise ValueError("the first attempt's error")
            os.kill(os.getpid(), signal.SIGKILL)  # the second attempt dies without a Python traceback
        time.sleep(20)  # rank 0 is stopped by torch elastic when rank 1 fails

    if __name__ == "__main__":
        try:
            launch(raises_then_is_killed, nproc_per_node=2, max_restarts=1, run_dir=sys.argv[1], echo_logs=False)
            print("RESULT null", flush=True)
        except WorkerError as e:
            print("RESULT " + json.dumps({"rank": e.rank, "message": str(e), "types": list(e.exception_types)}), flush=True)
    """
)


def test_after_a_restart_the_error_is_the_last_attempts_not_a_stale_traceback(tmp_path, child_env):
    """Each rank's traceback file outlived a restart: the second attempt's rank 1, killed by
    SIGKILL, was reported with the first attempt's ValueError (and bad input by rlkit run's exit
    status). A rank's worker now clears its own files of an earlier attempt when it starts."""
    out = _script_result(STALE, tmp_path, child_env)
    assert out["rank"] == 1, out
    assert "the first attempt's error" not in out["message"], out["message"]
    assert "killed by signal SIGKILL" in out["message"] and out["types"] == [], out
