"""A checkpoint save that fails (a full disk), and the advice a broken checkpoint's error gives.

- a write that failed inside DCP (``OSError(ENOSPC)`` from its file writer) left ``save`` (and
  ``rk.fit`` with a Checkpointer, and ``rlkit run``) as DCP's ``CheckpointException``, a
  ``BaseException`` that ``except Exception`` / ``except OSError`` missed, whose message was a
  traceback dump naming no checkpoint: now a :class:`CheckpointSaveError` (a CheckpointError and an
  OSError with the cause's errno) names the checkpoint, the cause and the intact earlier ones;
- ``rlkit run`` printed ~60 lines of traceback ending in rk.fit's notebook hint: now the cause, the
  last complete checkpoint and ``--resume auto``, status 1 (a worker's failure too, not status 2);
- a checkpoint without its COMPLETE marker advised resuming from the previous one by name alone,
  itself broken too: now the newest earlier one that verifies, or says none does;
- a leftover ``step_<k>.tmp-*`` folder said "there is no older checkpoint next to it" beside
  complete ones: its step is read from its name.
"""
from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch

import rlkit as rk
from rlkit import checkpoint as ck


def _linear_state(seed=0):
    torch.manual_seed(seed)
    return rk.init(torch.nn.Linear(4, 3), rk.optim.adamw(lr=1e-2), seed=7)


def _disk_full(monkeypatch, when=lambda writer: True):
    """DCP's file writer raises ENOSPC, as on a full disk, for the saves ``when(writer)`` picks."""
    import torch.distributed.checkpoint.filesystem as fs

    real = fs._FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if when(self):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, plan, planner)

    monkeypatch.setattr(fs._FileSystemWriter, "write_data", write_data)


def _saving(step):
    return lambda writer: Path(str(writer.path)).name.startswith(f"{ck.step_dir_name(step)}.tmp-")


def test_a_failed_write_is_an_ordinary_oserror_naming_the_checkpoint_the_cause_and_the_intact_ones(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.api import CheckpointException

    state = _linear_state()
    first, second = ck.save(state.replace(step=1), tmp_path), ck.save(state.replace(step=2), tmp_path)
    _disk_full(monkeypatch)
    with pytest.raises(OSError) as info:  # DCP's CheckpointException is a BaseException: it got past this
        ck.save(state.replace(step=3), tmp_path)
    error = info.value
    assert isinstance(error, ck.CheckpointSaveError) and isinstance(error, ck.CheckpointError)
    assert error.errno == errno.ENOSPC
    message = str(error)
    assert message.startswith(f"saving checkpoint {tmp_path / 'step_000003'} failed: OSError: [Errno 28] No space left on device.")
    assert f"the earlier checkpoints in {tmp_path} are intact (the newest complete one: step_000002" in message
    assert "free space on that disk first" in message and "Traceback" not in message
    assert (error.path, error.previous) == (tmp_path / "step_000003", second)
    assert error.reason == "OSError: [Errno 28] No space left on device"
    assert isinstance(error.__cause__, CheckpointException)  # chained from DCP's report
    # what the message says holds: the partial folder is gone, the earlier checkpoints verify and load
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002"]
    for path in (first, second):
        ck.verify(path)
    assert ck.load(_linear_state(seed=1), second).step == 2


def test_a_failure_that_is_not_an_oserror_is_a_checkpoint_save_error_without_errno(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    def broken(self, plan, planner):
        raise RuntimeError("the storage backend refused the write")

    monkeypatch.setattr(fs._FileSystemWriter, "write_data", broken)
    with pytest.raises(ck.CheckpointSaveError) as info:
        ck.save(_linear_state().replace(step=1), tmp_path)
    assert info.value.errno is None and info.value.previous is None
    assert "failed: RuntimeError: the storage backend refused the write" in str(info.value)
    assert f"there is no earlier complete checkpoint in {tmp_path}" in str(info.value)
    assert "free space" not in str(info.value) and list(tmp_path.iterdir()) == []


def test_ctrl_c_in_the_writer_is_still_keyboardinterrupt(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    def interrupted(self, plan, planner):
        raise KeyboardInterrupt

    monkeypatch.setattr(fs._FileSystemWriter, "write_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ck.save(_linear_state().replace(step=1), tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def task():
    return rk.tasks.arithmetic(digits=2, n_train=16, n_test=4)


def _tiny_state(task):
    model = rk.models.tiny(task.tokenizer, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, seed=0)
    return rk.init(model, rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer, seed=0)


def test_fit_with_a_checkpointer_raises_it_with_the_state_and_can_go_on(tmp_path, monkeypatch, task):
    import warnings

    recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=2)
    checkpointer = ck.Checkpointer(tmp_path, every=1, keep=10, save_on_sigterm=False)
    _disk_full(monkeypatch, _saving(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rk.fit(_tiny_state(task), recipe, task.reward, task.train, steps=3, batch_size=2, checkpointer=checkpointer)
        except Exception as exc:  # noqa: BLE001 - the point: an ordinary `except Exception` catches it
            error = exc
        else:
            pytest.fail("fit did not raise")
        assert isinstance(error, ck.CheckpointSaveError) and str(tmp_path / "step_000002") in str(error)
        assert error.state.step == 2  # as fit's own exceptions carry it
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
        ck.verify(tmp_path / "step_000001")
        monkeypatch.undo()  # space freed: the run goes on from exc.state with the same Checkpointer
        state, _ = rk.fit(error.state, recipe, task.reward, task.train, steps=3, batch_size=2, checkpointer=checkpointer)
    assert state.step == 3 and [s for s, _ in ck.list_checkpoints(tmp_path)] == [1, 3]


CLI = ["run", "arithmetic", "--sft-steps", "0", "--steps", "3", "--batch-size", "2", "--n", "2", "--eval-size", "4",
       "--eval-every", "0", "--quiet", "--checkpoint-every", "1"]


def test_rlkit_run_says_what_failed_and_how_to_go_on_in_a_few_lines(tmp_path, monkeypatch, capsys):
    from rlkit.cli import main

    out = tmp_path / "out"
    monkeypatch.delenv("RLKIT_TRACEBACK", raising=False)
    _disk_full(monkeypatch, _saving(2))
    assert main([*CLI, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    root = out / "checkpoints"
    assert (f"rlkit run: error: saving checkpoint {root / 'step_000002'} failed: OSError: [Errno 28] No space left on "
            f"device (the disk is full: free space on it before you rerun)") in err
    assert (f"rlkit run: stopped after step 2; the last checkpoint is {root / 'step_000001'}: rerun the same command "
            f"with --resume auto to continue") in err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("held-out accuracy")]
    assert "Traceback" not in err and "sys.last_value" not in err and len(lines) == 3, lines
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]
    monkeypatch.undo()
    monkeypatch.delenv("RLKIT_TRACEBACK", raising=False)
    assert main([*CLI, "--out", str(out), "--resume", "auto"]) == 0  # what it says works
    assert [s for s, _ in ck.list_checkpoints(root)] == [1, 2, 3]


def test_a_worker_that_failed_to_save_is_not_reported_as_bad_input(monkeypatch, capsys, tmp_path):
    """A CheckpointSaveError is a CheckpointError, which `rlkit run` reports as bad input (status 2)."""
    import importlib

    from rlkit.cli import main
    from rlkit.launch import WorkerError

    out = tmp_path / "out"
    ck.save(_linear_state().replace(step=4), out / "checkpoints")
    (tmp_path / "errors").mkdir()
    text = "Traceback (most recent call last):\nrlkit.checkpoint.CheckpointSaveError: saving checkpoint X failed\n"
    (tmp_path / "errors" / "rank1.txt").write_text(text)
    types = ("rlkit.checkpoint.CheckpointSaveError", "rlkit.checkpoint.CheckpointError", "builtins.RuntimeError",
             "builtins.OSError", "builtins.Exception", "builtins.BaseException", "builtins.object")
    error = WorkerError(1, text, {1: text}, exception_types=types, run_dir=str(tmp_path),
                        exception_message="saving checkpoint X failed: OSError: [Errno 28] No space left on device. The ...")

    def failing_launch(*args, **kwargs):
        raise error

    monkeypatch.setattr(importlib.import_module("rlkit.launch"), "launch", failing_launch)
    monkeypatch.delenv("RLKIT_TRACEBACK", raising=False)
    assert main(["run", "arithmetic", "--quiet", "--nproc-per-node", "2", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rlkit run: error: saving checkpoint X failed: OSError: [Errno 28] No space left on device.")
    assert (f"rlkit run: stopped; the last checkpoint is {out / 'checkpoints' / 'step_000004'}: rerun the same "
            f"command with --resume auto to continue") in err
    assert f"rank 1's traceback is in {tmp_path / 'errors' / 'rank1.txt'}" in err


# --------------------------------------------------------------------------- advice of a broken checkpoint
def _three(tmp_path):
    state = _linear_state()
    return [ck.save(state.replace(step=k), tmp_path) for k in (1, 2, 3)]


def _truncate(path):
    data = next(path.glob("*.distcp"))
    blob = data.read_bytes()
    data.write_bytes(blob[: len(blob) // 2])


def test_a_checkpoint_without_marker_suggests_the_newest_earlier_one_that_verifies(tmp_path):
    first, second, third = _three(tmp_path)
    _truncate(third)
    shutil.copytree(second, tmp_path / "step_000004")
    (tmp_path / "step_000004" / ck.MARKER).unlink()
    with pytest.raises(ck.CheckpointCorruptError) as info:
        ck.load(_linear_state(seed=1), tmp_path / "step_000004")
    message = str(info.value)
    assert f"resume from the newest complete checkpoint before it instead ({second}, e.g. `--resume {second}`" in message
    assert "the newer step_000003: file __0_0.distcp has" in message and "is damaged too" in message
    assert f"({third}," not in message  # the broken one is not what it suggests
    # every earlier one broken: it says so instead of naming one
    _truncate(second)
    (first / ck.MARKER).write_text("{not json")
    with pytest.raises(ck.CheckpointCorruptError) as info:
        ck.verify(tmp_path / "step_000004")
    message = str(info.value)
    assert "none of the 3 older checkpoint(s) next to it is complete either (step_000003: file __0_0.distcp has" in message
    assert "step_000001: its COMPLETE cannot be read" in message and "start a fresh run" in message
    assert "resume from" not in message


def test_the_suggestion_is_checked_as_resume_auto_checks_it_checksums_included(tmp_path):
    first, second, third = _three(tmp_path)
    data = next(second.glob("*.distcp"))
    blob = data.read_bytes()
    data.write_bytes(blob[:50] + bytes([blob[50] ^ 0xFF]) + blob[51:])  # same size: only the sha256 tells
    _truncate(third)
    with pytest.raises(ck.CheckpointCorruptError) as info:
        ck.verify(third)
    assert f"before it instead ({first}," in str(info.value) and "step_000002: file __0_0.distcp fails its sha256" in str(info.value)
    with pytest.raises(ck.CheckpointCorruptError) as info:
        ck.verify(third, checksum=False)  # sizes only, as the caller asked: step 2 passes that test
    assert f"resume from the previous checkpoint instead ({second}," in str(info.value)
    with pytest.warns(RuntimeWarning, match="skipped 2 corrupted checkpoint"):
        assert ck.Checkpointer(tmp_path, save_on_sigterm=False).resume(_linear_state(seed=1), "auto").step == 1


def test_a_leftover_temp_folder_is_told_the_checkpoints_of_its_steps(tmp_path):
    first, second, third = _three(tmp_path)
    leftover = tmp_path / "step_000007.tmp-deadbeef0123"
    shutil.copytree(first, leftover)
    (leftover / ck.MARKER).unlink()
    with pytest.raises(ck.CheckpointCorruptError) as info:
        ck.load(_linear_state(seed=1), leftover)
    message = str(info.value)
    assert "there is no older checkpoint" not in message
    assert f"resume from the previous checkpoint instead ({third}, e.g. `--resume {third}`" in message
    # a temp folder of a step whose complete checkpoint is there: that one is the finished save
    leftover.rename(tmp_path / "step_000003.tmp-0123abcd")
    with pytest.raises(ck.CheckpointCorruptError, match=rf"instead \({third},"):
        ck.verify(tmp_path / "step_000003.tmp-0123abcd")


# --------------------------------------------------------------------------- two processes
def _fail_on_rank_1(directory):
    """Worker: save step 1, then step 2 with rank 1's writer failing as on a full disk."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as fs

    from rlkit.parallel.mesh import init_distributed, shutdown

    init_distributed()
    state = _linear_state()
    ck.save(state.replace(step=1), directory)
    real = fs._FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, plan, planner)

    fs._FileSystemWriter.write_data = write_data
    try:
        ck.save(state.replace(step=2), directory)
        result = "no error"
    except ck.CheckpointSaveError as exc:
        result = (type(exc).__name__, str(exc), exc.errno)
    finally:
        fs._FileSystemWriter.write_data = real
    dist.barrier()
    shutdown()
    return result


@pytest.mark.distributed
def test_a_save_that_fails_on_one_rank_raises_it_on_every_rank(tmp_path):
    from rlkit.parallel.local import run_local

    results = run_local(_fail_on_rank_1, 2, str(tmp_path), timeout=180)
    for name, message, code in results:
        assert name == "CheckpointSaveError" and code == errno.ENOSPC
        assert f"saving checkpoint {tmp_path / 'step_000002'} failed: OSError: [Errno 28] No space left on device (on rank 1)" in message
        assert "the newest complete one: step_000001" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]


def test_checksums_do_not_need_python_3_11(tmp_path, monkeypatch):
    # hashlib.file_digest is 3.11+; requires-python is >=3.10, where every checksummed save failed
    import hashlib

    from rlkit.checkpoint import _sha256

    data = bytes(range(256)) * 9000  # over one read block
    (tmp_path / "f").write_bytes(data)
    monkeypatch.delattr(hashlib, "file_digest", raising=False)
    assert _sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_checkpointer_refuses_non_finite_weights_and_keeps_the_good_ones(tmp_path):
    """An optimizer step that overflowed the weights (lr 3e38) had a finite loss and grad norm: fit
    then saved checkpoint after checkpoint of inf weights, and keep=2 pruned the good ones."""
    task = rk.tasks.arithmetic(digits=2, n_train=8, n_test=2)
    model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1)
    state = rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)
    saver = rk.Checkpointer(tmp_path, every=1, keep=2, save_on_sigterm=False)
    recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=2)
    state, _ = rk.fit(state, recipe, task.reward, task.train, steps=1, batch_size=2, checkpointer=saver)
    with torch.no_grad():
        state.actor.lm_head.weight[0, 0] = float("inf")  # what the overflowing step left
    with pytest.raises(ck.CheckpointError, match=r"not saving step 2: the actor has 1 non-finite weight\(s\).*The newest "
                                                 r"good checkpoint, .*step_000001, is kept \(keep=2 would have pruned it\)"):
        saver.save(state.replace(step=2))
    assert [p.name for _, p in ck.list_checkpoints(tmp_path)] == ["step_000001"]
    ck.save(state, tmp_path / "direct")  # rlkit.checkpoint.save itself writes what it is given
