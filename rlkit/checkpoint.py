"""Checkpoints you can resume exactly: torch.distributed.checkpoint (DCP), atomic, keep-last-N.

What a checkpoint holds (one directory per step, ``<root>/step_000123``)::

    step_000123/
      .metadata, __<rank>_<i>.distcp   DCP: actor, optimizer, critic, critic_optimizer, ref
                                       (sharded tensors: saved on N processes, loadable on M),
                                       "trainer" (step, policy_version, seed, data_position,
                                       extras, LR schedulers) and "rng.rank<r>" (python, numpy,
                                       torch, cuda global RNG states of every process)
      meta.json                        rlkit/torch versions, world size, per model: class,
                                       config, config hash, parameter shapes and dtypes
      COMPLETE                         manifest {file: bytes, sha256}; written last

Atomicity: everything is written into ``step_000123.tmp-<uuid>``; ``COMPLETE`` is written and
fsynced last, then the directory is renamed to ``step_000123`` (a rename is atomic on POSIX
file systems). A crash at any point leaves either the previous checkpoints untouched plus a
``*.tmp-*`` directory (ignored, then deleted by the next :class:`Checkpointer`), or the new
complete checkpoint. A directory without ``COMPLETE`` is never loaded. A checkpoint is deleted
(keep-last-N, or replaced by a new save of its step) by renaming it to ``step_000123.old-<hex>``
first; one whose deletion an interrupt stopped is deleted by the next save (see :func:`prune`).
Replacing a checkpoint of the same step renames the old one away just before the new one goes
in: a failed rename puts the old one back, and a crash in between leaves a complete ``*.tmp-*``, which the next
:class:`Checkpointer` renames into place (see :func:`cleanup`).

Timelines: saving step k next to checkpoints of later steps (the run was restored from an older
one) moves those into ``<root>/abandoned/``, where nothing looks for the newest (see :func:`save`).

The reference model is saved whenever the state has one: it cannot be rebuilt in general
(``rk.init(..., ref="copy")`` snapshots the actor *after* a warm-up, which a resumed job skips).
Pass ``save_ref=False`` when your ref is loaded from a fixed directory anyway.

RNG: rlkit's own randomness is derived from ``(seed, step)`` with :func:`rlkit.state.fold_in`, so
restoring ``seed`` and ``step`` already reproduces sampling; the global RNG states are saved for
code outside rlkit that uses them. A rank that did not exist at save time (resuming on more
processes) keeps its current global RNG state.

Multi-process: every rank calls :func:`save` / :func:`load` (they are collectives over the default
process group); ``root`` must be a file system that every rank sees.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import errno
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import signal
import threading
import time
import uuid
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from rlkit._checks import int_at_least
from rlkit.state import TrainState

FORMAT_VERSION = 1
MARKER = "COMPLETE"
META = "meta.json"
PREFIX = "step_"
_FINAL = re.compile(r"^step_(\d+)$")
_GARBAGE = re.compile(r"^step_(\d+)\.(tmp|old)-[0-9a-f]+$")
#: errnos of a full disk or quota: a failed save's message says to free space
_DISK_FULL = {getattr(errno, name) for name in ("ENOSPC", "EDQUOT") if hasattr(errno, name)}
#: (model field, optimizer field, scheduler field) of the TrainState roles that are trained
_TRAINED = (("actor", "optimizer", "scheduler"), ("critic", "critic_optimizer", "critic_scheduler"))
#: config keys that differ between otherwise identical models (not part of the config hash)
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures", "_commit_hash"}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the path and the fix."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint (or the checkpoint directory) does not exist."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint was saved from a different model / state structure."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated or fails its checksum."""


class CheckpointSaveError(CheckpointError, OSError):
    """Writing a checkpoint failed (a full disk, a write error): the partial new checkpoint is
    discarded and the earlier ones are intact. DCP reported such a failure as its ``CheckpointException``,
    a ``BaseException`` that ``except Exception`` / ``except OSError`` did not catch, whose message
    was a traceback dump that named no checkpoint. An ``OSError`` too, with the cause's ``errno``
    when it had one (``errno.ENOSPC``: the disk is full). ``path``: the checkpoint it was writing;
    ``reason``: the cause, one line; ``previous``: the newest complete checkpoint next to it, or None."""

    def __init__(self, message: str, *, path: Path | None = None, reason: str = "", previous: Path | None = None):
        super().__init__(message)
        self.path, self.reason, self.previous = path, reason, previous


class Preempted(SystemExit):
    """Raised by :meth:`Checkpointer.maybe_save` after saving on SIGTERM (exit status 143)."""

    def __init__(self, path: str):
        super().__init__(128 + signal.SIGTERM)
        self.path = path


# --------------------------------------------------------------------------- process group
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _interrupt_in(errors: Iterable[BaseException | None]) -> BaseException | None:
    """The first ``KeyboardInterrupt`` or ``SystemExit`` among ``errors`` and their
    ``__cause__`` / ``__context__`` chains (cycles are followed once), or None."""
    seen: set[int] = set()
    todo = [e for e in errors if e is not None]
    while todo:
        err = todo.pop(0)
        if id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            return err
        todo.extend(e for e in (err.__cause__, err.__context__) if isinstance(e, BaseException))
    return None


@contextlib.contextmanager
def _interrupts_unwrapped():
    """Ctrl-C inside a DCP save or load reaches the caller as ``KeyboardInterrupt`` (chained to
    DCP's error), not as the ``CheckpointException`` DCP wraps it in: what handles an interrupt
    (``rk.fit``'s ``exc.state``, ``rlkit run``'s one-line message) never saw it.

    The interrupt is looked for in the whole ``__cause__`` / ``__context__`` chain of each failure:
    one that lands while ``torch.save`` writes a tensor comes out of torch's zip writer as
    ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos`` with the
    ``KeyboardInterrupt`` only as its context. A ``SystemExit`` found there (a SIGTERM handler that
    exits, :class:`Preempted`) is re-raised as it is, with its exit status."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - re-raised, or its interrupt (CheckpointException is a BaseException)
        if isinstance(e, CheckpointException):
            failures = getattr(e, "failures", {}) or {}
            errors = [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
        else:
            errors = [e]
        found = _interrupt_in(x for x in errors if isinstance(x, BaseException))
        if found is None:
            raise
        if isinstance(found, KeyboardInterrupt):
            raise KeyboardInterrupt("interrupted during a checkpoint's save or load") from e
        raise found from e


@contextlib.contextmanager
def _quiet_dcp():
    # DCP warns "assuming the intent is to save in a single process" even when told no_dist=True
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")
        yield


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _broadcast(obj: Any) -> Any:
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj: Any) -> list[Any]:
    if _world() == 1:
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


#: words in torch.distributed's errors for a collective that the other ranks never joined
_NOT_JOINED = ("timed out", "timeout", "closed by peer", "connection reset", "broken pipe")


#: seconds a checkpoint collective waits for the other ranks before it warns that they are missing
WAIT_WARN_S = 60.0
_wait_calls: dict[str, int] = {}


def _watch_arrivals(what: str) -> threading.Event | None:
    """Mark this rank's arrival at its next ``what`` collective in the process group's store, and
    start a thread that warns, after :data:`WAIT_WARN_S` seconds still inside the collective, which
    ranks never arrived (``save`` called under ``if rank == 0``). The wait itself cannot be cut
    short (a slow rank looks the same as an absent one until it arrives), but the user learns why
    it waits within a minute, not at the process group's timeout (torch's default: 10 minutes for
    NCCL, 30 for gloo). Returns the event that ends the watch (set it on leaving the collective);
    None on one process or where torch exposes no store."""
    if _world() == 1:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    call = _wait_calls[what] = _wait_calls.get(what, 0) + 1  # the same on every rank that makes the same calls
    me, world = _rank(), _world()
    key = f"rlkit/checkpoint/{what}/{call}"
    try:
        store.set(f"{key}/{me}", "1")
    except RuntimeError:
        return None
    done = threading.Event()

    def watch() -> None:
        if done.wait(WAIT_WARN_S):
            return
        try:
            missing = [r for r in range(world) if not store.check([f"{key}/{r}"])]
        except RuntimeError:
            return
        if missing and not done.is_set():
            ranks = ", ".join(map(str, missing))
            warnings.warn(
                f"{what} on rank {me} has waited {WAIT_WARN_S:g} s for rank{'s' if len(missing) > 1 else ''} {ranks}, which "
                f"{'have' if len(missing) > 1 else 'has'} not reached it. If the call never comes, this rank waits until the "
                f"process group's timeout: Checkpointer.save, resume and restore (and rk.fit with a checkpointer) are "
                f"collectives over every process of the job; call them on every rank, not under `if rank == 0`",
                RuntimeWarning, stacklevel=2,
            )

    threading.Thread(target=watch, name=f"rlkit-{what}-arrivals", daemon=True).start()
    return done


@contextlib.contextmanager
def _waiting_for_ranks(what: str):
    """A collective that the other ranks never joined (``save`` or ``resume`` called under ``if
    rank == 0``) failed after the process group's timeout with gloo's bare "Timed out waiting
    1800000ms for recv operation" (or "Connection closed by peer" when the others had exited),
    naming neither the call nor the fix: it is re-raised as a :class:`CheckpointError` that does,
    and a rank still waiting after :data:`WAIT_WARN_S` seconds warns which ranks are missing
    (:func:`_watch_arrivals`)."""
    watching = _watch_arrivals(what)
    try:
        yield
    except RuntimeError as exc:
        from rlkit.parallel.agree import RanksDisagreeError

        text = str(exc).lower()
        if isinstance(exc, (CheckpointError, RanksDisagreeError)) or not any(w in text for w in _NOT_JOINED):
            raise
        raise CheckpointError(
            f"{what}: the other ranks did not join its collective ({_last_line(exc)}). Checkpointer.save, resume and "
            f"restore (and rk.fit with a checkpointer) are collectives over every process of the job: build the "
            f"Checkpointer and call them on every rank, not under `if rank == 0` (every rank saves and loads its own "
            f"shards); a rank that skips the call leaves the others waiting for the process group's timeout"
        ) from exc
    finally:
        if watching is not None:
            watching.set()


# --------------------------------------------------------------------------- directory layout
def step_dir_name(step: int) -> str:
    """``step_000123``: zero-padded so names sort like steps (more digits past 999999)."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"{PREFIX}{step:06d}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first (no marker: skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _FINAL.match(entry.name)
        if m and entry.is_dir() and (entry / MARKER).is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def cleanup(root: str | os.PathLike) -> list[Path]:
    """Delete leftovers of interrupted saves under ``root`` (``*.tmp-*``, ``*.old-*``, and
    ``step_*`` directories without a ``COMPLETE`` marker). Returns what was removed.

    One exception: a ``step_<k>.tmp-*`` that has its ``COMPLETE`` marker (written last) when there
    is no complete ``step_<k>`` is a finished save that a crash stopped just before its rename
    (replacing an older ``step_<k>`` renames that one away first): it is renamed into place, not
    deleted, so that a crash inside the swap never loses both the old and the new checkpoint.

    Only call this when no save is in progress (a :class:`Checkpointer` does, on creation)."""
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    for entry in sorted(root.iterdir()):
        m = _GARBAGE.match(entry.name)
        if m and m.group(2) == "tmp" and entry.is_dir() and (entry / MARKER).is_file():
            final = root / step_dir_name(int(m.group(1)))
            if not (final / MARKER).is_file():
                if final.exists():
                    shutil.rmtree(final, ignore_errors=True)  # marker-less: an interrupted save
                os.replace(entry, final)
    for entry in root.iterdir():
        if not entry.is_dir():
            continue
        if _GARBAGE.match(entry.name) or (_FINAL.match(entry.name) and not (entry / MARKER).is_file()):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def prune(root: str | os.PathLike, keep: int, *, protect: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """Keep the ``keep`` complete checkpoints with the highest steps; delete the others
    (never one in ``protect``). ``keep <= 0`` keeps everything."""
    if not keep or keep <= 0:
        return []
    protected = {Path(p).resolve() for p in protect}
    found = list_checkpoints(root)
    removed = []
    for _, path in found[: max(0, len(found) - keep)]:
        if path.resolve() in protected:
            continue
        # rename first so a crash mid-delete leaves garbage, never a marker-less "step_" dir
        doomed = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:8]}")
        _DOOMED.add(doomed.name)  # before the rename: an interrupt in between leaves nothing unknown
        os.replace(path, doomed)
        _delete(doomed)
        removed.append(path)
    _sweep_old(Path(root))
    return removed


#: names of the ``step_<k>.old-<hex>`` directories this process renamed away to delete them (a
#: pruned checkpoint, or the one a save of the same step replaced) and has not finished deleting:
#: a Ctrl-C inside the deletion left them half deleted until the next Checkpointer's cleanup()
_DOOMED: set[str] = set()


def _delete(doomed: Path) -> None:
    shutil.rmtree(doomed, ignore_errors=True)
    if not doomed.exists():
        _DOOMED.discard(doomed.name)


def _sweep_old(root: Path) -> list[Path]:
    """Delete the ``*.old-*`` leftovers in ``root`` that are garbage for certain (one directory
    listing; called by every save and prune): those this process renamed away itself (an interrupt
    stopped their deletion), those without a ``COMPLETE`` marker (half deleted), and those of a
    step whose complete checkpoint is in place. Kept: a complete ``step_<k>.old-*`` with no
    ``step_<k>``, which may be the one good checkpoint of a save that another process is swapping
    in right now (it puts the old one back when its rename fails); ``*.tmp-*`` directories, which
    may be saves in progress, are never touched here (see :func:`cleanup`)."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        m = _GARBAGE.match(entry.name)
        if not m or m.group(2) != "old" or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if (entry.name in _DOOMED or not (path / MARKER).is_file()
                or (root / step_dir_name(int(m.group(1))) / MARKER).is_file()):
            _delete(path)
            removed.append(path)
    return removed


ABANDONED = "abandoned"


def _set_aside_newer(root: Path, step: int) -> list[Path]:
    """Move the checkpoints of an abandoned timeline (steps > ``step``, and ``step`` itself when
    there are such) into ``root/abandoned/``; returns their new paths. See :func:`save`."""
    found = list_checkpoints(root)
    if not any(s > step for s, _ in found):
        return []
    stale = [p for s, p in found if s >= step]
    where = root / ABANDONED
    where.mkdir(exist_ok=True)
    moved = []
    for path in stale:
        target, n = where / path.name, 1
        while target.exists():  # an earlier rollback left one of the same step: keep both
            n += 1
            target = where / f"{path.name}-{n}"
        os.replace(path, target)
        moved.append(target)
    _fsync_dir(root)
    warnings.warn(
        f"saving step {step} into {root}, which holds checkpoints of later steps ({', '.join(p.name for p in stale)}): "
        f"they belong to a timeline this run left (it was restored from an older checkpoint, or started afresh here), "
        f"so they were moved to {where} ({', '.join(p.name for p in moved)}), where resume('auto') and keep-pruning "
        f"do not look; restore one explicitly by its path if you need it",
        RuntimeWarning, stacklevel=3,
    )
    return moved


def _step_of(path: Path) -> tuple[int, bool] | None:
    """(step, whether ``path`` is a leftover ``step_<k>.tmp-*`` / ``.old-*``) from a checkpoint
    folder's name, or None for another name."""
    m = _FINAL.match(path.name)
    if m:
        return int(m.group(1)), False
    m = _GARBAGE.match(path.name)
    return (int(m.group(1)), True) if m else None


def _damage(path: Path, checksum: bool = True) -> str | None:
    """What :func:`verify` (the test ``resume("auto")`` picks a checkpoint by) finds wrong with the
    checkpoint ``path``, its first problem, or None when it is complete. Checked by this process
    alone, without verify's collective: for the advice in an error message, which every rank
    builds on its own (on a shared folder they all find the same)."""
    if not (path / MARKER).is_file():
        return f"no {MARKER} marker"
    try:
        with open(path / MARKER, encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or not files:
            return f"its {MARKER} lists no files"
        problems = _file_problems(path, files, checksum)
    except (OSError, ValueError, AttributeError, TypeError) as exc:  # unreadable or malformed manifest
        return f"its {MARKER} cannot be read ({type(exc).__name__}: {exc})"
    return problems[0] if problems else None


#: off inside resume("auto"), which goes on to the older checkpoints itself (verifying each) and
#: keeps only the first clause of a corrupt one's message: the advice would check them twice
_ADVISE = contextvars.ContextVar("rlkit_checkpoint_advise", default=True)


def _try_previous(path: Path, checksum: bool = True) -> str:
    """What to resume from instead of the broken checkpoint ``path``: the newest complete
    checkpoint next to it of an earlier step (of the same step too, for a leftover
    ``step_<k>.tmp-*`` or ``.old-*``), checked as ``resume("auto")`` checks it; it suggested the
    previous one by name alone, which could be broken too, and for a leftover folder said there was
    none."""
    if not _ADVISE.get():
        return "resume('auto') tries the older checkpoints"
    found = _step_of(path)
    older = []
    if found is not None:
        step, leftover = found
        older = [p for s, p in list_checkpoints(path.parent) if (s <= step if leftover else s < step) and p != path]
    if not older:
        return "there is no older checkpoint next to it: start a fresh run (a new --out directory, or no --resume)"
    damaged = []
    for prev in reversed(older):
        problem = _damage(prev, checksum)
        if problem is not None:
            damaged.append((prev, problem))
            continue
        use = f"`--resume {prev}` or `checkpointer.restore(state, path='{prev}')`"
        if not damaged:
            return f"resume from the previous checkpoint instead ({prev}, e.g. {use}) and delete the broken one"
        return (f"resume from the newest complete checkpoint before it instead ({prev}, e.g. {use}; the newer "
                f"{_listed(damaged)} {'is' if len(damaged) == 1 else 'are'} damaged too) and delete the broken ones")
    return (f"none of the {len(older)} older checkpoint(s) next to it is complete either ({_listed(damaged)}): start "
            f"a fresh run (a new --out directory, or no --resume), or repair one")


def _listed(damaged: list[tuple[Path, str]]) -> str:
    shown = "; ".join(f"{p.name}: {problem}" for p, problem in damaged[:3])
    return shown + (f"; and {len(damaged) - 3} more" if len(damaged) > 3 else "")


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint meant by ``path``: a ``step_*`` directory itself, the newest one in a
    checkpoints root, or in ``<path>/checkpoints`` (a ``rlkit run --out`` directory)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(
            f"checkpoint path {str(p)!r} does not exist; give a step_* checkpoint directory, the checkpoints directory "
            f"that holds them, or use --resume auto to start fresh when there is none"
        )
    if not p.is_dir():
        raise CheckpointNotFoundError(f"checkpoint path {str(p)!r} is a file; give a step_* checkpoint directory or its parent")
    if (p / MARKER).is_file() or (p / ".metadata").is_file() or _FINAL.match(p.name) or _GARBAGE.match(p.name):
        return p  # a checkpoint directory, complete or not (load says which)
    for root in (p, p / "checkpoints"):
        newest = latest(root)
        if newest is not None:
            return newest
    raise CheckpointNotFoundError(
        f"no complete checkpoint in {str(p)!r} (looked for step_*/{MARKER} there and in its checkpoints/ folder); "
        "an interrupted save leaves no marker and is ignored. Use --resume auto to start fresh when there is none"
    )


# --------------------------------------------------------------------------- state <-> dicts
def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional
        pass
    # never initialise CUDA just to read its RNG
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np

            np.random.set_state(state["numpy"])
        except ImportError:
            pass
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _config_of(model: torch.nn.Module) -> dict[str, Any] | None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    return json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str))


def config_hash(config: dict[str, Any] | None) -> str | None:
    """sha256 of a model config (as JSON), ignoring keys that vary between equal models."""
    if config is None:
        return None
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _describe(model: torch.nn.Module) -> dict[str, Any]:
    # DTensor.shape is the global shape, so the description does not depend on the world size
    sd = model.state_dict()
    config = _config_of(model)
    return {
        "class": type(model).__name__,
        "config": config,
        "config_hash": config_hash(config),
        "parameters": {k: list(v.shape) for k, v in sd.items()},
        "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in sd.items()},
        "numel": int(sum(v.numel() for v in sd.values())),
    }


def _roles(state: TrainState, save_ref: bool) -> list[str]:
    roles = ["actor"]
    if state.critic is not None:
        roles.append("critic")
    if save_ref and state.ref is not None:
        roles.append("ref")
    return roles


def _sd_options(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=False, strict=strict)


def _model_optim_sd(model, optimizer) -> tuple[dict, dict | None, dict]:
    """(model state dict, optimizer state dict or None, info) in DCP's FQN-keyed form.

    An optimizer that never stepped has no state, and DCP's ``get_state_dict`` would create it
    with a fake zero-lr step (AdamW ``step`` = 1), which changes the bias correction of the run's
    first real step. So such an optimizer is saved as its param-group hyperparameters only, and
    restored empty: the resumed run takes the same first step as the uninterrupted one.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return get_model_state_dict(model, options=_sd_options()), None, {"initialized": False, "param_groups": None}
    if not optimizer.state:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return get_model_state_dict(model, options=_sd_options()), None, {"initialized": False, "param_groups": groups}
    msd, osd = get_state_dict(model, optimizer, options=_sd_options())
    return msd, osd, {"initialized": True, "param_groups": None}


def _trains_here(state: TrainState) -> bool:
    """False on a split placement's generation ranks. Their actor is an untrained full copy and
    their optimizer never steps (the training ranks hold the run's weights, as FSDP shards): saved
    too, DCP wrote part of the actor from them, and a resumed run got initial weights for about
    half the tensors. They neither save nor load the trained models; their engine receives the
    weights from the training ranks at the next rollout, as after every update."""
    split = state._cache.get("split")
    return split is None or torch.distributed.get_rank() in split.actor_ranks


def _state_dict(state: TrainState, save_ref: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DCP state dict of ``state`` (tensors by reference, no copies) and the trainer values."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd: dict[str, Any] = {}
    trainer: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "step": int(state.step),
        "policy_version": int(state.policy_version),
        "seed": int(state.seed),
        "data_position": int(state.data_position),
        "extras": dict(state.extras),
        "optimizer_spec": state.optimizer_spec.to_dict() if state.optimizer_spec is not None else None,
        "critic_optimizer_spec": state.critic_optimizer_spec.to_dict() if state.critic_optimizer_spec is not None else None,
        "optimizers": {},
        "schedulers": {},
    }
    trains = _trains_here(state)
    for model_key, opt_key, sched_key in _TRAINED:
        model = getattr(state, model_key)
        if model is None or not trains:
            continue
        optimizer = getattr(state, opt_key)
        msd, osd, info = _model_optim_sd(model, optimizer)
        sd[model_key] = msd
        if osd is not None:
            sd[opt_key] = osd
        trainer["optimizers"][opt_key] = info
        scheduler = getattr(state, sched_key)
        trainer["schedulers"][sched_key] = scheduler.state_dict() if scheduler is not None else None
    split = state._cache.get("split")
    if split is not None:
        # the trainer values of the training ranks: DCP writes the bytes leaf from rank 0, which
        # a placement may have made a generation rank
        parts = [(trainer["optimizers"], trainer["schedulers"])]
        torch.distributed.broadcast_object_list(parts, src=split.actor_ranks[0])
        trainer["optimizers"], trainer["schedulers"] = parts[0]
    if save_ref and state.ref is not None and trains:
        sd["ref"] = get_model_state_dict(state.ref, options=_sd_options())
    # python values as opaque bytes leaves: DCP writes them once (rank 0) and never flattens them
    sd["trainer"] = pickle.dumps(trainer)
    sd[f"rng.rank{_rank()}"] = pickle.dumps(_rng_state())
    return sd, trainer


# --------------------------------------------------------------------------- manifest
def _sha256(path: Path) -> str:
    # read in 1 MiB blocks: hashlib.file_digest is Python 3.11+, and rlkit supports 3.10 (every
    # checksummed save failed there with an AttributeError)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some file systems cannot fsync a directory; the rename is still atomic
        pass


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)  # insertion order: parameters as in the model
        f.flush()
        os.fsync(f.fileno())


def _hash_files(directory: Path, names: list[str], checksum: bool) -> dict[str, dict[str, Any]]:
    """Sizes (and sha256) of ``names``; the hashing is split over the ranks."""
    rank, world = _rank(), _world()
    mine = {}
    for i, name in enumerate(names):
        if i % world == rank:
            path = directory / name
            mine[name] = {"bytes": path.stat().st_size, **({"sha256": _sha256(path)} if checksum else {})}
    merged: dict[str, dict[str, Any]] = {}
    for part in _all_gather(mine):
        merged.update(part)
    return merged


def _write_meta(directory: Path, meta: dict[str, Any]) -> None:
    _write_json(directory / META, meta)


def _write_marker(directory: Path, manifest: dict[str, Any]) -> None:
    _write_json(directory / MARKER, manifest)


# --------------------------------------------------------------------------- save
def save(
    state: TrainState,
    root: str | os.PathLike,
    step: int | None = None,
    *,
    keep: int | None = None,
    checksum: bool = True,
    save_ref: bool = True,
) -> Path:
    """Write ``state`` to ``root/step_<step>`` atomically; returns that path.

    ``step``, when given, must equal ``state.step`` (a checkpoint is named by the step it restores;
    to save under another step, pass ``state.replace(step=k)``). ``keep``: afterwards keep only the newest ``keep``
    checkpoints (None: keep all). ``checksum``: record each file's sha256 in the manifest (sizes
    are always recorded). A collective on N processes: every rank must call it.
    An existing checkpoint of the same step is replaced (after the new one is complete; kept when
    the swap fails).

    Timelines: checkpoints of steps above ``step`` can only come from a run this one abandoned
    (it was restored from an older checkpoint, or started afresh in the same directory). Left in
    place they would be what ``resume("auto")`` picks and what keep-last-N spares, while this run's
    own checkpoints were pruned. So they, and the old checkpoint of ``step`` itself, are moved
    (not deleted) into ``root/abandoned/`` with a warning, just before the new one is put in place.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"save expects a TrainState, got {type(state).__name__}")
    state._check()
    import torch.distributed.checkpoint as dcp

    if step is not None:
        int_at_least(step, "step", 0, " (the checkpoint's step; None: state.step)")
        if step != state.step:
            # the directory and manifest would say `step` while load restores state.step
            raise ValueError(f"save: step={step} differs from state.step={state.step}; a checkpoint restores the state's "
                             f"own step, so omit step (or pass state.replace(step={step}) to save it as step {step})")
    if keep is not None:
        int_at_least(keep, "keep", 0, " or None (how many checkpoints to keep; 0 or None: every one)")
    if not isinstance(root, (str, os.PathLike)):
        raise ValueError(f"root must be a path (str or os.PathLike), got {type(root).__name__} {root!r}")
    step = int(state.step if step is None else step)
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ValueError(f"root {str(root)!r} is a file, not a folder; give the checkpoints folder (it is created when missing)")
    name = step_dir_name(step)
    with _waiting_for_ranks("save"):
        tmp = root / f"{name}.tmp-{_broadcast(uuid.uuid4().hex[:12])}"
    final = root / name
    if _rank() == 0:
        tmp.mkdir(parents=True)
    _barrier()
    swapping = False  # from here on the checkpoints already in root are renamed (see _save_failed)
    try:
        sd, trainer = _state_dict(state, save_ref)
        with _quiet_dcp(), _interrupts_unwrapped():
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True), no_dist=not _distributed())
        del sd
        if _rank() == 0:
            import rlkit

            meta = {
                "format": FORMAT_VERSION,
                "rlkit_version": getattr(rlkit, "__version__", "unknown"),
                "torch_version": torch.__version__,
                "step": step,
                "policy_version": trainer["policy_version"],
                "data_position": trainer["data_position"],
                "world_size": _world(),
                "created_unix": time.time(),
                "optimizer_spec": trainer["optimizer_spec"],
                "models": {role: _describe(getattr(state, role)) for role in _roles(state, save_ref)},
            }
            _write_meta(tmp, meta)
        _barrier()
        names = _broadcast(sorted(p.name for p in tmp.iterdir() if p.is_file()) if _rank() == 0 else None)
        files = _hash_files(tmp, names, checksum)
        if _rank() == 0:
            _write_marker(tmp, {"format": FORMAT_VERSION, "step": step, "files": files})
            _fsync_dir(tmp)
            swapping = True
            # before the rename: a crash in between never leaves the abandoned ones as "latest"
            _set_aside_newer(root, step)
            old = None
            if final.exists():
                # replaced only now that the new one is complete (a checkpoint of this step from a
                # run that left it, or an earlier save of this very step)
                old = final.with_name(f"{name}.old-{uuid.uuid4().hex[:8]}")
                os.replace(final, old)
            try:
                os.replace(tmp, final)
            except BaseException:
                if old is not None and not final.exists():
                    os.replace(old, final)  # never leave the step without its one good checkpoint
                raise
            _fsync_dir(root)
            if old is not None:
                _DOOMED.add(old.name)
                _delete(old)
            if keep:
                prune(root, keep, protect=[final])  # sweeps too
            else:
                _sweep_old(root)  # what an interrupted deletion left (the Checkpointer lives on)
        _barrier()
    except BaseException as exc:
        # an exception (disk full, a bug) cleans up after itself; a hard kill leaves the .tmp-
        # directory, which latest() ignores and the next Checkpointer deletes
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        failed = None if swapping else _save_failed(exc, final, tmp)
        if failed is None:
            raise
        raise failed from exc
    return final


def _save_failed(exc: BaseException, final: Path, tmp: Path) -> CheckpointSaveError | None:
    """The :class:`CheckpointSaveError` that a failure ``exc`` of writing checkpoint ``final``
    becomes, or None for what goes on as it is: an interrupt (``KeyboardInterrupt``,
    ``SystemExit``), rlkit's own errors, and anything but DCP's ``CheckpointException`` or an
    ``OSError``. Only called for failures before the swap, so "the earlier checkpoints are intact"
    holds: up to the COMPLETE marker a save writes only into its own ``tmp`` (removed by then), and
    nothing in the folder has been renamed yet."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, (KeyboardInterrupt, SystemExit, CheckpointError)):
        return None
    if isinstance(exc, CheckpointException):
        failures = getattr(exc, "failures", {}) or {}
        causes = [(rank, pair[0] if isinstance(pair, tuple) else pair) for rank, pair in sorted(failures.items())]
        causes = [(rank, e) for rank, e in causes if isinstance(e, BaseException)]
        if not causes:
            rank, cause = None, exc
        else:
            rank, cause = causes[0]
            rank = rank if _world() > 1 else None
    elif isinstance(exc, OSError):
        rank, cause = None, exc
    else:
        return None
    reason = _last_line(cause) + (f" (on rank {rank})" if rank is not None else "")
    root = final.parent
    previous = latest(root)
    kept = (f"the earlier checkpoints in {root} are intact (the newest complete one: {previous.name}; resume from "
            f"it, e.g. `--resume auto` or `checkpointer.resume(state, 'auto')`)" if previous is not None
            else f"there is no earlier complete checkpoint in {root}")
    full = " (free space on that disk first)" if getattr(cause, "errno", None) in _DISK_FULL else ""
    partial = (f"its partial folder {tmp.name} was removed" if _rank() != 0 or not tmp.exists()
               else f"its partial folder {tmp} could not be removed: delete it, or let the next Checkpointer do it")
    error = CheckpointSaveError(
        f"saving checkpoint {final} failed: {reason}. The partial save is discarded ({partial}) and {kept}; fix the "
        f"cause{full} and save again",
        path=final, reason=reason, previous=previous,
    )
    if isinstance(getattr(cause, "errno", None), int):
        error.errno = cause.errno  # `except OSError as e: if e.errno == errno.ENOSPC` sees the full disk
    return error


# --------------------------------------------------------------------------- load
def _read_json(path: Path, what: str, checkpoint: Path, checksum: bool = True) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint {checkpoint} has no {path.name} ({what}); the checkpoint is incomplete: {_try_previous(checkpoint, checksum)}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"checkpoint {checkpoint}: file {path.name} ({what}) is corrupted ({exc}); {_try_previous(checkpoint, checksum)}") from None


def verify(path: str | os.PathLike, *, checksum: bool = True) -> dict[str, Any]:
    """Check every file of the manifest exists with its size (and sha256); returns the manifest.

    Raises :class:`CheckpointCorruptError` naming the first bad file and the previous checkpoint.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if not (path / MARKER).is_file():
        raise CheckpointCorruptError(
            f"checkpoint {path} has no {MARKER} marker: its save was interrupted, so it may be partial; {_try_previous(path, checksum)}"
        )
    manifest = _read_json(path / MARKER, "the manifest", path, checksum)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise CheckpointCorruptError(f"checkpoint {path}: {MARKER} lists no files; {_try_previous(path, checksum)}")
    problems = _file_problems(path, files, checksum, _rank(), _world())
    problems = sorted(p for part in _all_gather(problems) for p in part)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise CheckpointCorruptError(f"checkpoint {path} is corrupted: {problems[0]}{more}; {_try_previous(path, checksum)}")
    return manifest


def _file_problems(path: Path, files: dict[str, Any], checksum: bool, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with the files of the manifest ``files`` in ``path``: missing, another size, or
    (``checksum``) another sha256; only every ``world``-th file from ``rank`` (verify splits them)."""
    problems = []
    for i, (name, expect) in enumerate(sorted(files.items())):
        if i % world != rank:
            continue
        file = path / name
        if not file.is_file():
            problems.append(f"file {name} is missing")
            continue
        size = file.stat().st_size
        if size != expect.get("bytes"):
            problems.append(f"file {name} has {size} bytes but the manifest says {expect.get('bytes')} (truncated or overwritten)")
        elif checksum and "sha256" in expect and _sha256(file) != expect["sha256"]:
            problems.append(f"file {name} fails its sha256 checksum (its contents changed after the save)")
    return problems


def _fmt_shape(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def _validate(template: TrainState, meta: dict[str, Any], path: Path, save_ref: bool) -> None:
    """Raise :class:`CheckpointMismatchError` when the checkpoint does not fit ``template``."""
    saved = meta.get("models", {})
    for role in ("actor", "critic", "ref"):
        model = getattr(template, role)
        if role == "ref" and not save_ref:
            continue
        if model is None:
            if role == "critic" and role in saved:
                raise CheckpointMismatchError(
                    f"checkpoint {path} has a critic (value model) but the state has none; build the state with "
                    f"critic=rk.models.critic(model) (the checkpoint is from a PPO-style run), or resume a checkpoint of this algorithm"
                )
            continue
        if role not in saved:
            what = {"critic": "a critic (value model)", "ref": "a reference model"}.get(role, role)
            raise CheckpointMismatchError(
                f"the state has {what} but checkpoint {path} does not (it was saved without one); "
                f"build the state as in the saved run (e.g. the same --kl / --algo), or start a fresh run"
            )
        mine = _describe(model)
        theirs = saved[role]
        problems = []
        for key, shape in theirs["parameters"].items():
            if key not in mine["parameters"]:
                problems.append(f"parameter {role}.{key} (shape {_fmt_shape(shape)}) is in the checkpoint but not in the model")
            elif list(mine["parameters"][key]) != list(shape):
                problems.append(
                    f"parameter {role}.{key} has shape {_fmt_shape(shape)} in the checkpoint but {_fmt_shape(mine['parameters'][key])} in the model"
                )
        for key, shape in mine["parameters"].items():
            if key not in theirs["parameters"]:
                problems.append(f"parameter {role}.{key} (shape {_fmt_shape(shape)}) of the model is missing from the checkpoint")
        if problems:
            cfg = theirs.get("config") or {}
            arch = ", ".join(f"{k}={cfg[k]}" for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size") if k in cfg)
            more = f" ({len(problems) - 1} more mismatch(es))" if len(problems) > 1 else ""
            raise CheckpointMismatchError(
                f"checkpoint {path} was saved from a different model ({theirs['class']}{': ' + arch if arch else ''}) "
                f"than this state's {role} ({mine['class']}): {problems[0]}{more}. Build the model with the checkpoint's "
                f"architecture, or resume from a checkpoint of this model / start a fresh run (a new --out)"
            )
        _check_tied_embeddings(model, role, theirs.get("config") or {}, mine["config"] or {}, path)
        if theirs.get("config_hash") and mine["config_hash"] and theirs["config_hash"] != mine["config_hash"]:
            a, b = theirs.get("config") or {}, mine["config"] or {}
            diff = sorted(k for k in set(a) | set(b) if k not in _VOLATILE_CONFIG_KEYS and a.get(k) != b.get(k))
            warnings.warn(
                f"checkpoint {path}: the {role}'s config differs from the model's in {diff[:8]} "
                f"(e.g. {diff[0]}={a.get(diff[0])!r} saved, {b.get(diff[0])!r} now); parameter shapes match, loading anyway" if diff else
                f"checkpoint {path}: the {role}'s config hash differs; parameter shapes match, loading anyway",
                RuntimeWarning, stacklevel=3,
            )
        dtypes = [k for k, d in theirs.get("dtypes", {}).items() if mine["dtypes"].get(k, d) != d]
        if dtypes:
            k = dtypes[0]
            warnings.warn(
                f"checkpoint {path}: {role}.{k} was saved as {theirs['dtypes'][k]} but the model holds {mine['dtypes'][k]} "
                f"({len(dtypes)} tensor(s) differ); values are cast on load, so the resume is not exact",
                RuntimeWarning, stacklevel=3,
            )


def _check_tied_embeddings(model: torch.nn.Module, role: str, saved: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    """Raise :class:`CheckpointMismatchError` for a checkpoint of untied input and output embeddings
    loaded into a model that ties them. Their parameter lists look alike (a tied model's state dict
    names the one shared matrix twice), so this warned "config differs in ['tie_word_embeddings']
    ... loading anyway" and then failed inside DCP ("Missing optimizer state for parameter
    'lm_head.weight'"); without optimizer state it would load both saved matrices into the one
    shared tensor, the last one winning. The other direction (a tied checkpoint into an untied
    model: both matrices get the saved one) loads correctly and is left alone."""
    if saved.get("tie_word_embeddings") is not False or now.get("tie_word_embeddings") is not True:
        return
    out = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if out is None:
        return  # no output embeddings to tie (a critic's value head): the setting does not matter
    raise CheckpointMismatchError(
        f"checkpoint {path} was saved from a model with untied embeddings (tie_word_embeddings=False: the output "
        f"projection lm_head.weight is a matrix of its own) but this state's {role} ties them (tie_word_embeddings=True: "
        f"lm_head.weight is the input embedding matrix), which cannot hold both saved matrices. Build the model with "
        f"tie_word_embeddings=False (e.g. rk.models.tiny(..., tie_word_embeddings=False), or "
        f"from_pretrained(..., tie_word_embeddings=False)), as in the saved run"
    )


def load(
    template: TrainState,
    path: str | os.PathLike,
    *,
    checksum: bool = True,
    load_ref: bool = True,
) -> TrainState:
    """Load checkpoint ``path`` into ``template``; returns a NEW state (template is donated).

    ``template`` is a freshly built state of the same structure (same model architecture,
    optimizer, scheduler, critic and ref presence); its modules, optimizers and schedulers are
    loaded in place (so FSDP2 sharding and the cached rollout engine stay valid), and the returned
    state carries the saved ``step``, ``policy_version``, ``seed``, ``data_position`` and
    ``extras``. The template handle is donated (it would otherwise alias the loaded weights with
    step 0). ``path`` may be a step_* directory, a checkpoints root or a run directory
    (see :func:`resolve`). ``checksum=False`` checks file sizes only.
    """
    if not isinstance(template, TrainState):
        raise TypeError(f"load expects a TrainState template (build one with rk.init like the saved run), got {type(template).__name__}")
    template._check()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = resolve(path)
    verify(path, checksum=checksum)
    meta = _read_json(path / META, "model description", path, checksum)
    _validate(template, meta, path, load_ref)

    # DCP wraps a read failure in CheckpointException, a BaseException in torch 2.13: caught with
    # Exception below, so a broken checkpoint is reported as one (and resume("auto") falls back)
    from torch.distributed.checkpoint.api import CheckpointException

    rng_key = f"rng.rank{_rank()}"
    # a b"" placeholder tells DCP which bytes leaves to read; it replaces them with the saved objects
    trainer_probe: dict[str, Any] = {"trainer": b""}
    try:
        saved_keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        with _quiet_dcp(), _interrupts_unwrapped():
            dcp.load(trainer_probe, storage_reader=dcp.FileSystemReader(str(path)), no_dist=not _distributed())
        trainer = pickle.loads(trainer_probe["trainer"])
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any read failure means a broken file
        raise CheckpointCorruptError(f"checkpoint {path}: cannot read the trainer state ({type(exc).__name__}: {exc}); {_try_previous(path, checksum)}") from exc
    sd: dict[str, Any] = {}
    if rng_key in saved_keys:
        sd[rng_key] = b""

    specs = _governing_specs(template, trainer, path)
    trains = _trains_here(template)
    # the saved spec's parameter groups (no_decay) when they differ from the template's: its
    # optimizer state and schedule have one entry per group
    rebuilt = _regroup(template, specs) if trains else {}

    def current(key: str):
        return rebuilt[key] if key in rebuilt else getattr(template, key)

    plans = []
    for model_key, opt_key, sched_key in _TRAINED:
        model = getattr(template, model_key)
        if model is None or not trains:
            continue
        optimizer = current(opt_key)
        info = trainer["optimizers"].get(opt_key, {"initialized": False, "param_groups": None})
        if optimizer is not None and info["initialized"]:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            # an empty template optimizer is initialised by DCP (zero-lr step), then overwritten
            sd[model_key], sd[opt_key] = get_state_dict(model, optimizer, options=_sd_options())
            _warn_unused_masters(sd[opt_key], opt_key, saved_keys, optimizer, path)
            info = {**info, "partial": _keep_saved_optimizer_state(sd[opt_key], opt_key, saved_keys)}
        else:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            sd[model_key] = get_model_state_dict(model, options=_sd_options())
        plans.append((model_key, opt_key, sched_key, info))
    if load_ref and template.ref is not None and trains:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd["ref"] = get_model_state_dict(template.ref, options=_sd_options())
    try:
        with _quiet_dcp(), _interrupts_unwrapped():
            dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)), no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's wrapper is a BaseException in torch 2.13
        raise CheckpointCorruptError(f"checkpoint {path}: reading the tensors failed ({_last_line(exc)}); {_try_previous(path, checksum)}") from exc

    for model_key, opt_key, sched_key, info in plans:
        model, optimizer = getattr(template, model_key), current(opt_key)
        if optimizer is not None and info["initialized"] and info.get("partial"):
            # a parameter without saved state (no gradient before the save): DCP refuses that unless
            # not strict; the model itself still loads strictly
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_model_state_dict(model, sd[model_key], options=_sd_options())
            set_optimizer_state_dict(model, optimizer, sd[opt_key], options=_sd_options(strict=False))
        elif optimizer is not None and info["initialized"]:
            set_state_dict(model, optimizer, model_state_dict=sd[model_key], optim_state_dict=sd[opt_key], options=_sd_options())
        else:
            set_model_state_dict(model, sd[model_key], options=_sd_options())
            if optimizer is not None:
                optimizer.state.clear()  # the saved optimizer never stepped: no moments, step 0
                for group, saved in zip(optimizer.param_groups, info.get("param_groups") or []):
                    group.update(saved)
        scheduler = current(sched_key)
        saved_sched = trainer["schedulers"].get(sched_key)
        if scheduler is not None and saved_sched is not None:
            scheduler.load_state_dict(saved_sched)
            spec = specs.get(_SPEC_OF[model_key])
            if spec is not None and hasattr(scheduler, "lr_lambdas"):
                # the schedule's shape is a function, which LambdaLR does not save: the saved spec's
                scheduler.lr_lambdas = [spec.lr_factor for _ in scheduler.lr_lambdas]
    if "ref" in sd:
        set_model_state_dict(template.ref, sd["ref"], options=_sd_options())
    if rng_key in sd:
        _set_rng_state(pickle.loads(sd[rng_key]))

    if trainer["seed"] != template.seed:
        warnings.warn(f"checkpoint {path} was saved with seed={trainer['seed']} but the state has seed={template.seed}; "
                      "using the checkpoint's seed so the run continues exactly", RuntimeWarning, stacklevel=2)
    engine = template._cache.get("engine")
    if engine is not None:
        # an engine built before the load may hold a copy of the template's weights: force a sync
        engine.policy_version = -1
    if "synced_version" in template._cache:
        # split placement: the rollout ranks load no model (their engine gets the actor ranks'
        # weights); a checkpoint whose policy_version equalled the last one sent sampled from the
        # template's weights until the first update
        template._cache["synced_version"] = None
    restored = template.replace(
        step=trainer["step"],
        policy_version=trainer["policy_version"],
        seed=trainer["seed"],
        data_position=trainer["data_position"],
        extras=dict(trainer["extras"]),
        **specs,
        **rebuilt,
    )
    template.donate("rlkit.checkpoint.load", restored)
    return restored


def _keep_saved_optimizer_state(osd: dict[str, Any], opt_key: str, saved_keys: set[str]) -> bool:
    """Drop from the template's optimizer state dict ``osd`` (DCP's FQN-keyed form) the entries the
    checkpoint does not have, so that DCP reads only what was saved: the state of a parameter that
    had no gradient yet when the run saved (its AdamW state is created at its first step, as in the
    run that saved), and a float32 master copy (:class:`rlkit.optim.MasterWeightAdamW`) that a run
    of float32 weights never had (it is taken from the loaded parameter at the next step). Both
    used to fail the load as a corrupt checkpoint ("Missing key in checkpoint state_dict").
    Returns whether a parameter was left without any state."""
    state = osd.get("state")
    if not isinstance(state, dict):
        return False
    emptied = False
    for fqn in list(state):
        entries = state[fqn]
        for key in list(entries):
            if f"{opt_key}.state.{fqn}.{key}" not in saved_keys:
                del entries[key]
        if not entries:
            del state[fqn]
            emptied = True
    return emptied


def _warn_unused_masters(osd: dict[str, Any], opt_key: str, saved_keys: set[str], optimizer, path: Path) -> None:
    """Warn when the checkpoint holds float32 master copies (:class:`rlkit.optim.MasterWeightAdamW`,
    the default for bf16/fp16 weights) that the template's optimizer has no place for (FSDP-sharded
    parameters, where master weights are refused: FSDP's mixed precision replaces them). DCP reads
    only the keys the template asks for, so they were dropped without a word, and the run went on
    from the rounded bf16 weights instead of the float32 ones it saved. ``osd``: the template's
    optimizer state dict (DCP's FQN-keyed form)."""
    state = osd.get("state")
    if not isinstance(state, dict):
        return
    unused = [fqn for fqn, entries in state.items()
              if "master" not in entries and f"{opt_key}.state.{fqn}.master" in saved_keys]
    if not unused:
        return
    warnings.warn(
        f"checkpoint {path}: its {opt_key} holds float32 master copies of {len(unused)} low-precision parameter(s) "
        f"(e.g. {unused[0]}; saved with rk.optim.MasterWeightAdamW, the default for bf16/fp16 weights), but this "
        f"state's optimizer ({type(optimizer).__name__}) keeps none (e.g. FSDP-sharded parameters, where master weights "
        f"are refused): the float32 master copies in the checkpoint are not used, and the run continues from the "
        f"bf16 weights (the master copies rounded), so the resume is not exact. For an exact resume, restore it with "
        f"the layout it was saved with; on FSDP, train a float32 model with mixed_precision=True instead",
        RuntimeWarning, stacklevel=3,
    )


def _last_line(exc: BaseException) -> str:
    """``Type: last line`` of an exception whose message may be a traceback (DCP puts each rank's
    there, the cause on its last line, which cutting the text at a length dropped)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1][:400] if lines else ''}"


def _regroup(template: TrainState, specs: dict[str, Any]) -> dict[str, Any]:
    """Optimizers and schedulers rebuilt from a governing saved spec whose ``no_decay`` or
    ``master_weights`` differs from the template's (so their parameter groups, and the float32
    master copies, match the saved state), by TrainState field."""
    out: dict[str, Any] = {}
    for model_key, opt_key, sched_key in _TRAINED:
        spec, model = specs.get(_SPEC_OF[model_key]), getattr(template, model_key)
        given = getattr(template, _SPEC_OF[model_key]) or (template.optimizer_spec if model_key == "critic" else None)
        if (spec is None or model is None or getattr(template, opt_key) is None or given is None
                or (spec.no_decay, spec.master_weights) == (given.no_decay, given.master_weights)):
            continue
        out[opt_key], out[sched_key] = spec.build(model)
    return out


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


#: the TrainState field holding the optimizer spec of each trained role
_SPEC_OF = {"actor": "optimizer_spec", "critic": "critic_optimizer_spec"}


def _governing_specs(template: TrainState, trainer: dict[str, Any], path: Path) -> dict[str, Any]:
    """The saved optimizer specs that differ from the template's, by TrainState field, warning once
    per spec with each differing field's saved and given value.

    The checkpoint's spec governs entirely: its optimizer state already brings the saved learning
    rate, weight decay and betas, and its scheduler state the saved base LR and step count, so the
    schedule's shape is rebuilt from the saved spec too, and the returned state reports the saved
    spec (which the next checkpoint stores). Mixing them (the saved base LR on the given spec's
    decay) made the LR jump, with a state that reported a spec its optimizer did not follow."""
    from rlkit.optim import OptimizerSpec

    known = {f.name for f in dataclasses.fields(OptimizerSpec)}
    # a field added since the checkpoint was written has its default there
    defaults = {f.name: f.default for f in dataclasses.fields(OptimizerSpec) if f.default is not dataclasses.MISSING}
    out: dict[str, Any] = {}
    for field in _SPEC_OF.values():
        given, saved = getattr(template, field), trainer.get(field)
        if saved is not None:
            saved = {**defaults, **saved}
        if given is None or saved is None or _jsonable(given.to_dict()) == _jsonable(saved):
            continue
        values = {k: v for k, v in saved.items() if k in known}
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        out[field] = OptimizerSpec(**values)
        now = given.to_dict()
        diff = [k for k in now if _jsonable(now.get(k)) != _jsonable(saved.get(k))]
        warnings.warn(
            f"checkpoint {path}: the state's {field} differs from the saved one in "
            + ", ".join(f"{k} (saved {saved.get(k)!r}, given {now.get(k)!r})" for k in diff)
            + f"; the saved values apply (learning rate, schedule, weight decay, ...), so the run continues as saved, "
            f"and the restored state's {field} is the saved one. To train with the given values instead, start a "
            f"fresh run (rk.init) from the checkpoint's weights",
            RuntimeWarning, stacklevel=3,
        )
    return out


# --------------------------------------------------------------------------- Checkpointer
class Checkpointer:
    """Periodic, atomic checkpoints of a run into ``directory``; resume; save on SIGTERM.

    ``every``: :meth:`maybe_save` saves when ``state.step % every == 0`` (0: no periodic saves;
    SIGTERM, :meth:`save_final` at the end of ``rk.fit`` and explicit :meth:`save` still save). ``keep``: keep the newest ``keep`` checkpoints (0 or None: all).
    ``save_on_sigterm``: while the training loop runs (inside :meth:`armed`, which ``rk.fit``
    enters), a SIGTERM makes the next :meth:`maybe_save` (i.e. the next step boundary) save and
    raise :class:`Preempted` (a ``SystemExit`` with status 143); a second SIGTERM exits at once.
    Outside that window SIGTERM does what it did before (by default: terminate), so a script that
    goes on after ``fit`` stays killable. Creating a Checkpointer deletes leftovers of interrupted
    saves; every save also deletes the ``*.old-*`` directories that an interrupted deletion of a
    pruned or replaced checkpoint left (Ctrl-C, then ``rk.fit`` again with the same Checkpointer),
    so the directory holds only the ``keep`` newest checkpoints. Saving step k moves checkpoints
    of steps >= k aside into ``directory/abandoned/`` (a run restored from an older checkpoint
    starts a new timeline; see :func:`save`).

        ckpt = Checkpointer("run/checkpoints", every=50, keep=3)
        state = ckpt.resume(state, "auto")         # newest checkpoint that verifies, or unchanged
        state, history = rk.fit(state, ..., checkpointer=ckpt)

    A loop of your own arms the handler itself: ``with ckpt.armed(): for ...: ckpt.maybe_save(state)``.

    Several processes: build the Checkpointer on every rank, with the same arguments and the same
    shared ``directory`` (a file system that every rank sees at the same path, not each node's local
    disk), and call :meth:`save`, :meth:`resume`, :meth:`restore` and ``rk.fit(..., checkpointer=)``
    on every rank: they are collectives (every rank saves and loads its own shards). Building it
    does no collective. Its first collective use compares its folder, ``every``, ``keep``,
    ``save_ref`` and ``checksum`` across the ranks, and resume / restore compare the checkpoints
    each rank sees, raising :class:`~rlkit.parallel.agree.RanksDisagreeError` on every rank when
    they differ; ``rk.fit`` names a checkpointer given on some ranks only. A call made on one rank
    only can still only wait: for the process group's timeout, after which it raises a
    :class:`CheckpointError` saying so (or a ``RanksDisagreeError`` at once when the other ranks
    are in another of rlkit's checks); after :data:`WAIT_WARN_S` seconds (60) of waiting it warns
    which ranks have not arrived.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        every: int = 0,
        keep: int | None = 3,
        *,
        save_on_sigterm: bool = True,
        checksum: bool = True,
        save_ref: bool = True,
    ):
        int_at_least(every, "every", 0, " (steps between periodic saves; 0: none, only on SIGTERM, at the end of fit and explicit save)")
        if keep is not None:
            int_at_least(keep, "keep", 0, " or None (how many checkpoints to keep; 0 or None: every one)")
        if not isinstance(directory, (str, os.PathLike)):
            raise ValueError(f"directory must be a path (str or os.PathLike), got {type(directory).__name__} {directory!r}")
        if Path(directory).exists() and not Path(directory).is_dir():
            raise ValueError(f"directory {str(directory)!r} is a file, not a folder; give a checkpoints folder (it is created when missing)")
        self.directory = Path(directory)
        self.every = every
        self.keep = keep
        self.save_on_sigterm = save_on_sigterm
        self.checksum = checksum
        self.save_ref = save_ref
        #: the step of the checkpoint this Checkpointer last saved or restored (for reports; whether a
        #: state is saved already is decided by :meth:`saved_path`, which also knows whose it was)
        self.last_saved_step: int | None = None
        self._saved: tuple | None = None  # (weakref to the actor, step, policy_version, path)
        self.last_save_seconds: float | None = None
        self.last_save_bytes: int | None = None
        self._sigterm = threading.Event()
        self._preempt_raised = False
        self._previous_handler = None
        self._installed = False
        #: whether the ranks were found to hold the same settings (see _check_ranks_agree)
        self._ranks_agree = False
        # no collective here: every rank creates the folder itself and rank 0 deletes leftovers. A
        # barrier made a Checkpointer built on rank 0 only (an "only rank 0 saves" habit) hang until
        # the process group's timeout, then fail with a bare gloo error; that mistake is named by
        # fit's check of its arguments, or by this Checkpointer's first collective use
        # (_check_ranks_agree, which also waits for rank 0's cleanup before any rank lists the folder)
        self.directory.mkdir(parents=True, exist_ok=True)
        if _rank() == 0:
            cleanup(self.directory)

    def __getstate__(self) -> dict:
        """Pickled (``rk.launch(plan, ..., checkpointer=...)`` sends it to the workers): the settings
        and the record of saves, without this process's own signal state (a ``threading.Event``,
        which cannot be pickled, and the SIGTERM handler it installed) or the weak reference to the
        state it last saved; each process arms its own."""
        fields = dict(self.__dict__)
        fields.update(_sigterm=None, _previous_handler=None, _installed=False, _preempt_raised=False, _saved=None,
                      _ranks_agree=False)
        return fields

    def __setstate__(self, fields: dict) -> None:
        self.__dict__.update(fields)
        self._sigterm = threading.Event()

    # signals ----------------------------------------------------------------------
    # The handler is installed only around the loop (armed), never at construction: a handler
    # left behind after the loop would swallow every later SIGTERM (it only sets a flag that
    # nobody reads any more), and one Checkpointer built per notebook-cell run would chain onto
    # the previous, stale one.
    @contextlib.contextmanager
    def armed(self):
        """Within this block, SIGTERM asks :meth:`maybe_save` to save and raise :class:`Preempted`.

        On exit the previous handler is restored; a SIGTERM that arrived after the last
        :meth:`maybe_save` (so nothing was saved for it) is then re-sent to that handler, so it is
        never lost. Nested use (or ``save_on_sigterm=False``, or a non-main thread) is a no-op, apart
        from the ranks' agreement on this Checkpointer's settings (a collective, once: see
        :meth:`_check_ranks_agree`), checked here so that ``rk.fit`` reports it before its first step."""
        self._check_ranks_agree("Checkpointer (fit, or armed())")
        if not self._arm():
            yield self
            return
        try:
            yield self
        finally:
            # (not after a second SIGTERM: that one already went to the previous handler)
            pending = self._installed and self._sigterm.is_set() and not self._preempt_raised
            self._disarm()
            if pending:
                os.kill(os.getpid(), signal.SIGTERM)

    def _arm(self) -> bool:
        if not self.save_on_sigterm or self._installed or threading.current_thread() is not threading.main_thread():
            return False  # signal handlers can only be set from the main thread
        self._sigterm.clear()
        self._preempt_raised = False
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        return True

    def _exit_handler(self):
        """What a second SIGTERM falls back to: the previous handler when it is the user's own
        function, else the default (terminate); never another Checkpointer's flag-setter, which
        would swallow it and break "a second SIGTERM exits at once"."""
        prev = self._previous_handler
        if callable(prev) and not isinstance(getattr(prev, "__self__", None), Checkpointer):
            return prev
        return signal.SIG_DFL

    def _on_sigterm(self, signum, frame) -> None:
        if self._sigterm.is_set():
            # second SIGTERM: stop waiting for the step boundary
            self._installed = False
            signal.signal(signal.SIGTERM, self._exit_handler())
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._sigterm.set()

    def _disarm(self) -> None:
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._installed = False
        # a later handler (the user's, set inside the loop) stays in place
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_handler if self._previous_handler is not None else signal.SIG_DFL)

    def close(self) -> None:
        """Restore the SIGTERM handler that was there before :meth:`armed` (if ours is still active)."""
        self._disarm()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def preempted(self) -> bool:
        return self._sigterm.is_set()

    def _stop_requested(self) -> bool:
        flag = self._sigterm.is_set() and self._installed  # a flag left from an earlier loop is stale
        if _world() > 1:
            # every rank must agree, or one would enter the save collective alone
            t = torch.tensor([int(flag)], device=_collective_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = bool(t.item())
        return flag

    def _check_ranks_agree(self, what: str) -> None:
        """Once per Checkpointer, at its first collective use on several processes: raise
        :class:`~rlkit.parallel.agree.RanksDisagreeError` on every rank unless every rank holds a
        Checkpointer with the same folder, ``every``, ``keep``, ``save_ref`` and ``checksum``
        (:func:`rlkit.parallel.agree.checkpointer_settings`). A folder per rank failed the first
        save with ``FileNotFoundError ... .distcp`` and left ``*.tmp-*`` folders behind; an ``every``
        that differed hung (a save's collectives entered by one rank only). One small all-gather."""
        if self._ranks_agree or _world() == 1:
            return
        from rlkit.parallel.agree import check_ranks_agree, checkpointer_settings

        with _waiting_for_ranks(what):
            check_ranks_agree(checkpointer_settings(self), what)
        self._ranks_agree = True

    def _agreed_checkpoints(self, what: str) -> list[tuple[int, Path]]:
        """The complete checkpoints of the folder (:func:`list_checkpoints`), checked to be the same
        on every rank: raises :class:`~rlkit.parallel.agree.RanksDisagreeError` on every rank
        otherwise. Each rank decided from its own listing whether to enter the collective verify and
        load: ranks that saw different folders (each node's local disk) ran mismatched collectives,
        and rank 0 called a valid checkpoint corrupt while rank 1 failed with an AttributeError."""
        if _world() == 1:
            return list_checkpoints(self.directory)
        from rlkit.parallel.agree import RanksDisagreeError, _by_value, _ranks_text, gather_checked

        self._check_ranks_agree(what)  # (a collective: rank 0's cleanup of leftovers is over)
        found = list_checkpoints(self.directory)
        with _waiting_for_ranks(what):
            everyone = gather_checked([p.name for _, p in found], what)
        if all(names == everyone[0] for names in everyone):
            return found

        def shown(names: list[str]) -> str:
            if not names:
                return "none"
            return ", ".join(names) if len(names) <= 3 else f"{len(names)} ({names[0]} ... {names[-1]})"

        seen = "; ".join(f"{shown(names)} on {_ranks_text(ranks)}" for names, ranks in _by_value(everyone, list(range(_world()))))
        raise RanksDisagreeError(
            f"{what}: the ranks see different checkpoints in {str(self.directory)!r}: {seen}. The checkpoint folder must "
            f"be the same shared folder on every rank (a network or shared file system that every rank sees at the same "
            f"path, not each node's local disk): a checkpoint is saved by every rank together and each rank loads its "
            f"shards from it. Copy the checkpoints to a shared folder and resume from there"
        )

    # saving -----------------------------------------------------------------------
    def _note(self, state: TrainState, path: Path) -> None:
        self.last_saved_step = state.step
        self._saved = (weakref.ref(state.actor), state.step, state.policy_version, Path(path))

    def saved_path(self, state: TrainState) -> Path | None:
        """The checkpoint in this directory that this Checkpointer saved ``state`` to, or restored it
        from, at its current step; None when there is none (then :meth:`maybe_save` and
        :meth:`save_final` save it).

        It is known by the state's own actor, step and policy version, not by the step alone: one
        Checkpointer reused for a second run (a notebook cell run again with another seed) skipped
        that run's saves at the steps the first run had saved, and resume restored the first
        run's weights as the second's."""
        if self._saved is None:
            return None
        actor, step, version, path = self._saved
        if actor() is not state.actor or step != state.step or version != state.policy_version or not (path / MARKER).is_file():
            return None
        return path

    def save(self, state: TrainState) -> Path:
        """Save now (a collective under N processes); records time and size. A checkpoint of the
        same step already there (e.g. from another run in this directory) is replaced once the
        new one is complete."""
        self._check_ranks_agree("Checkpointer.save")
        self._refuse_non_finite(state)
        t0 = time.perf_counter()
        path = save(state, self.directory, keep=self.keep, checksum=self.checksum, save_ref=self.save_ref)
        self.last_save_seconds = time.perf_counter() - t0
        self._note(state, path)
        self.last_save_bytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path.is_dir() else None
        return path

    def _refuse_non_finite(self, state: TrainState) -> None:
        """Refuse to save trained weights that are not all finite (every rank agrees: one small
        gather). An update whose step overflowed the weights (a huge learning rate) left a finite
        loss and gradient norm, and fit saved checkpoint after checkpoint of inf/NaN weights,
        pruning the good ones with ``keep``. :func:`save` itself still writes what it is given."""
        bad = []
        for role in ("actor", "critic"):
            module = getattr(state, role, None)
            if module is None:
                continue
            count: Any = 0
            with torch.no_grad():
                for p in module.parameters():
                    local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2's DTensor: this rank's shard
                    if local.is_floating_point():
                        count = count + (~torch.isfinite(local)).sum()  # one read back below, not one per tensor
            bad.append(int(count))
        totals = [sum(c) for c in zip(*_all_gather(bad))] if bad else []
        roles = [r for r in ("actor", "critic") if getattr(state, r, None) is not None]
        found = [(r, n) for r, n in zip(roles, totals) if n]
        if not found:
            return
        kept = self.latest()
        raise CheckpointError(
            f"Checkpointer: not saving step {state.step}: "
            + ", ".join(f"the {r} has {n} non-finite weight(s)" for r, n in found)
            + " (inf or NaN, e.g. an optimizer step that overflowed them: a learning rate far too large)"
            + (f". The newest good checkpoint, {kept}, is kept" + (f" (keep={self.keep} would have pruned it)" if self.keep else "")
               + "; resume from it with a smaller learning rate" if kept is not None else "; no checkpoint was saved before")
        )

    def maybe_save(self, state: TrainState) -> Path | None:
        """Call after every step: saves every ``every`` steps, and on SIGTERM saves then exits
        (a state already saved, see :meth:`saved_path`, is not saved again)."""
        self._check_ranks_agree("Checkpointer.maybe_save")
        if self._stop_requested():
            path = self.saved_path(state) or self.save(state)
            self._preempt_raised = True
            self.close()
            raise Preempted(str(path))
        if self.every and state.step % self.every == 0 and self.saved_path(state) is None:
            return self.save(state)
        return None

    def save_final(self, state: TrainState) -> Path | None:
        """Save the state a run ends with unless it is saved already (whatever ``every`` is, 0
        included). :func:`rlkit.fit` calls it after its last step, so a finished run resumes
        finished: with periodic saves it used to keep only its last periodic checkpoint (resuming
        redid the steps after it), and with ``every=0`` nothing at all (``resume("auto")`` then
        started the run over)."""
        if self.saved_path(state) is None:
            return self.save(state)
        return None

    # loading ----------------------------------------------------------------------
    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return latest(self.directory)

    def restore(self, template: TrainState, path: str | os.PathLike | None = None) -> TrainState:
        """Load ``path`` (default: the newest complete checkpoint) into ``template``."""
        if path is None:
            found = self._agreed_checkpoints("Checkpointer.restore")
            if not self.directory.is_dir():
                raise CheckpointNotFoundError(f"checkpoint directory {str(self.directory)!r} does not exist; nothing to restore (use resume(state, 'auto') to start fresh)")
            path = found[-1][1] if found else None
            if path is None:
                raise CheckpointNotFoundError(f"no complete checkpoint in {str(self.directory)!r}; nothing to restore (use resume(state, 'auto') to start fresh)")
        path = resolve(path)
        state = load(template, path, checksum=self.checksum, load_ref=self.save_ref)
        if path.resolve().parent == self.directory.resolve():
            self._note(state, path)  # a checkpoint of this directory: not saved again unchanged
        else:
            self.last_saved_step, self._saved = state.step, None
        return state

    def resume(self, template: TrainState, how: str | os.PathLike | None = "auto") -> TrainState:
        """``"auto"``: restore the newest checkpoint that verifies, or return ``template`` when there
        is none; a path: restore that checkpoint (see :func:`resolve`); None/"never": ``template``.

        "auto" is what a restarted job runs unattended, so a newest checkpoint that fails its
        check (a crash or a full disk after its marker) is skipped with a warning naming it, and
        the next older one is restored; when none verifies it raises, rather than silently
        starting over (a fresh run would then set every one of them aside as abandoned)."""
        if how is None or how is False or (isinstance(how, str) and how == "never"):
            return template
        if not isinstance(how, (str, os.PathLike)):
            raise ValueError(f"how must be 'auto', 'never', None or a checkpoint path (str or os.PathLike), got {how!r}")
        if isinstance(how, str) and how == "auto":
            return self._resume_auto(template)
        return self.restore(template, resolve(how))

    def _resume_auto(self, template: TrainState) -> TrainState:
        # the same list on every rank (or RanksDisagreeError): whether to enter the collective verify
        # and load, and which checkpoint, must not depend on what one rank's file system shows
        found = self._agreed_checkpoints("Checkpointer.resume")
        if not found:
            return template
        skipped: list[tuple[Path, CheckpointCorruptError]] = []
        for _, path in reversed(found):
            advise = _ADVISE.set(False)  # this loop goes on to the older ones itself
            try:
                verify(path, checksum=self.checksum)  # collective: every rank gets the same answer
            except CheckpointCorruptError as exc:
                skipped.append((path, exc))
                continue
            finally:
                _ADVISE.reset(advise)
            if skipped:
                warnings.warn(
                    f"resume('auto'): skipped {len(skipped)} corrupted checkpoint(s) newer than {path.name}: "
                    + "; ".join(f"{p}: {str(e).split('; ')[0]}" for p, e in skipped)
                    + f". Restoring {path}; inspect or delete the broken one(s)",
                    RuntimeWarning, stacklevel=3,
                )
            # sizes only on load: the sha256 of every file was just checked
            state = load(template, path, checksum=False, load_ref=self.save_ref)
            self._note(state, path)
            return state
        raise CheckpointCorruptError(
            f"resume('auto'): none of the {len(found)} checkpoint(s) in {str(self.directory)!r} verifies "
            f"(newest: {skipped[0][1]}); start a fresh run in a new directory, or repair one"
        ) from skipped[0][1]


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def checkpoint_bytes(path: str | os.PathLike) -> int:
    """Total size of a checkpoint directory's files."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


__all__ = [
    "Checkpointer", "save", "load", "latest", "list_checkpoints", "resolve", "verify", "prune", "cleanup",
    "step_dir_name", "config_hash", "checkpoint_bytes", "CheckpointError", "CheckpointNotFoundError",
    "CheckpointMismatchError", "CheckpointCorruptError", "CheckpointSaveError", "Preempted",
]
