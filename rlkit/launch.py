"""Start a job on many processes with torch.distributed.elastic (the engine behind torchrun).

From Python or a notebook::

    def train(steps):
        rk.parallel.init_distributed()
        for step in range(steps):
            ...
            rk.launch.emit({"step": step, "loss": loss})   # streams back to the caller
        return final_metrics                               # rank 0's value is returned

    result = rlkit.launch(train, 100, nproc_per_node=2, on_metrics=lambda rank, m: print(rank, m))

Or the notebook's own plan and state, trained on the workers and brought back (:mod:`rlkit.launch_fit`)::

    state, history = rlkit.launch(plan, state, task.train, steps=100, batch_size=16, nproc_per_node=2)

``fn`` is shipped to the workers with cloudpickle through a module-level trampoline, so
functions and closures defined in a notebook's ``__main__`` work; workers start with the
``spawn`` method (safe inside Jupyter). Names the caller registered (an advantage estimator or
policy loss registered in a notebook cell, a recipe added to ``rk.recipes.RECIPES``) travel with
``fn`` and are registered in each worker before it runs. Each worker appends its metrics as JSON lines to
``<run_dir>/metrics/rank<R>.jsonl``; a thread in the caller tails those files and calls
``on_metrics(rank, metrics)`` as lines arrive (default: print them). Worker stdout/stderr are
echoed to the caller too, prefixed with the local rank. A worker's exception comes back as a
:class:`WorkerError` carrying the worker's traceback text (kept in ``<run_dir>/errors/rank<R>.txt``
too), which torch elastic's own log of the failure no longer prints a second time on the caller's
stderr (it still does with ``max_restarts > 0``, where a recovered failure raises nothing). When ``fn`` returns with a process
group still initialised, the trampoline runs a barrier and destroys it; a rank that waited
:data:`TEARDOWN_WAIT_S` there for a rank still in ``fn`` calls the barrier off instead (see
:func:`_teardown_process_group`), so a collective only some ranks call fails, not hangs.

From the shell: ``rlkit launch --nproc-per-node N [--nnodes M --rdzv-endpoint HOST:PORT] script.py
args...`` is torchrun (``torch.distributed.run``) with two defaults: ``--standalone`` for a
single node without an endpoint, and ``--rdzv-backend c10d`` when an endpoint is given.
"""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import numbers
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import Any, Callable

from rlkit._checks import int_at_least

RUN_DIR_ENV = "RLKIT_RUN_DIR"

#: on_metrics(rank, metrics)
MetricsCallback = Callable[[int, dict], None]


#: the signals torch elastic handles while a launch runs (their handlers are restored after it)
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name))


class Terminated(SystemExit):
    """The launch was stopped by SIGTERM (exit status 143, as one process's); its workers were
    stopped with it (a :class:`rlkit.checkpoint.Checkpointer` in them saves first)."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


class WorkerError(RuntimeError):
    """A worker process failed. ``rank``: the first failing global rank; ``worker_traceback``: its traceback text.

    ``exception_types``: the qualified names of the class of that rank's Python exception and of its
    bases (``"rlkit.checkpoint.CheckpointMismatchError"``, ..., ``"builtins.ValueError"``), empty
    when it failed without one (a signal, a bare exit); ``exception_message``: its ``str()``, the
    text one process would have shown. They let a caller treat a worker's error as it treats the
    same error raised in its own process (``rlkit run`` reports a ``ValueError`` as bad input, exit
    status 2) without unpickling the exception, which fails for many exception classes.
    ``run_dir``: the launch's directory; ``errors/rank<R>.txt`` there keeps each failed rank's
    traceback (:attr:`traceback_file`).
    """

    def __init__(self, rank: int, worker_traceback: str, failures: dict[int, str] | None = None, summary: str | None = None,
                 *, exception_types: tuple[str, ...] = (), exception_message: str | None = None, run_dir: str | None = None):
        self.rank = rank
        self.worker_traceback = worker_traceback
        self.failures = failures or {rank: worker_traceback}
        self.exception_types = tuple(exception_types)
        self.exception_message = exception_message
        self.run_dir = run_dir
        others = sorted(r for r in self.failures if r != rank)
        also = f" (ranks {others} failed too)" if others else ""
        # ``summary`` replaces the first line when "failed" alone would not say what went wrong
        super().__init__(f"{summary or f'worker rank {rank} failed{also}'}; its traceback:\n{worker_traceback}")

    @property
    def traceback_file(self) -> str | None:
        """The file that keeps :attr:`rank`'s traceback (``<run_dir>/errors/rank<R>.txt``), or None
        when the rank left none (it died without a Python exception)."""
        if self.run_dir is None:
            return None
        path = os.path.join(self.run_dir, "errors", f"rank{self.rank}.txt")
        return path if os.path.isfile(path) else None


# ---------------------------------------------------------------------------------------------
# worker side


def _jsonable(value: Any, strict: bool = True) -> Any:
    """``value`` as plain JSON values: tensors and numpy scalars become numbers or lists, anything
    else unknown its ``str()``. ``strict``: a non-finite float becomes its text (``"nan"``), which
    strict JSON readers accept; without it, it stays a float, which Python's ``json`` writes as
    ``NaN`` / ``Infinity`` and reads back as the same float (what :func:`emit` uses: see there)."""
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) or not strict else str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v, strict) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, strict) for v in value]
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:  # torch / numpy scalars
        return _jsonable(value.item(), strict)
    if hasattr(value, "tolist"):
        return _jsonable(value.tolist(), strict)
    return str(value)


def emit(metrics: dict, **more: Any) -> None:
    """Send ``metrics`` (a flat dict of numbers/strings; tensors become numbers) to the launching process.

    Inside a :func:`launch` worker it appends one JSON line to this rank's metrics file, which the
    caller streams to ``on_metrics``. Outside a launch it does nothing, so the same training
    function runs unchanged in a plain notebook cell.

    A NaN or infinite number reaches ``on_metrics`` as that float: the line is Python's JSON
    (``NaN``, ``Infinity``), read back only by the caller's ``json.loads``. It used to be written as
    the string ``"nan"`` for strict JSON, so a diverged loss reached ``on_metrics`` as text (and
    ``f"{loss:.3f}"`` failed there), indistinguishable from a text metric that reads "nan".
    """
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    rank = int(os.environ.get("RANK", "0"))
    record = _jsonable({**metrics, **more}, strict=False)
    path = os.path.join(run_dir, "metrics", f"rank{rank}.jsonl")
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _own_session() -> None:
    """Detach this worker from the caller's process group and session, as torchrun's workers are.

    rk.launch's workers used to share the caller's process group, so a signal sent to the whole
    group (``timeout``, ``kill -TERM -PGID``, Jupyter stopping its kernel with ``os.killpg``, the
    terminal's Ctrl-C) reached each worker twice: directly, and forwarded by torch elastic. A
    :class:`rlkit.checkpoint.Checkpointer` takes a second SIGTERM as "exit at once", so the worker
    died without saving. In their own session the workers get signals only through the launcher.
    (A launcher that dies outright still stops them: torch's spawn asks Linux for a SIGINT to each
    worker when its parent ends, which :func:`_on_sigint` handles.)"""
    try:
        os.setsid()
    except OSError:  # a session leader already
        pass


def _on_sigint(signum, frame) -> None:
    """A worker's SIGINT (torch elastic forwards the launcher's Ctrl-C / notebook interrupt as
    SIGINT, and Linux sends one when the launcher dies): the graceful stop a SIGTERM gets when
    ``fn`` handles SIGTERM (a :class:`rlkit.checkpoint.Checkpointer` armed in ``rk.fit`` saves at
    the next step boundary, and a second interrupt exits at once); ``KeyboardInterrupt``, as
    before, when it does not."""
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        handler(signal.SIGTERM, frame)
        return
    raise KeyboardInterrupt


def _worker(payload: bytes, run_dir: str) -> tuple[int, bytes | None]:
    """Trampoline run in every worker: unpickle ``(fn, args, kwargs)`` and the caller's own registry
    entries (:func:`_user_registrations`), register those, run ``fn``, report: ``(rank, pickled
    result)`` on global rank 0, ``(rank, None)`` elsewhere (launch returns rank 0's value only; every
    rank used to pickle its own, so a value no rank could pickle was blamed on whichever rank
    torch elastic saw fail first, with no traceback at all)."""
    _own_session()  # first: until then a signal to the caller's group reaches this process too
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
    import cloudpickle

    os.environ[RUN_DIR_ENV] = run_dir
    rank = int(os.environ.get("RANK", "0"))
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # Without this every worker starts one thread per core and they oversubscribe the CPU.
        local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    # this worker's pid, and a marker once Python leaves fn by any road (a return, an exception,
    # sys.exit): the caller's watchdog (_Tail.check_workers) tells from them a process that ended
    # without either, e.g. os._exit(0) inside fn, which torch elastic would wait on forever
    marker = os.path.join(run_dir, "workers", f"rank{rank}")
    for stale in (".done", ".exit", ".left"):  # the markers of this rank's worker of an attempt before a restart
        if os.path.exists(marker + stale):
            os.remove(marker + stale)
    # and its error files: the second attempt's rank killed by SIGKILL was reported with the first
    # attempt's traceback. Each rank clears only its own, before fn runs; torch elastic starts an
    # attempt's workers only once every worker of the one before has stopped, so none writes after
    for stale in (".txt", ".json"):
        path = os.path.join(run_dir, "errors", f"rank{rank}{stale}")
        if os.path.exists(path):
            os.remove(path)
    _write_atomic(marker + ".pid", f"{socket.gethostname()} {os.getpid()}")
    real_exit = os._exit
    os._exit = _noting_exit(real_exit, marker)
    try:
        try:
            fn, args, kwargs, registrations = cloudpickle.loads(payload)
            _restore_registrations(registrations)
            result = fn(*args, **kwargs)
            waiting = _teardown_process_group()
            if waiting:
                # the caller's watchdog and _worker_error name this rank as one that left its peers
                _write_atomic(marker + ".left", " ".join(map(str, waiting)))
            # in the try: a value that cannot be pickled is reported with its traceback, as fn's own
            # error; it used to fail outside it, "exited with code 1 without a Python traceback"
            pickled = _pickled_result(result) if rank == 0 else None
        except BaseException as exc:
            # the record first: a rank whose traceback file exists (what _worker_error picks the root
            # cause from) then always has it, even if torch elastic stops this process between the two
            _write_atomic(os.path.join(run_dir, "errors", f"rank{rank}.json"), _exception_record(exc))
            _write_atomic(os.path.join(run_dir, "errors", f"rank{rank}.txt"), traceback.format_exc())
            _close_after_error()
            raise
        return rank, pickled
    finally:
        os._exit = real_exit
        _write_atomic(marker + ".done", "")


def _close_after_error() -> None:
    """Destroy the process group ``fn`` left open when it raised (no barrier: a peer may be inside
    a collective this rank will never join; it then fails with a connection error at once). Left to
    interpreter exit, a gloo group with a DeviceMesh sub-group aborted the process now and then under
    CPU load ("terminate called without an active exception", "Fatal Python error: Aborted"), and
    that text went to the terminal under ``rlkit run``'s one-line error."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from rlkit.parallel.mesh import shutdown

            shutdown(wait=False)
    except Exception:  # noqa: BLE001 - the worker's own error is the one to report
        pass


def _exception_record(exc: BaseException) -> str:
    """JSON of what the caller needs to classify a worker's exception without unpickling it: the
    qualified names of its class and bases (WorkerError.exception_types) and its message."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the worker's own error
        message = f"{type(exc).__name__} (its message could not be formatted)"
    types = [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__]
    return json.dumps({"types": types, "message": message})


def _noting_exit(real_exit: Callable[[int], None], marker: str) -> Callable[[int], None]:
    """``os._exit`` for the time ``fn`` runs: it writes ``<marker>.exit`` (this process's pid and the
    status) before the process ends. torch elastic waits forever for the result of a worker that
    ended with status 0 without one; with ``max_restarts > 0`` the caller cannot tell such a worker
    from one torch elastic stopped to restart the group, except by this note (see
    :meth:`_Tail._watch`). Only this process writes it: a child forked inside ``fn`` (a
    DataLoader worker) inherits the function and ends through it."""
    owner = os.getpid()

    def _exit(status: int) -> None:
        if os.getpid() == owner:
            try:
                _write_atomic(marker + ".exit", f"{owner} {int(status)}")
            except Exception:  # noqa: BLE001 - the exit itself must happen
                pass
        real_exit(status)

    return _exit


#: plain ``name -> factory`` tables that rlkit resolves names through (``rk.recipes.get("grpo")``,
#: ``rk.tasks.get``), shipped to the workers whole: a worker imports them afresh, without the
#: entries a notebook added (rlkit's own travel by reference, so they stay the same objects)
_NAME_TABLES = (("rlkit.recipes", "RECIPES"), ("rlkit.tasks", "TASKS"))


def _user_registrations() -> list[tuple[str, str, str, Any]]:
    """``(module, table, name, value)`` for the names registered in this process that a fresh worker
    would not know: the entries user code added to rlkit's registries (advantage estimators,
    policy losses, aggregations, KL penalties; :func:`rlkit.algos.registry.user_registrations`),
    and the entries of :data:`_NAME_TABLES` whose module is loaded here. Without them a name
    registered in a notebook failed in the workers ("unknown advantage estimator 'median'")."""
    from rlkit.algos.registry import user_registrations

    entries = list(user_registrations())
    for module, table in _NAME_TABLES:
        loaded = sys.modules.get(module)
        names = getattr(loaded, table, None) if loaded is not None else None
        if isinstance(names, dict):
            entries.extend((module, table, name, value) for name, value in names.items())
    return entries


def _picklable(entries: list[tuple[str, str, str, Any]]) -> list[tuple[str, str, str, Any]]:
    """``entries`` less those cloudpickle cannot pickle, each named in a warning: an entry the
    launched function never uses must not stop the launch, and one it uses fails in the worker as
    an unknown name, which the warning has explained."""
    import warnings

    import cloudpickle

    kept = []
    for entry in entries:
        module, table, name, value = entry
        try:
            cloudpickle.dumps(value)
        except Exception as e:
            what = f"{module}.{table}[{name!r}]" if (module, table) in _NAME_TABLES else f"{table} {name!r}"
            warnings.warn(
                f"launch: {what}, registered in this process, cannot be pickled for the workers "
                f"({type(e).__name__}: {e}); the workers will not know the name {name!r}. Define it in an importable "
                "module, or keep what it refers to picklable (no open files, locks or live connections)",
                stacklevel=3,
            )
            continue
        kept.append(entry)
    return kept


def _restore_registrations(entries: list[tuple[str, str, str, Any]]) -> None:
    """In a worker: register the caller's entries (:func:`_user_registrations`), replacing what
    their names hold, before ``fn`` runs."""
    import importlib

    from rlkit.algos.registry import restore_registrations

    restore_registrations([e for e in entries if e[:2] not in _NAME_TABLES])
    for module, table, name, value in entries:
        if (module, table) in _NAME_TABLES:
            names = getattr(importlib.import_module(module), table)
            if names.get(name) is not value:
                names[name] = value


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


#: how :func:`_pickled_result`'s error begins (_worker_error makes it the WorkerError's first line)
_UNPICKLABLE = "rank 0's return value cannot be pickled"


def _pickled_result(result: Any) -> bytes:
    """Rank 0's return value, pickled for the caller; a ``TypeError`` naming the problem and the
    fix when cloudpickle cannot (a lock, a generator, an open file inside it)."""
    import cloudpickle

    try:
        return cloudpickle.dumps(result)
    except Exception as e:
        raise TypeError(f"{_UNPICKLABLE}: {type(e).__name__}: {e}; return tensors/numbers/dicts "
                        "of them, or save it to a file and return its path") from e


#: seconds a rank that returned from ``fn`` waits at the closing barrier for the ranks still
#: running before it leaves without it (:func:`_teardown_process_group`); ``RLKIT_TEARDOWN_WAIT_S``
#: in the environment (the caller's, which the workers inherit) overrides it
TEARDOWN_WAIT_S = 30.0
TEARDOWN_WAIT_ENV = "RLKIT_TEARDOWN_WAIT_S"


def _teardown_wait_s(strict: bool = True) -> float:
    """:data:`TEARDOWN_WAIT_S`, or ``RLKIT_TEARDOWN_WAIT_S`` when set; for one that is not a number
    >= 0, a ``ValueError`` naming the variable (launch checks it before any worker starts), or
    with ``strict=False`` the default."""
    text = os.environ.get(TEARDOWN_WAIT_ENV)
    if text is None:
        return TEARDOWN_WAIT_S
    try:
        wait = float(text)
    except ValueError:
        wait = math.nan
    if not (wait >= 0 and math.isfinite(wait)):
        if not strict:
            return TEARDOWN_WAIT_S
        raise ValueError(f"launch: {TEARDOWN_WAIT_ENV}={text!r} in the environment; give the seconds a rank that returned "
                         f"from fn waits for the others at the closing barrier, a number >= 0 (default {TEARDOWN_WAIT_S:g}), "
                         "or unset it")
    return wait


def _teardown_process_group() -> list[int]:
    """Close the process group ``fn`` left open; the global ranks this rank left behind, still
    inside ``fn`` (none when every rank reached this point in time).

    When every rank returns from ``fn`` within :data:`TEARDOWN_WAIT_S` of the first, as usual: a
    barrier, then the group is destroyed (:func:`rlkit.parallel.mesh.shutdown`). The barrier is a
    collective, and a rank that returned while another still waited in a collective of its own
    (``if rank == 0: dist.all_reduce(t)``, an ordinary bug) sat in it silently until the
    collective timeout (30 minutes by default), and so did its peer. So the ranks first meet
    through the process group's store, which no collective can block; once a rank has waited there
    :data:`TEARDOWN_WAIT_S` in vain, the barrier is called off and each rank destroys its group on
    its own: a peer blocked in a collective then fails at once with a connection error on gloo
    (launch reports it, naming the ranks that left it), and a peer that was only busy alone
    (evaluating, saving) finishes unharmed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    from rlkit.parallel.mesh import shutdown

    missing = None
    try:
        store = dist.distributed_c10d._get_default_store()
        if dist.get_world_size() > 1:
            # checked by launch; a bad value set inside fn gets the default
            missing = _meet_at_teardown(store, dist.get_rank(), dist.get_world_size(), _teardown_wait_s(strict=False))
    except Exception:  # noqa: BLE001 - a group whose store lacks add / compare_set: the plain barrier, as before
        missing = None
    shutdown(wait=missing is None)
    return missing or []


def _meet_at_teardown(store, rank: int, world: int, wait_s: float) -> list[int] | None:
    """The ranks' meeting before the closing barrier, through ``store``: None when the barrier is to
    be run (every rank arrived in time), else the ranks that had not arrived when it was called off
    (maybe none, for a rank that arrives after that). Whichever comes first, "all arrived" (the
    last rank to arrive) or "waited too long" (the first rank whose wait ran out), sets the
    decision key (``compare_set`` sets it only once), so every rank takes the same road."""
    prefix = f"rlkit/teardown/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{prefix}rank{rank}", "1")
    decided = prefix + "decided"
    if store.add(prefix + "arrived", 1) >= world:
        decision = store.compare_set(decided, "", "barrier")
    else:
        deadline = time.monotonic() + wait_s
        pause = 0.01
        while not store.check([decided]) and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        decision = store.compare_set(decided, "", "leave")
    if decision == b"barrier":
        return None
    return [r for r in range(world) if not store.check([f"{prefix}rank{r}"])] if world <= 1024 else []


# ---------------------------------------------------------------------------------------------
# caller side


class _Tail(threading.Thread):
    """Follows the metrics and log files of a run and hands complete lines on as they appear."""

    def __init__(self, run_dir: str, on_metrics: MetricsCallback, echo_logs: bool, interval: float = 0.1, watch: bool = True):
        super().__init__(daemon=True, name="rlkit-launch-tail")
        self.run_dir = run_dir
        self.on_metrics = on_metrics
        self.echo_logs = echo_logs
        self.interval = interval
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, str] = {}
        self._stop_event = threading.Event()
        self.callback_error: BaseException | None = None
        #: global ranks of this machine whose process ended without leaving fn (see check_workers)
        self.vanished: list[int] = []
        self._checked = 0.0
        self._watch_enabled = watch
        self._gone_since: dict[int, float] = {}
        self._left_warned = False
        if echo_logs:
            # a reused run_dir keeps earlier runs' logs (each run writes its own subfolder): follow
            # them from their end, or this run echoed every earlier run's output before its own
            for path in self._log_files():
                self._offsets[path] = os.path.getsize(path)

    def _log_files(self) -> list[str]:
        return sorted(glob.glob(os.path.join(self.run_dir, "logs", "**", "std*.log"), recursive=True))

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.poll()
        self.poll()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)

    def _new_lines(self, path: str) -> list[str]:
        try:
            with open(path, "r", encoding="utf-8", errors="replace") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
                self._offsets[path] = f.tell()
        except FileNotFoundError:
            return []
        if not data:
            return []
        data = self._partial.pop(path, "") + data
        lines = data.split("\n")
        if lines[-1]:
            self._partial[path] = lines[-1]
        return lines[:-1]

    def check_workers(self) -> list[int]:
        """Global ranks on this machine whose process is gone (or a zombie) without the marker a
        worker writes when Python leaves ``fn`` by any road: ``os._exit(0)`` inside ``fn``, say.
        torch elastic counts on a return value from every worker and would poll forever for it."""
        return sorted(rank for rank, pid in _unfinished_workers(self.run_dir) if not _alive(pid))

    #: seconds a worker must stay gone without its marker before the launch is stopped: a worker
    #: that failed (an exception, a signal, OOM) is torch elastic's to report, within its monitor
    #: interval (a tenth of a second); only one it never notices (exit status 0) outlasts this
    VANISHED_AFTER_S = 3.0

    def _watch(self) -> None:
        """Once a second: a worker that vanished ends the launch. The caller's thread waits inside
        torch elastic, which stops its workers and returns on SIGTERM (its own handler); without
        that handler (a launch outside the main thread) nothing is sent. With ``max_restarts > 0``
        only the workers that ended through ``os._exit(0)`` (noted by :func:`_noting_exit`) count:
        a restart stops the surviving workers with SIGTERM, before they leave fn, and a process
        gone without its marker would look vanished."""
        now = time.monotonic()
        if self.vanished or now - self._checked < 1.0:
            return
        self._checked = now
        # os._exit(0) called from Python inside fn leaves a note (_noting_exit): certain, restarts or not
        gone = sorted(rank for rank, pid in _exited_with_0(self.run_dir) if not _alive(pid))
        if not gone and self._watch_enabled:
            current = set(self.check_workers())
            self._gone_since = {r: self._gone_since.get(r, now) for r in current}
            gone = sorted(r for r, since in self._gone_since.items() if now - since >= self.VANISHED_AFTER_S)
        if gone:
            self.vanished = gone
            handler = signal.getsignal(signal.SIGTERM)
            if callable(handler) and getattr(handler, "__module__", "").startswith("torch.distributed.elastic"):
                os.kill(os.getpid(), signal.SIGTERM)
        self._warn_left()

    #: seconds after a rank left the closing barrier (:func:`_teardown_process_group`) with ranks
    #: still running before the caller says so, once: a gloo peer blocked in a collective fails
    #: within them, and launch then reports that instead
    LEFT_WARN_AFTER_S = 5.0

    def _warn_left(self) -> None:
        """One warning on stderr when ranks returned from ``fn`` and left without the closing
        barrier while others still run: harmless if those are busy alone, a hang until the
        collective timeout if they wait in a collective the finished ranks never join (on NCCL,
        which may not notice a peer that left; gloo fails at once, and launch reports that)."""
        if self._left_warned:
            return
        left = _left_markers(self.run_dir)
        try:
            since = min(os.path.getmtime(p) for p in left.values()) if left else None
        except OSError:
            return
        if since is None or time.time() - since < self.LEFT_WARN_AFTER_S:
            return
        running = sorted(rank for rank in _started_ranks(self.run_dir)
                         if rank not in left and not os.path.exists(os.path.join(self.run_dir, "workers", f"rank{rank}.done")))
        if not running:
            return
        self._left_warned = True
        wait = _teardown_wait_s(strict=False)
        print(f"launch: warning: rank(s) {sorted(left)} returned from fn and waited {wait:g} s at the closing barrier for "
              f"rank(s) {running}, still running; they left without it. If those ranks wait in a collective the finished "
              "ranks never called (one called on some ranks only, e.g. under `if rank == 0:`), the job hangs until the "
              "collective timeout (init_distributed(timeout=...); 30 min by default); if they are working alone (evaluating, "
              f"saving), nothing is wrong. ({TEARDOWN_WAIT_ENV} sets the wait)", file=sys.stderr, flush=True)

    def poll(self) -> None:
        self._watch()
        for path in sorted(glob.glob(os.path.join(self.run_dir, "metrics", "rank*.jsonl"))):
            rank = int(re.search(r"rank(\d+)\.jsonl$", path).group(1))
            for line in self._new_lines(path):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                try:
                    self.on_metrics(rank, record)
                except BaseException as e:  # a broken callback must not kill the run; report it at the end
                    if self.callback_error is None:
                        self.callback_error = e
        if self.echo_logs:
            for path in self._log_files():
                local_rank = os.path.basename(os.path.dirname(path))
                stream = sys.stderr if path.endswith("stderr.log") else sys.stdout
                for line in self._new_lines(path):
                    print(f"[{local_rank}] {line}", file=stream, flush=True)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): running as far as kill can tell


def print_metrics(rank: int, metrics: dict) -> None:
    """Default ``on_metrics``: one line per record; a table (the ``samples`` metric, a list of
    dicts) as its row count, ``<2 rows>``, not its texts."""
    from rlkit.observe.sinks import format_value, table_rows

    def shown(v):  # a table as the sinks' one-line displays show it (format_value), numbers as before
        return format_value(v) if table_rows(v) is not None else f"{v:.4g}" if isinstance(v, float) else f"{v}"

    parts = [f"{k}={shown(v)}" for k, v in metrics.items()]
    print(f"[rank {rank}] " + " ".join(parts), flush=True)


def _free_endpoint() -> str:
    # Port 0: the c10d rendezvous store binds a free port itself (as torchrun --standalone does).
    return "127.0.0.1:0"


def _parse_nnodes(nnodes: int | str) -> tuple[int, int]:
    bad = ValueError(f"launch: nnodes must be a positive int or 'MIN:MAX' such as '1:4' (1 <= MIN <= MAX), got {nnodes!r}")
    if isinstance(nnodes, bool) or not isinstance(nnodes, (int, str)):
        raise bad
    if isinstance(nnodes, int):
        lo = hi = nnodes
    else:
        lo_text, _, hi_text = nnodes.partition(":")
        try:
            lo, hi = int(lo_text), int(hi_text or lo_text)
        except ValueError:
            raise bad from None
    if not 1 <= lo <= hi:
        raise bad
    return lo, hi


def _check_launch_args(nproc_per_node, nnodes, rdzv_endpoint, rdzv_backend, max_restarts, on_metrics, run_dir, run_id) -> None:
    """Fail in the caller, naming the argument: a wrong type otherwise surfaces as a TypeError
    deep inside torch elastic, or (run_dir) as an OSError about a subdirectory."""
    int_at_least(nproc_per_node, "launch: nproc_per_node", 1, " (workers on this machine)")
    int_at_least(max_restarts, "launch: max_restarts", 0)
    for name, value in (("rdzv_endpoint", rdzv_endpoint), ("run_id", run_id)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"launch: {name} must be a str or None, got {value!r}")
    if not isinstance(rdzv_backend, str) or not rdzv_backend:
        raise ValueError(f"launch: rdzv_backend must be a backend name such as 'c10d', got {rdzv_backend!r}")
    if on_metrics is not None and not callable(on_metrics):
        raise ValueError(f"launch: on_metrics must be a callable on_metrics(rank, metrics) or None, got {on_metrics!r}")
    if run_dir is not None:
        if not isinstance(run_dir, (str, os.PathLike)):
            raise ValueError(f"launch: run_dir must be a path (str or os.PathLike) or None, got {run_dir!r}")
        if os.path.exists(run_dir) and not os.path.isdir(run_dir):
            raise ValueError(f"launch: run_dir={os.fspath(run_dir)!r} is an existing file, not a directory; "
                             "give a directory (it is created if missing) or None for a new temp directory")


def _read_errors(run_dir: str) -> dict[int, tuple[float, str]]:
    out = {}
    for path in glob.glob(os.path.join(run_dir, "errors", "rank*.txt")):
        rank = int(re.search(r"rank(\d+)\.txt$", path).group(1))
        with open(path, encoding="utf-8") as f:
            out[rank] = (os.path.getmtime(path), f.read())
    return out


def _described(error: WorkerError, run_dir: str) -> WorkerError:
    """``error`` with the launch's ``run_dir`` (where the tracebacks are kept) and what its rank's
    worker recorded of its exception (``errors/rank<R>.json``, :func:`_exception_record`): the
    classes a caller tells bad input from a crash by."""
    error.run_dir = run_dir
    try:
        with open(os.path.join(run_dir, "errors", f"rank{error.rank}.json"), encoding="utf-8") as f:
            record = json.load(f)
        error.exception_types = tuple(str(name) for name in record["types"])
        error.exception_message = str(record["message"])
    except (OSError, ValueError, KeyError, TypeError):  # none recorded: a signal, a bare exit
        pass
    return error


#: torch elastic's report of a failed worker: ``logger.exception("failed (exitcode: ...) ...")`` on
#: this logger, the worker's whole traceback as some 30 "E... api.py:836]" lines on the caller's stderr
_ELASTIC_LOGGER = "torch.distributed.elastic.multiprocessing.api"
#: torch's spawn context, which logs "Terminating process N via signal SIGTERM" as it stops the
#: workers that survived the failure
_SPAWN_LOGGER = "torch.multiprocessing.spawn"


class _DropFailureReport(logging.Filter):
    """Drops torch's own report of a failed worker (only those two records; any other warning or
    error of those loggers passes, e.g. a process that would not exit after SIGKILL)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if record.name == _ELASTIC_LOGGER:
            return not (record.levelno == logging.ERROR and message.startswith("failed (exitcode"))
        if record.name == _SPAWN_LOGGER:
            return not (record.levelno == logging.WARNING and message.startswith("Terminating process"))
        return True


@contextlib.contextmanager
def _quiet_failure_report(enabled: bool = True):
    """While a launch runs: torch elastic's log of a failed worker is dropped, because the launch
    raises a :class:`WorkerError` carrying the same traceback (and keeps it in
    ``run_dir/errors/rank<R>.txt``); printed as well, it buried the one-line error ``rlkit run``
    makes of it under 30 lines of elastic's internals. Not with ``max_restarts > 0``
    (``enabled=False``): a failure that a restart then recovers from raises nothing, and that log
    is its only trace in the caller. The filter is removed afterwards."""
    if not enabled:
        yield
        return
    drop = _DropFailureReport()
    loggers = [logging.getLogger(name) for name in (_ELASTIC_LOGGER, _SPAWN_LOGGER)]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def _launched_plan(fn: Any):
    """A :class:`rlkit.Pipeline` or a ``Plan`` given as ``fn`` (``rk.launch(plan, state, prompts, ...)``,
    :mod:`rlkit.launch_fit`), else None. Both are looked up only when rlkit.pipeline is loaded
    (wherever a Pipeline or Plan exists)."""
    pipeline = sys.modules.get("rlkit.pipeline")
    return fn if pipeline is not None and isinstance(fn, (pipeline.Pipeline, pipeline.Plan)) else None


def launch(
    fn: Callable,
    *args: Any,
    nproc_per_node: int = 2,
    nnodes: int | str = 1,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str = "c10d",
    max_restarts: int = 0,
    on_metrics: MetricsCallback | None = None,
    run_dir: str | None = None,
    run_id: str | None = None,
    echo_logs: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``nproc_per_node`` x ``nnodes`` processes; return rank 0's result.

    - ``nproc_per_node``: workers on this machine (one per GPU on GPU machines).
    - ``nnodes``: machines (an int, or ``"MIN:MAX"`` for an elastic range). With more than one,
      call ``launch`` on every machine with the same ``rdzv_endpoint`` (``HOST:PORT`` of one of
      them) and ``run_id``.
    - ``rdzv_backend``: ``"c10d"`` (default, no extra service) or any torch elastic backend.
    - ``max_restarts``: how many times the whole worker group is restarted after a failure.
    - ``on_metrics(rank, metrics)``: called (in a background thread) for every :func:`emit` of
      every worker on this machine, as it happens; default :func:`print_metrics`.
    - ``run_dir``: where metrics, errors and worker logs go (default: a new temp directory).
    - ``echo_logs``: echo worker stdout/stderr here (they are also kept under ``run_dir/logs``).

    Workers see the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...); call
    :func:`rlkit.parallel.init_distributed` inside ``fn``. Keywords not listed above go to ``fn``
    (to pass one of these names to ``fn``, wrap it in ``functools.partial``). On a machine that
    does not hold global rank 0 the return value is ``None``. A worker's exception is raised here
    as :class:`WorkerError` with the worker's traceback text; so is a worker that ends with
    ``sys.exit(0)`` instead of returning (it leaves no result), and one whose process ends inside
    ``fn`` without an exception: ``os._exit(0)`` called from Python, within a second or so, with or
    without ``max_restarts``; any other silent end with status 0 (a library's C ``exit(0)``) a few
    seconds after, with ``max_restarts=0`` only (torch elastic alone would wait for a result
    forever; with restarts, and such an end, it still does). So is a rank left waiting in a
    collective that the ranks which returned never called (``if rank == 0: dist.all_reduce(t)``), on
    gloo, once they have waited ``RLKIT_TEARDOWN_WAIT_S`` (30 s) for it at the closing barrier
    (:func:`_teardown_process_group`). Arguments of the wrong type or
    range raise ``ValueError`` naming them before any process starts.

    ``launch(plan, state, prompts, steps=..., batch_size=..., **options)`` with a lowered ``Plan``
    (or an :class:`rlkit.Pipeline`) runs ``plan.fit`` on the workers and returns ``(state, history)``:
    the caller's state loaded with the trained one, and rank 0's history; ``plan.fit``'s keywords
    (``sinks`` called here as the workers log each step, ``eval_fn``, ``eval_every``,
    ``checkpointer``, ``shuffle``) go with it. With neither ``sinks`` nor ``on_metrics`` it shows a
    progress bar over the steps (:class:`rlkit.observe.console.ConsoleSink`) instead of a line per
    step. See :mod:`rlkit.launch_fit`.

    Entries registered in this process by code outside rlkit (``rk.algos.ADVANTAGE_ESTIMATORS.register
    ("median")(fn)`` in a notebook, ``override=True`` replacements of built-ins, entries added to
    ``rk.recipes.RECIPES`` / ``rk.tasks.TASKS``) are shipped with ``fn`` and registered in each
    worker before ``fn`` runs; one that cannot be pickled is skipped with a warning naming it.
    """
    import cloudpickle
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    plan = _launched_plan(fn)
    if plan is None and not callable(fn):
        raise TypeError(f"launch: fn must be a callable, got {type(fn).__name__}")
    _check_launch_args(nproc_per_node, nnodes, rdzv_endpoint, rdzv_backend, max_restarts, on_metrics, run_dir, run_id)
    min_nodes, max_nodes = _parse_nnodes(nnodes)
    _teardown_wait_s()  # a bad RLKIT_TEARDOWN_WAIT_S: a ValueError here, before any worker starts
    if max_nodes > 1 and not rdzv_endpoint:
        raise ValueError(
            f"launch: nnodes={nnodes} needs rdzv_endpoint='HOST:PORT' (a reachable address of one of the machines, "
            "the same on all of them)"
        )
    if plan is not None:
        from rlkit.launch_fit import launch_fit

        return launch_fit(plan, args, kwargs, dict(nproc_per_node=nproc_per_node, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
                                                 rdzv_backend=rdzv_backend, max_restarts=max_restarts, on_metrics=on_metrics,
                                                 run_dir=run_dir, run_id=run_id, echo_logs=echo_logs))
    run_dir = os.path.abspath(run_dir or tempfile.mkdtemp(prefix="rlkit_run_"))
    try:
        for sub in ("metrics", "errors", "logs", "workers"):
            os.makedirs(os.path.join(run_dir, sub), exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:  # a file where a directory of the path should be
        raise ValueError(f"launch: run_dir={run_dir!r} cannot be used as a directory: {e}") from e
    for stale in [p for sub in ("errors", "metrics", "workers") for p in glob.glob(os.path.join(run_dir, sub, "*"))]:
        os.remove(stale)  # a reused run_dir must not replay an old run's metrics or errors
    # names the caller registered (a notebook's estimator, loss, recipe) travel with fn: the
    # workers import rlkit afresh and knew only its built-ins
    registrations = _user_registrations()
    try:
        payload = cloudpickle.dumps((fn, args, kwargs, registrations))
    except Exception:
        # one entry that cannot be pickled is skipped with a warning naming it; fn, args or kwargs
        # that cannot be pickled raise here as before
        registrations = _picklable(registrations)
        payload = cloudpickle.dumps((fn, args, kwargs, registrations))
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc_per_node,
        run_id=run_id or (uuid.uuid4().hex if max_nodes == 1 else "rlkit"),
        rdzv_endpoint=rdzv_endpoint or _free_endpoint(),
        rdzv_backend=rdzv_backend,
        max_restarts=max_restarts,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "logs"), redirects=Std.ALL if echo_logs else Std.NONE),
    )
    tail = _Tail(run_dir, on_metrics or print_metrics, echo_logs, watch=max_restarts == 0)
    # torch elastic installs its own handlers (they raise SignalException) and leaves them: a later
    # Ctrl-C in the caller's own code raised SignalException, not KeyboardInterrupt
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS if threading.current_thread() is threading.main_thread()}
    tail.start()
    try:
        with _quiet_failure_report(enabled=max_restarts == 0):
            results = elastic_launch(config, _worker)(payload, run_dir)
    except ChildFailedError as e:
        raise _described(_worker_error(run_dir, e), run_dir) from None
    except SignalException as e:
        # the workers live in their own session: none may outlive the launch (a second Ctrl-C
        # interrupts torch elastic while it waits for them to stop)
        _kill_leftover_workers(run_dir)
        if tail.vanished:  # the watchdog's own SIGTERM: a worker ended without leaving fn
            raise _described(_vanished_error(run_dir, tail.vanished), run_dir) from None
        # the workers are stopped by now (a Checkpointer in them saved on SIGTERM); the caller gets
        # what one process would raise: KeyboardInterrupt for SIGINT, Terminated (exit 143) for SIGTERM
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt("launch: interrupted (SIGINT); the workers were stopped") from None
        if e.sigval == signal.SIGTERM:
            raise Terminated() from None
        raise
    finally:
        tail.stop()
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
    if tail.callback_error is not None:
        raise RuntimeError(f"launch: on_metrics raised {tail.callback_error!r}; the run itself finished") from tail.callback_error
    # keys are global ranks; a worker whose fn called sys.exit(0) (SystemExit with status 0 or
    # None) counts as a success for torch elastic, with None as its value instead of our tuple
    missing = sorted(rank for rank, value in results.items() if value is None)
    if missing:
        raise _described(_no_result_error(run_dir, missing), run_dir)
    if 0 not in results:
        return None
    return cloudpickle.loads(results[0][1])


def _started_ranks(run_dir: str) -> list[int]:
    """Global ranks whose worker of the run has started ``fn`` (wrote its pid), on any machine that
    shares ``run_dir``."""
    paths = glob.glob(os.path.join(run_dir, "workers", "rank*.pid"))
    return sorted(int(re.search(r"rank(\d+)\.pid$", p).group(1)) for p in paths)


def _left_markers(run_dir: str) -> dict[int, str]:
    """``rank -> path`` of the ``.left`` markers :func:`_worker` writes for a rank that returned
    from ``fn`` and left without the closing barrier."""
    paths = glob.glob(os.path.join(run_dir, "workers", "rank*.left"))
    return {int(re.search(r"rank(\d+)\.left$", p).group(1)): p for p in paths}


def _left_ranks(run_dir: str) -> dict[int, list[int]]:
    """``rank -> the ranks it waited for`` of the ranks that left without the closing barrier
    (:func:`_left_markers`)."""
    out = {}
    for rank, path in _left_markers(run_dir).items():
        try:
            with open(path, encoding="utf-8") as f:
                out[rank] = [int(r) for r in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


def _unfinished_workers(run_dir: str):
    """``(rank, pid)`` of this machine's workers of the run that have not written the marker a
    worker writes when Python leaves ``fn``: still in ``fn``, or gone without leaving it."""
    host = socket.gethostname()
    for path in glob.glob(os.path.join(run_dir, "workers", "rank*.pid")):
        if os.path.exists(path[: -len(".pid")] + ".done"):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                where, pid = f.read().split()
        except (OSError, ValueError):
            continue
        if where == host:
            yield int(re.search(r"rank(\d+)\.pid$", path).group(1)), int(pid)


def _exited_with_0(run_dir: str):
    """``(rank, pid)`` of this machine's workers of the run that called ``os._exit(0)`` inside ``fn``
    (the note :func:`_noting_exit` leaves) without leaving ``fn`` first."""
    for rank, pid in _unfinished_workers(run_dir):
        try:
            with open(os.path.join(run_dir, "workers", f"rank{rank}.exit"), encoding="utf-8") as f:
                noted_pid, status = map(int, f.read().split())
        except (OSError, ValueError):
            continue
        if noted_pid == pid and status == 0:
            yield rank, pid


def _kill_leftover_workers(run_dir: str) -> list[int]:
    """SIGKILL this machine's workers of the run that are still running ``fn``; their ranks."""
    killed = []
    for rank, pid in _unfinished_workers(run_dir):
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(rank)
            except OSError:
                pass
    return sorted(killed)


def _no_result_error(run_dir: str, ranks: list[int]) -> WorkerError:
    """Workers that exited cleanly without returning from ``fn``: not a success, since launch
    returns rank 0's result and a rank that stops early has not done its share of the run."""
    written = {rank: text for rank, (_, text) in _read_errors(run_dir).items()}  # the SystemExit's traceback
    failures = {rank: written.get(rank, "(none recorded: the process exited with status 0)") for rank in ranks}
    summary = (
        f"worker rank(s) {ranks} exited with status 0 without returning from fn (sys.exit(0) inside it?), so launch "
        "has no result from them: it returns rank 0's result, and a rank that stops early has not finished its share "
        "of the run (its peers' collectives would wait for it); return from fn instead"
    )
    return WorkerError(ranks[0], failures[ranks[0]], failures, summary=summary)


def _vanished_error(run_dir: str, ranks: list[int]) -> WorkerError:
    """Workers whose process ended while running ``fn`` without an exception (``os._exit(0)``,
    a library calling C ``exit``): torch elastic waits for their results forever; launch stops
    the run instead."""
    text = "(none: the process ended with no Python exception, e.g. os._exit() inside fn)"
    summary = (f"worker rank(s) {ranks} ended while running fn, without returning or raising (os._exit() inside it, or a "
               "library that exits the process), so launch has no result from them and stopped the run; return from fn instead")
    return WorkerError(ranks[0], text, {r: text for r in ranks}, summary=summary)


#: what a rank's traceback says when it failed only because a peer went away (collateral damage):
#: gloo / NCCL / the TCP store losing a connection, or a collective timing out
_COLLATERAL = re.compile(
    r"Connection closed by peer|Connection reset|Broken pipe|Connection refused|ECONNRESET|EPIPE"
    r"|Timed out waiting|Socket Timeout|timed out after|Watchdog caught collective operation timeout"
    r"|ProcessGroup\w*.*(?:timeout|timed out|abort)|NCCL communicator was aborted|remote process exited"
    r"|ncclRemoteError|ncclSystemError|DistNetworkError|DistStoreError|recvValue|recvBytes|sendBytes"
    r"|gloo/transport|failed to recv|failed to send",
    re.IGNORECASE,
)


#: an exception that reports another rank's failure (rlkit.parallel.shard_reward gathers every rank's error)
_REPORTS_PEER = re.compile(r"failed on rank (\d+)")


#: a traceback ending in one of these: the rank was stopped by the launch's own signals
_STOPPED = re.compile(r"^(?:[\w.]+\.)?(?:KeyboardInterrupt|SignalException|Preempted|Terminated)\b|^SystemExit: 143\b", re.M)


def _exception_lines(text: str) -> str:
    """The last exception's own lines of a traceback text (its type, message and notes), without
    the frames above them."""
    tail = text.rsplit("Traceback (most recent call last):", 1)[-1]
    return "\n".join(line for line in tail.splitlines() if line.strip() and not line.startswith((" ", "\t")))


def _collateral(text: str) -> bool:
    """Whether a worker's Python traceback is collateral damage: a collective or connection error
    (the rank failed because a peer went away), or the stop the launch sent it."""
    lines = _exception_lines(text)
    return bool(_COLLATERAL.search(lines) or _STOPPED.search(lines)
                or re.search(r"^(?:[\w.]+\.)?(?:DistBackendError|DistNetworkError)\b", lines, re.M))


def _worker_error(run_dir: str, error) -> WorkerError:
    """The WorkerError of a failed launch, naming the root cause first: a Python exception of
    fn's own; else a rank that died without a traceback (a signal, e.g. the OOM killer's SIGKILL,
    or a bare exit), whose peers then fail in their collectives with "Connection closed by peer";
    else the first collective failure."""
    written = _read_errors(run_dir)
    failures = {rank: text for rank, (_, text) in written.items()}
    silent: dict[int, tuple] = {}  # rank -> sort key: killed by a signal first, then the earliest
    codes: dict[int, tuple[int, str]] = {}
    for rank, failure in getattr(error, "failures", {}).items():
        if rank in failures:
            continue
        message = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)
        failures[rank] = f"exit code {failure.exitcode} ({failure.signal_name()}): {message}"
        codes[rank] = (failure.exitcode, failure.signal_name())
        # a signal of its own (SIGKILL, SIGSEGV, ...) first; then a bare exit; last SIGTERM / SIGINT,
        # which is how torch elastic stops the survivors of a failure
        kind = 2 if failure.signal_name() in ("SIGTERM", "SIGINT") else 0 if failure.exitcode < 0 else 1
        silent[rank] = (kind, getattr(failure, "timestamp", 0) or 0, rank)
    if not failures:
        return WorkerError(-1, str(error))
    own = {r: t for r, (t, text) in written.items() if not _collateral(text)}
    # a rank that re-raises a peer's failure (rlkit.parallel.shard_reward: "reward 'f' failed on rank
    # 1: ...") reports it; naming it first named rank 0 for an error of rank 1's own
    reporters = {r for r in own if (m := _REPORTS_PEER.search(_exception_lines(written[r][1])))
                 and int(m.group(1)) != r and int(m.group(1)) in own}
    if reporters and len(reporters) < len(own):
        own = {r: t for r, t in own.items() if r not in reporters}
    collateral = sorted(r for r in written if r not in own)
    if own:  # a Python exception is the root cause; processes killed afterwards are collateral
        first = min(own, key=lambda r: (own[r], r))
        lines = _exception_lines(failures[first])
        if f"TypeError: {_UNPICKLABLE}" in lines:  # fn finished; its value cannot come back: say so first
            return WorkerError(first, failures[first], failures, summary=lines[lines.index(_UNPICKLABLE):].splitlines()[0])
        return WorkerError(first, failures[first], failures)
    if silent:
        first = min(silent, key=lambda r: silent[r])
        code, name = codes[first]
        others = sorted(r for r in failures if r != first)
        how = (f"was killed by signal {name} (exit code {code}"
               + ("; SIGKILL is what the kernel's out-of-memory killer sends" if name == "SIGKILL" else "") + ")"
               if code < 0 else f"exited with code {code} without a Python traceback (os._exit, or a crash in native code)")
        also = ""
        if others:
            lost = " with collective/connection errors (they lost their peer)" if set(others) <= set(collateral) else ""
            also = f"; rank(s) {others} failed after it{lost}"
        return WorkerError(first, failures[first], failures, summary=f"worker rank {first} {how}{also}")
    first = min(collateral, key=lambda r: (written[r][0], r))
    left = _left_ranks(run_dir)
    if left and first not in left:
        # the peers that left were waited for in vain at the closing barrier: this rank was in a
        # collective they never called, and failed when they closed their connections
        wait = _teardown_wait_s(strict=False)
        summary = (f"worker rank {first} failed in a collective after rank(s) {sorted(left)} had returned from fn and "
                   f"left (they waited {wait:g} s for it at the closing barrier): a collective that only "
                   "some ranks call (e.g. under `if rank == 0:`) has no partner on the ranks that returned; the traceback "
                   "below shows where it waited. Call it on every rank, or on none")
        return WorkerError(first, failures[first], failures, summary=summary)
    return WorkerError(first, failures[first], failures)


# ---------------------------------------------------------------------------------------------
# shell entry


#: the words torchrun's ``--nproc-per-node`` takes besides a count
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


def _check_torchrun_args(args) -> None:
    """``--nproc-per-node`` and ``--nnodes``, checked before torch elastic starts: it meets 0, a
    negative count or ``MIN > MAX`` with a bare ``AssertionError`` traceback, and a word it does
    not know with a ``ValueError`` traceback."""
    nproc = str(args.nproc_per_node).strip()
    try:
        count = int(nproc)
    except ValueError:
        import torch

        # torchrun also takes the name of a registered out-of-tree backend (privateuse1)
        custom = torch._C._get_privateuse1_backend_name()  # "privateuseone" until a backend renames it
        if nproc not in _NPROC_WORDS and (nproc != custom or custom == "privateuseone"):
            raise ValueError(f"--nproc-per-node is {nproc!r}; give a number of workers on this machine >= 1 "
                             f"(e.g. --nproc-per-node 2) or one of {', '.join(_NPROC_WORDS)} (one per core/GPU)") from None
        if nproc == "gpu":
            if not torch.cuda.is_available():
                raise ValueError("--nproc-per-node is 'gpu' (one worker per GPU), but this torch sees no CUDA GPU; "
                                 "give a number of workers (e.g. --nproc-per-node 2), or cpu / auto") from None
        if nproc == "xpu":
            xpu = getattr(torch, "xpu", None)
            if xpu is None or not xpu.is_available():
                # torch elastic met it with a ValueError traceback from its own device query
                raise ValueError("--nproc-per-node is 'xpu' (one worker per Intel GPU), but this torch sees no XPU; "
                                 "give a number of workers (e.g. --nproc-per-node 2), or cpu / auto") from None
    else:
        if count < 1:
            raise ValueError(f"--nproc-per-node is {count}; give a number of workers on this machine >= 1 "
                             "(e.g. --nproc-per-node 2), or auto (one per GPU, else per core)")
    if args.max_restarts < 0:
        # torch elastic asserted on it with a bare AssertionError
        raise ValueError(f"--max-restarts is {args.max_restarts}; give how many times to restart the workers after a "
                         "failure, >= 0 (0: none)")
    nnodes = str(args.nnodes).strip()
    lo_text, colon, hi_text = nnodes.partition(":")
    try:
        lo, hi = int(lo_text), int(hi_text if colon else lo_text)
    except ValueError:
        lo = hi = None
    if lo is None or not 1 <= lo <= hi:
        raise ValueError(f"--nnodes is {nnodes!r}; give a number of machines >= 1 (e.g. --nnodes 2) or an elastic range "
                         "MIN:MAX with 1 <= MIN <= MAX (e.g. --nnodes 1:4)")
    if hi > 1 and not args.rdzv_endpoint and args.master_addr in ("127.0.0.1", "localhost"):
        # torchrun's static rendezvous on this machine's address: the other machines never arrive,
        # and it waited without a word
        raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (an address of one of the machines, the same "
                         "on all of them), or torchrun's static --master-addr HOST with --node-rank")
    script = args.training_script
    if not args.module and not args.no_python and not os.path.isfile(script):
        # each worker would fail to open it, and torch elastic report that as a 50-line ChildFailedError
        raise ValueError(f"script {script!r} not found (in {os.getcwd()}); give the path of a Python file, "
                         "or -m MODULE to run a module")


def torchrun_argv(argv: list[str]) -> list[str]:
    """``rlkit launch`` arguments -> torchrun arguments (adds ``--standalone`` / ``--rdzv-backend c10d``).

    Raises ``ValueError`` naming the flag for a ``--nproc-per-node`` or ``--nnodes`` that torch
    elastic would reject only with a bare traceback."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    # its usage and errors read "rlkit launch", not torchrun's "rlkit" with its own description
    parser.prog = "rlkit launch"
    parser.description = "Start a script on many processes: torchrun (torch.distributed.run) with --standalone for one node"
    args = parser.parse_args(list(argv))
    _check_torchrun_args(args)
    extra: list[str] = []
    single_node = str(args.nnodes) in ("1", "1:1")
    if single_node and not args.rdzv_endpoint and not args.standalone:
        extra.append("--standalone")
    if args.rdzv_endpoint and args.rdzv_backend == "static" and not single_node:
        extra.append("--rdzv-backend=c10d")
    return extra + list(argv)


def main_launch(argv: list[str] | None = None) -> None:
    """Entry of ``rlkit launch``: torchrun semantics, delegating to ``torch.distributed.run``.

    A bad ``--nproc-per-node`` / ``--nnodes`` exits with status 2 and one line naming the flag
    (as argparse does), before any process starts."""
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun = torchrun_argv(sys.argv[1:] if argv is None else list(argv))
    except ValueError as e:
        print(f"rlkit launch: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    torchrun_main(torchrun)


class _CallableModule(type(sys)):
    """``rlkit.launch`` is this module, and callable: ``rk.launch(fn, ...)`` launches, and
    ``rk.launch.WorkerError`` / ``rk.launch.emit`` are its names."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return launch(*args, **kwargs)

    def __reduce__(self):
        # a function that names rk.launch.emit holds this module in its globals: cloudpickle
        # shipping it to the workers could not pickle a module subclass; it travels by name
        import importlib

        return importlib.import_module, (self.__name__,)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main_launch()
