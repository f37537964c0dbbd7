"""Cheap checks that every rank of a job brings the same model and the same settings.

A setting that differs on one rank (a ``batch_size`` computed from ``RANK``, an argument given to
one rank only, a model built with another seed) is not an error torch.distributed sees: the
collectives still match up, so the run trains on a batch glued from two different batches, steps
each FSDP shard at its own learning rate, or hangs in a collective one rank never enters. These
checks cost one small all-gather and raise :class:`RanksDisagreeError` on every rank, naming what
differs and on which ranks.

- :func:`check_ranks_agree` compares a small dict of settings (``rk.fit`` calls it, through
  :func:`check_fit_agrees`, once per call);
- :func:`check_models_agree` compares a fingerprint of the full models each rank brings (names,
  shapes, dtypes, and a float64 sum and sum of squares of every parameter); ``Plan.shard`` calls it
  before sharding.

On one process (or without torch.distributed) both are no-ops.
"""
from __future__ import annotations

import math
import numbers
import os
import re
from typing import Any, Mapping

import torch
import torch.distributed as dist

from rlkit.data import prompt_fingerprint

__all__ = ["RanksDisagreeError", "FailedOnAnotherRank", "check_ranks_agree", "failed_rank", "check_models_agree",
           "check_fit_agrees", "fit_settings", "checkpointer_settings", "gather_checked", "lowered_group", "model_fingerprint", "placement_group"]


class RanksDisagreeError(RuntimeError):
    """The ranks of a job were given different settings or models; raised on every rank."""


class FailedOnAnotherRank(RuntimeError):
    """Raised on the ranks where nothing failed when :func:`failed_rank` reports that another rank
    failed (``.rank``: the first rank that did), so that every rank stops at the same step."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _size(group) -> int:
    return dist.get_world_size(group) if _distributed() else 1


def _global_ranks(group, size: int) -> list[int]:
    if group is None:
        return list(range(size))
    return [dist.get_global_rank(group, i) for i in range(size)]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: a device index in a repr: each rank's own GPU ("cuda:1", "index=1"), the same setting on every rank
_DEVICE_INDEX = re.compile(r"\b(cuda|xpu|mps|hpu|npu):\d+|(device\(type='[a-z]+'), index=\d+\)")


def _plain(value: Any) -> Any:
    """A value every rank can compare with every other's: numbers, strings, None, tuples of them;
    anything else becomes its repr without memory addresses (they differ between processes)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):  # each rank its own GPU: only the kind must agree
        return f"device({value.type})"
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return _plain(value.item())
        return f"tensor{tuple(value.shape)} {value.dtype}"  # not its values' repr, which names its device
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _plain(v)) for k, v in value.items()))
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return _DEVICE_INDEX.sub(lambda m: m.group(1) or m.group(2) + ")", _ADDRESS.sub("", repr(value)))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _by_value(values: list[Any], ranks: list[int]) -> list[tuple[Any, list[int]]]:
    """``[(value, [ranks holding it]), ...]`` in order of first appearance."""
    out: list[tuple[Any, list[int]]] = []
    for value, rank in zip(values, ranks):
        for seen, holders in out:
            if repr(seen) == repr(value):
                holders.append(rank)
                break
        else:
            out.append((value, [rank]))
    return out


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


_MISSING = "<not given>"

#: what a rank sends in :func:`gather_checked`, so that one that is in another collective is told apart
_TAG = "rlkit.parallel.agree"


def gather_checked(value: Any, what: str, group=None) -> list[Any]:
    """``value`` of every rank of ``group`` (an ``all_gather_object``), after checking that every rank
    is in this same gather: raise :class:`RanksDisagreeError` on every rank otherwise.

    A call that some ranks make and the others skip (``Checkpointer.resume`` or ``save`` on rank 0
    only, ``rk.fit`` with a checkpointer on one rank) pairs its collective with whatever collective
    the other ranks run next: each side then read the other's data as its own (a dict of settings
    where a checkpoint list was expected) and failed with an ``AttributeError``, or called a valid
    checkpoint corrupt. Each value travels tagged with ``what``, so such a pairing is named instead
    (as long as the other side is a gather like this one; another kind of collective can only hang
    until the process group's timeout)."""
    size = _size(group)
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, (_TAG, what, value), group=group)
    ranks = _global_ranks(group, size)
    tagged = [isinstance(x, tuple) and len(x) == 3 and x[0] == _TAG for x in everyone]
    if all(tagged) and all(x[1] == what for x in everyone):
        return [x[2] for x in everyone]
    places = [x[1] if ok else "another collective" for x, ok in zip(everyone, tagged)]
    shown = ", ".join(f"{_ranks_text(holders)} in {place}" for place, holders in _by_value(places, ranks))
    raise RanksDisagreeError(
        f"{what}: the ranks are not in the same call: {shown}. Every rank must make the same collective calls in the "
        "same order: a call made on some ranks only (e.g. Checkpointer.save or resume under `if rank == 0`, or a "
        "Checkpointer built and passed to fit on one rank only) pairs with another collective on the others. Call it "
        "on every rank (rlkit's checkpoints are saved and loaded by all ranks together, each writing its own shards)"
    )


#: what to do about a setting that differs, by the key (or the key's first part, before a dot)
_HINTS = {
    "checkpointer": (
        "Build the Checkpointer on every rank with the same arguments and pass it to fit on every rank (every rank "
        "saves its own shards, so a save on rank 0 only hangs), and give every rank the same shared folder: one "
        "network or shared file system that every rank sees at the same path, not each node's local disk or a "
        "folder per rank"
    ),
}


def check_ranks_agree(settings: Mapping[str, Any], what: str, group=None) -> None:
    """Raise :class:`RanksDisagreeError` on every rank of ``group`` (default: all ranks) unless
    every rank passes equal ``settings``; a no-op on one process.

    ``settings``: a small dict of ints, floats, strings, ``None``, tuples or dicts of those (other
    values are compared by their repr, without memory addresses). ``what``: what the settings are
    for, the start of the message (e.g. ``"fit"``). One ``all_gather_object`` of the dict; every
    rank of ``group`` must call it (it is a collective; a rank found in another gather is named,
    see :func:`gather_checked`)."""
    if not _distributed():
        return
    size = _size(group)
    if size == 1:
        return
    mine = {str(k): _plain(v) for k, v in settings.items()}
    everyone = gather_checked(mine, what, group)
    ranks = _global_ranks(group, size)
    keys: list[str] = []
    for theirs in everyone:
        keys.extend(k for k in theirs if k not in keys)
    parts, hints = [], []
    for key in keys:
        groups = _by_value([theirs.get(key, _MISSING) for theirs in everyone], ranks)
        if len(groups) > 1:
            parts.append(f"{key}: " + ", ".join(f"{_show(value)} on {_ranks_text(holders)}" for value, holders in groups))
            hint = _HINTS.get(key.split(".")[0])
            if hint is not None and hint not in hints:
                hints.append(hint)
    if parts:
        raise RanksDisagreeError(
            f"{what}: the ranks disagree on {len(parts)} setting(s): " + "; ".join(parts) + ". Every rank must run the "
            "same code with the same settings (a value computed from RANK, or an argument or config file given to one "
            "rank only, trains each rank differently or hangs in a collective)" + "".join(f". {h}" for h in hints)
        )


def checkpointer_settings(checkpointer: Any) -> dict[str, Any]:
    """The settings of a checkpointer that every rank must share, as :func:`check_ranks_agree` keys:
    ``{"checkpointer": given?, "checkpointer.directory": absolute path, "checkpointer.every": ...,
    "checkpointer.keep", "checkpointer.save_ref", "checkpointer.checksum"}`` (those it has).

    A folder per rank made the first save fail with ``FileNotFoundError ... .distcp`` (rank 0 creates
    the save's folder, the others write their shards into it) and leave ``*.tmp-*`` folders behind;
    an ``every`` that differs hung (one rank entered the save's collectives alone); ``save_ref``
    that differs saves different tensors per rank. ``True``/``False``/``None`` (whether one was
    given, as ``rk.fit`` used to pass) give ``{"checkpointer": bool}``."""
    if checkpointer is None or isinstance(checkpointer, bool):
        return {"checkpointer": bool(checkpointer)}
    out: dict[str, Any] = {"checkpointer": True}
    directory = getattr(checkpointer, "directory", None)
    if isinstance(directory, (str, os.PathLike)):
        out["checkpointer.directory"] = os.path.abspath(os.fspath(directory))
    for name in ("every", "keep", "save_ref", "checksum"):
        if hasattr(checkpointer, name):
            out[f"checkpointer.{name}"] = getattr(checkpointer, name)
    return out


# --------------------------------------------------------------------------- models

#: elements summed at a time (bounds the float64 temporary: 128 MiB)
_CHUNK = 1 << 24


def _sums(t: torch.Tensor) -> torch.Tensor:
    """``[sum, sum of squares]`` of ``t`` in float64, on ``t``'s device, a chunk at a time."""
    flat = t.reshape(-1)
    total = torch.zeros(2, dtype=torch.float64, device=t.device)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start : start + _CHUNK].to(torch.float64)
        total[0] += chunk.sum()
        total[1] += chunk.square().sum()
    return total


@torch.no_grad()
def model_fingerprint(models: Mapping[str, torch.nn.Module | None]) -> list[tuple]:
    """``[(role.name, shape, dtype, sum, sum of squares), ...]`` of every parameter of ``models``
    (``{"actor": module, ...}``; ``None`` entries skipped), the sums computed where the parameters
    are (one device-to-host copy in all). Sharded (DTensor) or meta parameters get ``None`` sums."""
    from torch.distributed.tensor import DTensor

    rows: list[tuple] = []
    pending: list[torch.Tensor] = []
    index: list[int] = []
    for role, module in models.items():
        if module is None:
            continue
        for name, p in module.named_parameters():
            t = p.detach()
            rows.append((f"{role}.{name}", tuple(t.shape), str(t.dtype), None, None))
            if isinstance(t, DTensor) or t.is_meta or not (t.is_floating_point() or t.is_complex()):
                continue
            if t.is_complex():
                t = torch.view_as_real(t)
            index.append(len(rows) - 1)
            pending.append(_sums(t).cpu())
    if pending:
        values = torch.stack(pending).tolist()
        for i, (s, sq) in zip(index, values):
            rows[i] = rows[i][:3] + (s, sq)
    return rows


def _close(a: float | None, b: float | None, scale: float) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    # float64 sums of the same values in another order (another device) differ by ~1e-16 x scale
    return abs(a - b) <= 1e-9 * scale


def _first_difference(prints: list[list[tuple]], ranks: list[int]) -> str | None:
    """A sentence naming the first parameter whose fingerprint differs between the ranks, or None."""
    longest = max(len(p) for p in prints)
    for i in range(longest):
        rows = [p[i] if i < len(p) else None for p in prints]
        names = [r[0] if r is not None else "(no more parameters)" for r in rows]
        if len(set(names)) > 1:
            groups = _by_value(names, ranks)
            return ("the parameter lists differ at position " + str(i) + ": "
                    + ", ".join(f"{name!r} on {_ranks_text(holders)}" for name, holders in groups)
                    + " (parameter counts: " + ", ".join(f"{len(p)} on rank {r}" for p, r in zip(prints, ranks)) + ")")
        name = names[0]
        for what, k in (("shape", 1), ("dtype", 2)):
            values = [r[k] for r in rows]
            if len(set(values)) > 1:
                groups = _by_value(values, ranks)
                return f"parameter {name!r} has {what} " + ", ".join(f"{v} on {_ranks_text(h)}" for v, h in groups)
        numel = math.prod(rows[0][1]) if rows[0][1] else 1
        squares = [r[4] for r in rows if r[4] is not None and math.isfinite(r[4])]
        top = max(squares, default=0.0)
        # sum |x| <= sqrt(numel * sum x^2): the scale of the sum's rounding error; the sum of squares is its own
        scales = (math.sqrt(numel * top), top)

        def same(a: tuple, b: tuple) -> bool:
            return _close(a[3], b[3], scales[0]) and _close(a[4], b[4], scales[1])

        if any(not same(r, rows[0]) for r in rows[1:]):
            groups: list[tuple[tuple, list[int]]] = []
            for r, rank in zip(rows, ranks):
                for seen, holders in groups:
                    if same(r, seen):
                        holders.append(rank)
                        break
                else:
                    groups.append((r, [rank]))
            shown = ", ".join((f"float64 sum {g[3]:.10g}" if g[3] is not None else "(sharded or meta: not comparable)")
                              + f" on {_ranks_text(h)}" for g, h in groups)
            return f"parameter {name!r} (shape {tuple(rows[0][1])}, {rows[0][2]}) holds different values: {shown}"
    return None


def check_models_agree(models: Mapping[str, torch.nn.Module | None], what: str = "Plan.shard", group=None) -> None:
    """Raise :class:`RanksDisagreeError` on every rank of ``group`` unless every rank holds the same
    ``models`` (``{"actor": module, "ref": ..., "critic": ...}``): the same parameter names, shapes
    and dtypes, and the same values (a float64 sum and sum of squares per parameter). One
    ``all_gather_object`` of the fingerprint (a few numbers per parameter); a no-op on one process.
    """
    if not _distributed():
        return
    size = _size(group)
    if size == 1:
        return
    everyone = gather_checked(model_fingerprint(models), what, group)
    ranks = _global_ranks(group, size)
    problem = _first_difference(everyone, ranks)
    if problem is not None:
        raise RanksDisagreeError(
            f"{what}: the ranks do not hold the same model: {problem}. Sharding would glue one model out of pieces of "
            "different ones. Every rank must bring the same initial weights: build the model with the same seed on every "
            "rank (e.g. rk.models.tiny(..., seed=0), or torch.manual_seed(0) before building it; not a seed derived from "
            "RANK) or load it from the same directory (from_pretrained / a checkpoint) on every rank"
        )


# --------------------------------------------------------------------------- fit


def _world_or(ranks) -> tuple[bool, Any]:
    """``(applies, group)`` for a collective over ``ranks``: the default group when they are the
    whole world; otherwise not applicable (a new group would be a collective over every rank)."""
    if set(ranks) == set(range(dist.get_world_size())):
        return True, None
    return False, None


def placement_group(placement) -> tuple[bool, Any]:
    """``(applies, group)`` for a collective over the ranks of ``placement`` (every role's ranks):
    the default group when they are the whole world, the actor's 1-D mesh when it holds them all;
    not applicable on one process, for a local placement, or for ranks no group can be made of here."""
    if not _distributed() or dist.get_world_size() == 1:
        return False, None
    from rlkit.parallel.mesh import mesh_ranks

    meshes = [m for m in placement.meshes.values() if m is not None]
    ranks = {r for m in meshes for r in mesh_ranks(m)}
    if len(ranks) <= 1:
        return False, None
    applies, group = _world_or(ranks)
    if applies:
        return applies, group
    actor = placement.meshes.get("actor")
    if actor is not None and set(mesh_ranks(actor)) == ranks and actor.ndim == 1:
        return True, actor.get_group()
    return False, None


def lowered_group(state) -> tuple[bool, Any]:
    """``(applies, group)``: whether ``state`` is lowered onto several ranks (``Plan.shard``), and the
    process group of the ranks it runs on (``None``: all ranks). ``applies`` is False for a state
    that is not lowered (``rk.fit`` on a local plan may run on some ranks only, with settings of
    their own) and on one process."""
    if not _distributed() or dist.get_world_size() == 1:
        return False, None
    cache = getattr(state, "_cache", {}) or {}
    split = cache.get("split")
    if split is not None:
        return _world_or(tuple(split.actor_ranks) + tuple(split.rollout_ranks))
    dp = cache.get("dp")
    if dp is None or dp.mesh is None:
        return False, None
    from rlkit.parallel.mesh import mesh_ranks

    ranks = list(mesh_ranks(dp.mesh))
    if len(ranks) <= 1:
        return False, None
    applies, group = _world_or(ranks)
    if not applies and dp.mesh.ndim == 1:
        return True, dp.mesh.get_group()
    return applies, group


def failed_rank(failed: bool, group=None) -> int | None:
    """The lowest global rank of ``group`` (``None``: all ranks) on which ``failed`` is true, or
    None when it is false on every rank: one all-reduce of one integer, which every rank of the group
    must call. A step boundary's agreement: a sink that raised on rank 0 alone stopped rank 0 while
    the others entered the next step's collectives and waited there for the process group's timeout.
    The flag lives where :func:`rlkit.parallel.reshard.comm_device` puts a collective's tensors."""
    if not _distributed():
        return 0 if failed else None
    size = dist.get_world_size(group)
    if size == 1:
        return dist.get_rank() if failed else None
    from rlkit.parallel.reshard import comm_device

    me = dist.get_rank()
    # world_size - rank: the MAX over the ranks that failed is the lowest of them
    flag = torch.tensor([dist.get_world_size() - me if failed else 0], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    value = int(flag.item())
    return dist.get_world_size() - value if value else None


def _recipe_settings(recipe) -> dict[str, Any]:
    """``{"recipe": type name, "recipe.<field>": value, ...}``: the recipe behind ``recipe.step``
    (``Plan.fit`` passes a namespace holding the recipe's bound ``step``)."""
    import dataclasses

    step = getattr(recipe, "step", None)
    owner = getattr(step, "__self__", None)
    obj = owner if owner is not None else recipe
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {"recipe": type(obj).__qualname__}
        for f in dataclasses.fields(obj):
            out[f"recipe.{f.name}"] = getattr(obj, f.name)
        return out
    if owner is None and callable(step):
        return {"recipe": step}  # a plain step function: by name
    return {"recipe": obj}


def fit_settings(state, recipe, prompts, *, steps: int, batch_size: int, **more: Any) -> dict[str, Any]:
    """The settings of an ``rk.fit`` call that every rank must share: ``steps``, ``batch_size``,
    the recipe's fields, the optimizer's settings and current lr, the state's seed, step and data
    position, and the prompt set's size and a checksum of some of its rows; ``more`` added as given,
    except ``checkpointer``: the checkpointer (or whether one was given), expanded by
    :func:`checkpointer_settings` (its folder, ``every``, ...)."""
    out: dict[str, Any] = {"steps": steps, "batch_size": batch_size}
    out.update(_recipe_settings(recipe))
    spec = getattr(state, "optimizer_spec", None)
    if spec is not None:
        fields = spec.to_dict() if callable(getattr(spec, "to_dict", None)) else {"spec": spec}
        out.update({f"optimizer.{k}": v for k, v in fields.items()})
    try:
        groups = state.optimizer.param_groups
        out["optimizer.current_lr"] = tuple(float(g["lr"]) for g in groups)
    except Exception:  # noqa: BLE001 - no optimizer (a rollout-only rank), or a donated state
        pass
    for key in ("seed", "step", "data_position"):
        try:
            out[f"state.{key}"] = getattr(state, key)
        except Exception:  # noqa: BLE001
            pass
    out["prompts.count"] = len(prompts) if hasattr(prompts, "__len__") else None
    out["prompts.checksum"] = prompt_fingerprint(prompts)
    if "checkpointer" in more:
        more = dict(more)
        out.update(checkpointer_settings(more.pop("checkpointer")))
    out.update(more)
    return out


def check_fit_agrees(state, recipe, prompts, *, steps: int, batch_size: int, what: str = "fit", **more: Any) -> None:
    """:func:`check_ranks_agree` on :func:`fit_settings`, over the ranks ``state`` is lowered onto:
    one collective per ``rk.fit`` call; a no-op on one process and for a state that is not lowered
    (``Plan.shard``), which may be trained on some ranks only."""
    applies, group = lowered_group(state)
    if not applies:
        return
    settings = fit_settings(state, recipe, prompts, steps=steps, batch_size=batch_size, **more)
    if "split" in (getattr(state, "_cache", {}) or {}):
        # a split placement's generation ranks build no optimizer of their own (Plan._shard_split)
        settings.pop("optimizer.current_lr", None)
    check_ranks_agree(settings, what, group)
