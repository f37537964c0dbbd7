"""Long-run defects: Ctrl-C inside a checkpoint's tensor write, half-deleted pruned checkpoints
that the same Checkpointer kept, the epoch order rebuilt every step, the notebook Dashboard
drawing in a plain process, and ConsoleSink (a second fit's total; silent in a log file).

Fast: a linear "model" stands in for a language model (what is checked is the bookkeeping)."""
import io
import os
import re
import shutil
import types

import pytest
import torch

import rlkit as rk
from rlkit import checkpoint as ck
from rlkit.data import PromptSet


def _state(seed=0):
    torch.manual_seed(seed)
    return rk.init(torch.nn.Linear(4, 3), rk.optim.adamw(lr=1e-2), seed=7)


# ----------------------------------------------------------------- 1: Ctrl-C inside a tensor write
def _interrupt_inside_tensor_writes(monkeypatch, exc: BaseException) -> None:
    """``exc`` raised from the file write under torch.save's zip writer, as a Ctrl-C (a SIGINT
    handler's KeyboardInterrupt) lands there: torch's writer then fails in its __exit__ with
    ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos`` whose context is the
    interrupt, and DCP wraps that in a CheckpointException."""
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint.planner import WriteItemType

    original = fs._StorageWriterTransforms.transform_save_stream

    class Interrupting:
        def __init__(self, inner):
            self.inner, self.writes = inner, 0

        def write(self, b):
            self.writes += 1
            if self.writes == 2:
                raise exc
            return self.inner.write(b)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def patched(self, item, raw):
        stream, desc = original(self, item, raw)
        return (stream, desc) if item.type == WriteItemType.BYTE_IO else (Interrupting(stream), desc)

    monkeypatch.setattr(fs._StorageWriterTransforms, "transform_save_stream", patched)


def test_ctrl_c_inside_a_tensor_write_reaches_the_caller_as_keyboard_interrupt(tmp_path, monkeypatch):
    saver = ck.Checkpointer(tmp_path, save_on_sigterm=False)
    saver.save(_state().replace(step=1))
    _interrupt_inside_tensor_writes(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt) as info:
        saver.save(_state().replace(step=2))
    # torch's own error stays in the chain for whoever wants it
    assert "unexpected pos" in repr(info.value.__cause__) or "CheckpointException" in type(info.value.__cause__).__name__
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]  # the partial save is gone
    monkeypatch.undo()
    assert saver.save(_state().replace(step=2)).name == "step_000002"


def test_an_exit_inside_a_tensor_write_keeps_its_exit_status(tmp_path, monkeypatch):
    """A SIGTERM handler that exits (SystemExit(143), as rlkit's Preempted) while a tensor is
    written reached the caller as DCP's CheckpointException."""
    _interrupt_inside_tensor_writes(monkeypatch, SystemExit(143))
    with pytest.raises(SystemExit) as info:
        ck.save(_state().replace(step=1), tmp_path)
    assert info.value.code == 143
    assert list(tmp_path.iterdir()) == []


def test_interrupts_are_found_deep_in_the_chain_and_cycles_end():
    from torch.distributed.checkpoint.api import CheckpointException

    def failure(top):
        return CheckpointException("save failed", {0: (top, None)})

    inner = ValueError("inner")
    inner.__context__ = KeyboardInterrupt()
    top = RuntimeError("unexpected pos")
    top.__cause__ = OSError("writer")
    top.__cause__.__context__ = inner
    with pytest.raises(KeyboardInterrupt):
        with ck._interrupts_unwrapped():
            raise failure(top)
    # a cycle without an interrupt: the original error, not a hang
    a, b = RuntimeError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    with pytest.raises(CheckpointException):
        with ck._interrupts_unwrapped():
            raise failure(a)
    with pytest.raises(ValueError, match="b"):
        with ck._interrupts_unwrapped():
            raise b


# ----------------------------------------------------------------- 2: half-deleted pruned checkpoints
def test_a_pruned_checkpoint_whose_deletion_was_interrupted_goes_at_the_next_save(tmp_path, monkeypatch):
    saver = ck.Checkpointer(tmp_path, keep=2, save_on_sigterm=False)
    real = shutil.rmtree
    armed = [True]

    def interrupted_rmtree(path, *a, **k):
        if armed[0] and ".old-" in os.fspath(path):
            armed[0] = False
            os.remove(os.path.join(path, "meta.json"))  # part of it is deleted already
            raise KeyboardInterrupt
        return real(path, *a, **k)

    monkeypatch.setattr(ck.shutil, "rmtree", interrupted_rmtree)
    state = _state()
    saver.save(state.replace(step=1))
    saver.save(state.replace(step=2))
    with pytest.raises(KeyboardInterrupt):
        saver.save(state.replace(step=3))  # complete; pruning step 1 was interrupted
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[:1] and names[0].startswith("step_000001.old-") and names[1:] == ["step_000002", "step_000003"]
    saver.save(state.replace(step=4))  # the same Checkpointer, as rk.fit(e.state, ..., checkpointer=ckpt) goes on
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004"]


def test_the_sweep_keeps_what_another_process_may_still_need(tmp_path):
    """A complete step_k.old-* with no step_k may be the one good checkpoint of a save another
    process is swapping in (it puts it back if its rename fails); a *.tmp-* may be a save in
    progress. A marker-less .old-*, or one whose step is in place, is garbage."""
    saver = ck.Checkpointer(tmp_path, save_on_sigterm=False)
    state = _state()
    saver.save(state.replace(step=1))
    saver.save(state.replace(step=2))
    shutil.copytree(tmp_path / "step_000001", tmp_path / "step_000001.old-0123abcd")  # its step is in place
    os.replace(tmp_path / "step_000002", tmp_path / "step_000002.old-89abcdef")  # mid-swap elsewhere: kept
    shutil.copytree(tmp_path / "step_000002.old-89abcdef", tmp_path / "step_000000.old-00aa11bb")
    os.remove(tmp_path / "step_000000.old-00aa11bb" / ck.MARKER)  # half deleted: garbage
    os.makedirs(tmp_path / "step_000005.tmp-0123456789ab")  # someone's save in progress: kept
    saver.save(state.replace(step=3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000001", "step_000002.old-89abcdef", "step_000003", "step_000005.tmp-0123456789ab"]


# ----------------------------------------------------------------- 3: the epoch order, once per epoch
def _old_batch_at(ps, position, batch_size, seed, shuffle):
    """PromptSet.batch_at as it was: the epoch's order rebuilt at every call."""
    epoch, k = divmod(position, len(ps) // batch_size)
    if shuffle:
        g = torch.Generator().manual_seed(hash((seed, epoch)) & 0x7FFFFFFF)
        order = torch.randperm(len(ps), generator=g).tolist()
    else:
        order = list(range(len(ps)))
    return ps.take(order[k * batch_size : (k + 1) * batch_size])


def test_batch_at_orders_are_unchanged_and_the_permutation_is_built_once_per_epoch(monkeypatch):
    n, batch_size = 50, 8  # 6 batches an epoch, 2 prompts dropped
    ps = PromptSet([f"p{i}" for i in range(n)], [[i % 7 + 1] for i in range(n)], {"answer": [str(i) for i in range(n)]})
    expected = {(seed, shuffle, pos): _old_batch_at(ps, pos, batch_size, seed, shuffle)
                for seed in (0, 1, 12345) for shuffle in (True, False) for pos in range(20)}
    calls = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a) or real(*a, **k))
    for seed in (0, 1, 12345):
        for shuffle in (True, False):
            for pos in range(20):  # 4 epochs (the last one partly)
                assert ps.batch_at(pos, batch_size, seed=seed, shuffle=shuffle) == expected[(seed, shuffle, pos)], (seed, shuffle, pos)
    assert len(calls) == 3 * 4  # once per (seed, epoch), shuffled only
    assert ps.order(2, 1) == ps.order(2, 1) and sorted(ps.order(2, 1)) == list(range(n))
    # a changed prompt set is not served a stale order
    ps.ids.append([1]), ps.text.append("p50"), ps.columns["answer"].append("50")
    assert sorted(x for pos in range(3) for x in ps.batch_at(pos, 17, seed=0).columns["answer"]) == sorted(map(str, range(51)))


# ----------------------------------------------------------------- 4: Dashboard outside a notebook
def test_dashboard_in_a_plain_process_draws_and_prints_nothing(capsys, monkeypatch):
    from rlkit.observe.notebook import Dashboard

    drawn = []
    monkeypatch.setattr(Dashboard, "plot", lambda self, keys=None: drawn.append(1))
    board = Dashboard(total=5)
    for step in range(1, 6):
        board.on_step(step, {"reward/mean": step / 5})
    assert board._widgets is None and drawn == []
    assert capsys.readouterr().out == ""
    assert [row["step"] for row in board.history] == [1, 2, 3, 4, 5] and board.latest == {"reward/mean": 1.0}


def test_dashboard_in_a_kernel_shows_its_widgets(monkeypatch):
    pytest.importorskip("ipywidgets")
    IPython = pytest.importorskip("IPython")
    import IPython.display

    import matplotlib.pyplot as plt

    from rlkit.observe.notebook import Dashboard

    shown = []
    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(kernel=object()))
    monkeypatch.setattr(IPython.display, "display", lambda *objs: shown.extend(objs))
    board = Dashboard(total=2, keys=("reward/mean",))
    assert board._widgets is not None and shown == [board._widgets]
    drawn = []  # no real figure: pyplot would hook into the fake shell
    monkeypatch.setattr(Dashboard, "plot", lambda self, keys=None: drawn.append(1) or "figure")
    monkeypatch.setattr(plt, "show", lambda *a, **k: None)
    monkeypatch.setattr(plt, "close", lambda *a, **k: None)
    board.on_step(2, {"reward/mean": 0.5})
    assert board._bar.value == 2 and "reward/mean: 0.5" in board._text.value and drawn == [1]


# ----------------------------------------------------------------- 5: ConsoleSink
def _file_console(width=120):
    from rich.console import Console

    out = io.StringIO()
    return out, Console(file=out, width=width, force_terminal=False)


def test_console_sink_watching_a_second_fit_moves_its_total():
    from rlkit.observe.console import ConsoleSink

    out, console = _file_console()
    bar = ConsoleSink(10, console=console)
    for step in range(1, 26):  # fit(steps=10), then fit(steps=25) with the same sink
        bar.on_step(step, {"reward/mean": 0.5})
    task = bar.progress.tasks[0]
    assert (task.completed, task.total) == (25, 25)
    bar.close()
    assert "25/25" in out.getvalue() and "25/10" not in out.getvalue()


def _count(line):
    return re.search(r"\b\d+/(\d+|\?)", line).group(0)


def test_console_sink_prints_records_when_the_console_is_not_a_terminal(monkeypatch):
    import rlkit.observe.console as console_mod
    from rlkit.observe.console import ConsoleSink

    clock = [100.0]
    monkeypatch.setattr(console_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    out, console = _file_console()
    bar = ConsoleSink(6, "RL (grpo)", console=console)  # default: at most every 30 s
    for step, dt in zip(range(1, 7), (0, 10, 10, 15, 1, 1)):
        clock[0] += dt
        bar.on_step(step, {"reward/mean": step / 10, "eval/accuracy": 0.25})
    lines = out.getvalue().splitlines()  # before close: the log is not silent
    assert [_count(line) for line in lines] == ["1/6", "4/6", "6/6"], out.getvalue()  # first, +35 s, last
    assert "reward=0.4" in lines[1].split() and "acc=0.25" in lines[1].split()
    bar.close()
    assert out.getvalue().splitlines() == lines  # the last record showed the end: not printed twice

    out, console = _file_console()
    bar = ConsoleSink(None, console=console, log_every_s=0)
    for step in (1, 2, 3):
        bar.on_step(step, {"reward/mean": 0.5})
    assert [_count(line) for line in out.getvalue().splitlines()] == ["1/?", "2/?", "3/?"]
    bar.close()


def test_console_sink_on_a_terminal_keeps_the_live_bar_alone():
    from rich.console import Console

    from rlkit.observe.console import ConsoleSink

    bar = ConsoleSink(3, console=Console(file=io.StringIO(), width=120, force_terminal=True), log_every_s=0)
    bar.on_step(1, {"reward/mean": 0.5})
    assert not bar._records and bar._recorded is None
    bar.close()
    with pytest.raises(ValueError, match="log_every_s"):
        ConsoleSink(3, console=Console(file=io.StringIO()), log_every_s=-1)


def test_a_dcp_read_failure_is_reported_as_a_corrupt_checkpoint(tmp_path, monkeypatch):
    # DCP wraps a read failure in CheckpointException, a BaseException in torch 2.13: load's
    # `except Exception` let it through raw, past resume("auto")'s fallback to older checkpoints
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = ck.save(_state(), tmp_path)
    real_load = dcp.load

    def failing_load(*args, **kwargs):
        raise CheckpointException("read", {0: (ValueError("bad tensor"), None)})

    monkeypatch.setattr(dcp, "load", failing_load)
    with pytest.raises(ck.CheckpointCorruptError, match="(?s)cannot read the trainer state .*bad tensor"):
        ck.load(_state(seed=1), path)
    calls = []

    def failing_second_load(*args, **kwargs):  # the trainer state reads; the tensors fail
        calls.append(1)
        if len(calls) > 1:
            raise CheckpointException("read", {0: (ValueError("bad tensor"), None)})
        return real_load(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", failing_second_load)
    with pytest.raises(ck.CheckpointCorruptError, match="(?s)reading the tensors failed .*bad tensor"):
        ck.load(_state(seed=1), path)
