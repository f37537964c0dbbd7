"""rlkit.launch: a rank that returns while a peer waits in a collective, a return value that cannot
be pickled, and non-finite metrics on the ``rk.launch(fn)`` path."""
from __future__ import annotations

import json
import math
import os
import threading
import time

import pytest

from rlkit.launch import TEARDOWN_WAIT_ENV, WorkerError, _meet_at_teardown, _Tail, emit, launch

pytestmark = pytest.mark.distributed


@pytest.fixture
def quick_teardown(monkeypatch):
    """Workers that wait 3 s (not 30) at the closing barrier for a rank still in fn; one thread each."""
    monkeypatch.setenv(TEARDOWN_WAIT_ENV, "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RLKIT_DEVICE", "cpu")


def test_a_collective_only_rank_0_calls_is_reported_not_a_silent_hang(tmp_path, quick_teardown):
    """Rank 1 returned while rank 0 waited in an all_reduce of its own: rank 1's closing barrier
    could never pair with it, and the launch sat silently until the collective timeout."""

    def early():  # a local function: it reaches the workers by value
        import torch
        import torch.distributed as dist

        from rlkit.parallel import init_distributed

        info = init_distributed(timeout=100)  # the old code's hang ends here, after 100 s
        t = torch.ones(1)
        dist.all_reduce(t)
        if info.rank == 1:
            return "rank 1 left"
        dist.all_reduce(t)  # rank 0 alone: a user's bug
        return float(t)

    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(early, nproc_per_node=2, run_dir=str(tmp_path), echo_logs=False)
    elapsed = time.monotonic() - start
    error = info.value
    assert elapsed < 60, f"the launch took {elapsed:.0f} s to report the stuck collective"
    assert error.rank == 0 and sorted(error.failures) == [0]
    message = str(error)
    assert message.startswith("worker rank 0 failed in a collective after rank(s) [1] had returned from fn and left")
    assert "waited 3 s" in message and "if rank == 0:" in message
    assert "in early" in error.worker_traceback and "all_reduce" in error.worker_traceback
    assert (tmp_path / "workers" / "rank1.left").read_text() == "0"


def test_a_rank_busy_alone_after_its_peer_returned_finishes_and_is_named_once(tmp_path, quick_teardown, monkeypatch, capsys):
    """The legitimate case: rank 0 works alone (evaluates, saves) after rank 1 returned, longer
    than the wait: rank 1 leaves without the barrier, rank 0 finishes and its value comes back;
    the caller says once which ranks finished and which still ran. Its NaN metric arrives as a float."""
    monkeypatch.setattr(_Tail, "LEFT_WARN_AFTER_S", 1.0, raising=False)

    def busy_alone():
        import torch
        import torch.distributed as dist

        from rlkit.launch import emit
        from rlkit.parallel import init_distributed

        info = init_distributed(timeout=100)
        t = torch.ones(1)
        dist.all_reduce(t)
        if info.rank == 0:
            time.sleep(7)  # no collective: rank 1 is not needed
            emit({"loss": float("nan"), "text": "nan"})
        return f"rank {info.rank} done after {float(t):g}"

    got = []
    result = launch(busy_alone, nproc_per_node=2, run_dir=str(tmp_path), echo_logs=False,
                    on_metrics=lambda rank, m: got.append((rank, m)))
    assert result == "rank 0 done after 2"
    assert (tmp_path / "workers" / "rank1.left").read_text() == "0"
    assert not (tmp_path / "workers" / "rank0.left").exists()  # it arrived after the barrier was called off
    err = capsys.readouterr().err
    assert err.count("launch: warning: rank(s) [1] returned from fn and waited 3 s") == 1, err
    assert "rank(s) [0], still running" in err and "nothing is wrong" in err
    (rank, metrics), = got
    assert rank == 0 and math.isnan(metrics["loss"]) and metrics["text"] == "nan"


def test_the_teardown_meeting_calls_the_barrier_off_only_after_the_wait():
    """``_meet_at_teardown`` through a real store: None (run the barrier) when every rank arrives in
    time; otherwise the waiting rank names the absent one, and a late rank follows the decision."""
    import torch.distributed as dist

    store = dist.HashStore()
    out = {}

    def arrive(rank, delay, wait_s):
        time.sleep(delay)
        out[rank] = _meet_at_teardown(store, rank, 2, wait_s)

    threads = [threading.Thread(target=arrive, args=(0, 0.0, 5.0)), threading.Thread(target=arrive, args=(1, 0.3, 5.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert out == {0: None, 1: None}

    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # a fresh meeting (the next attempt's keys)
    try:
        out.clear()
        start = time.monotonic()
        threads = [threading.Thread(target=arrive, args=(1, 0.0, 0.5)), threading.Thread(target=arrive, args=(0, 1.5, 0.5))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert out == {1: [0], 0: []}  # rank 1 left rank 0 behind; rank 0 skips the barrier too
        assert time.monotonic() - start < 10
    finally:
        del os.environ["TORCHELASTIC_RESTART_COUNT"]


def test_a_bad_teardown_wait_is_refused_before_any_worker_starts(monkeypatch):
    monkeypatch.setenv(TEARDOWN_WAIT_ENV, "soon")
    with pytest.raises(ValueError, match=r"RLKIT_TEARDOWN_WAIT_S='soon'.*a number >= 0"):
        launch(print, nproc_per_node=1)


def test_an_unpicklable_return_value_is_named_with_its_traceback(tmp_path, monkeypatch):
    """Rank 0's value that cannot be pickled: the error says so, with the TypeError; it used to read
    "exited with code 1 without a Python traceback", blaming whichever rank failed first. A value
    only another rank returns is not pickled at all (launch returns rank 0's)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RLKIT_DEVICE", "cpu")

    def returns(locked_rank):
        import os
        import threading

        rank = int(os.environ["RANK"])
        return {"loss": 0.5, "lock": threading.Lock()} if rank == locked_rank else {"loss": 0.5, "rank": rank}

    with pytest.raises(WorkerError) as info:
        launch(returns, 0, nproc_per_node=2, run_dir=str(tmp_path), echo_logs=False)
    error = info.value
    assert error.rank == 0 and sorted(error.failures) == [0]
    assert str(error).startswith("rank 0's return value cannot be pickled: TypeError: cannot pickle '_thread.lock' object; "
                                 "return tensors/numbers/dicts of them, or save it to a file")
    assert "Traceback (most recent call last)" in error.worker_traceback and "cannot pickle" in error.worker_traceback
    assert "builtins.TypeError" in error.exception_types

    assert launch(returns, 1, nproc_per_node=2, run_dir=str(tmp_path), echo_logs=False) == {"loss": 0.5, "rank": 0}


def test_non_finite_metrics_reach_on_metrics_as_floats_and_text_stays_text(tmp_path, monkeypatch):
    """emit wrote NaN / inf as the strings "nan" / "inf", so on_metrics got text for a diverged loss."""
    (tmp_path / "metrics").mkdir()
    monkeypatch.setenv("RLKIT_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    import torch

    emit({"loss": float("nan"), "up": math.inf, "down": torch.tensor(-math.inf), "label": "nan", "ok": 1.5})
    got = []
    _Tail(str(tmp_path), lambda rank, m: got.append((rank, m)), echo_logs=False, watch=False).poll()
    (rank, metrics), = got
    assert rank == 1
    assert isinstance(metrics["loss"], float) and math.isnan(metrics["loss"])
    assert metrics["up"] == math.inf and metrics["down"] == -math.inf
    assert metrics["label"] == "nan" and metrics["ok"] == 1.5
    json.loads((tmp_path / "metrics" / "rank1.jsonl").read_text())  # Python's json reads its own line back


def test_the_plan_launchs_feed_passes_numbers_and_text_to_the_sinks_as_they_were_emitted():
    # emit now writes NaN/inf as numbers: _Feed's old string-to-float table turned a text metric
    # "nan" into a float for the caller's sinks
    import math

    from rlkit.launch_fit import _Feed

    got = []

    class Keep:
        def on_step(self, step, metrics):
            got.append((step, metrics))

    _Feed([Keep()], None)(0, {"step": 3, "loss": float("nan"), "grad": float("inf"), "note": "nan"})
    step, metrics = got[0]
    assert step == 3 and math.isnan(metrics["loss"]) and metrics["grad"] == math.inf and metrics["note"] == "nan"
