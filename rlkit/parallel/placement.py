"""Placement is data: a mapping role -> DeviceMesh, and the data-parallel row split it implies.

Roles: ``actor`` (trained policy), ``rollout`` (the actor's weights in generation layout),
``ref``, ``critic``, ``reward``. Two roles on the same ranks are *colocated* (they take turns
on the same processes; the weight sync between actor and rollout is local); on different ranks
they are *split* and the actor's weights reach the rollout ranks by collectives
(:func:`rlkit.parallel.reshard.split`). ``None`` as a mesh means "this one process" (the
notebook case, where lowering is the identity).

Batches: every data-parallel rank of a role works on :func:`shard_rows` of the global batch
(whole GRPO groups stay together), and :func:`gather_rows` reassembles per-rank batches (e.g.
rollouts from several generation replicas) into one global Batch in rank order.
"""
from __future__ import annotations

import zlib
from collections import abc
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rlkit.parallel.mesh import device_mesh, mesh_ranks, role_mesh, split_ranks, world
from rlkit.parallel.reshard import Layout, comm_device, replicated, split, tensor_parallel

ROLES = ("actor", "rollout", "ref", "critic", "reward")


@dataclass(frozen=True)
class Placement:
    """Where each role lives: ``meshes[role]`` is a DeviceMesh, or ``None`` for this single process."""

    meshes: Mapping[str, DeviceMesh | None] = field(default_factory=dict)

    def mesh(self, role: str) -> DeviceMesh | None:
        if role not in self.meshes:
            raise KeyError(f"placement has no role {role!r}; it places {sorted(self.meshes)}")
        return self.meshes[role]

    def ranks(self, role: str) -> tuple[int, ...]:
        """Global ranks of ``role`` in mesh order."""
        return tuple(mesh_ranks(self.mesh(role)))

    def colocated(self, a: str, b: str) -> bool:
        """True when both roles run on exactly the same ranks."""
        return self.ranks(a) == self.ranks(b)

    def here(self, role: str) -> bool:
        """Whether this process takes part in ``role``."""
        return world().rank in self.ranks(role)

    def roles_here(self) -> list[str]:
        return [role for role in self.meshes if self.here(role)]

    def sync_layout(self, src: str = "actor", dst: str = "rollout", *, tp: int = 1, dtype: torch.dtype | None = None) -> Layout:
        """The resharding from ``src``'s training layout to ``dst``'s generation layout."""
        if self.colocated(src, dst):
            return tensor_parallel(tp, dtype=dtype) if tp > 1 else replicated(dtype=dtype)
        return split(self.ranks(src), self.ranks(dst), tp=tp, dtype=dtype)


def local_placement(roles: Sequence[str] = ROLES) -> Placement:
    """Every role in this one process (no torch.distributed): lowering is the identity."""
    return Placement({role: None for role in roles})


def colocated_placement(mesh: DeviceMesh | None = None, roles: Sequence[str] = ROLES) -> Placement:
    """Every role on the same ranks (default: all ranks, one data-parallel dimension)."""
    mesh = device_mesh() if mesh is None else mesh
    return Placement({role: mesh for role in roles})


def split_placement(
    sizes: Mapping[str, int],
    *,
    share: Mapping[str, str] | None = None,
) -> Placement:
    """Disjoint rank groups per role: ``split_placement({"actor": 2, "rollout": 2})``.

    ``share``: roles that live with another role instead of getting ranks of their own
    (default: ``ref``, ``critic`` and ``reward`` share the actor's ranks). Collective: every rank
    must call it (it creates one sub-mesh per group, in the same order everywhere).
    """
    share = {"ref": "actor", "critic": "actor", "reward": "actor"} if share is None else dict(share)
    groups = split_ranks(sizes)
    meshes: dict[str, DeviceMesh | None] = {role: role_mesh(ranks) for role, ranks in groups.items()}
    for role, host in share.items():
        if role in meshes:
            continue
        if host not in meshes:
            raise ValueError(f"split_placement: role {role!r} shares {host!r}, which has no ranks; sizes={dict(sizes)}")
        meshes[role] = meshes[host]
    return Placement(meshes)


def shard_rows(batch, mesh: DeviceMesh | None = None, *, group_size: int = 1):
    """This rank's contiguous slice of a global batch: rows ``[r * b/n, (r+1) * b/n)``.

    ``mesh``: the role's data-parallel mesh (``None`` = all ranks). ``group_size``: rows per
    prompt group; each rank's slice must hold whole groups. Works on anything sliceable by rows
    (a Batch/TensorDict or a tensor). Returns ``batch`` itself when there is one rank.
    """
    rank, size = _dp_rank_size(mesh)
    b = batch.batch_size[0] if hasattr(batch, "batch_size") else len(batch)
    if b % size:
        raise ValueError(
            f"shard_rows: the batch has {b} rows, not divisible by {size} data-parallel ranks; "
            f"make the global batch a multiple of {size} (prompts x samples per prompt)"
        )
    per_rank = b // size
    if group_size > 1 and per_rank % group_size:
        raise ValueError(
            f"shard_rows: each of {size} ranks would get {per_rank} rows, which splits groups of {group_size}; "
            f"use a number of prompts divisible by {size}"
        )
    if size == 1:
        return batch
    return batch[rank * per_rank : (rank + 1) * per_rank]


def _dp_rank_size(mesh: DeviceMesh | None) -> tuple[int, int]:
    if mesh is not None:
        ranks = mesh_ranks(mesh)
        me = world().rank
        if me not in ranks:
            raise ValueError(f"this process (rank {me}) is not in the mesh over ranks {ranks}; only its members hold rows")
        return ranks.index(me), len(ranks)
    info = world()
    return info.rank, info.world_size


def gather_rows(batch, mesh: DeviceMesh | None = None):
    """Concatenate every data-parallel rank's Batch (rank order) into one global Batch on all ranks.

    Per-rank widths and row counts may differ: ``(b t)`` fields are right-padded and ``prompt_*``
    fields left-padded to the widest rank (with 0 / False, under a False mask). Non-tensor columns
    follow their rows. Collective over ``mesh`` (default: all ranks); identity on one rank.

    Two gathers whatever the number of fields, on the mesh's device (NCCL on a CUDA mesh): one
    object gather of each rank's row count, widths and non-tensor columns (pickled as plain
    lists), then every tensor field packed into one byte buffer (each field padded to the widest
    rank and aligned to 8 bytes) in one ``all_gather_into_tensor``. One gather per field cost
    0.5-1 ms each over gloo between two local processes (``benchmarks/cpu_bounds.py``); pickling
    the whole Batch (its ``NonTensorStack`` columns hold one object per row) took 37 ms for 256
    rows a rank on an H200 host (``benchmarks/multi_gpu.py --profile``). Ranks whose batches
    have different fields (names, dtypes, trailing dimensions) all get a ``ValueError`` naming
    the odd ranks, not a garbled batch or a hang.
    """
    _, size = _dp_rank_size(mesh)
    if size == 1:
        return batch
    from tensordict import TensorDict

    from rlkit.batch import column, set_column

    group = mesh.get_group() if mesh is not None else None
    comm = comm_device(group)
    keys = list(batch.keys())
    tensor_keys = [k for k in keys if isinstance(batch.get(k), torch.Tensor)]
    other_keys = [k for k in keys if k not in tensor_keys]
    rows = batch.batch_size[0]
    # one object gather carries what the packed buffer's layout needs (row count and widths), a
    # fingerprint of what every rank must agree on (names, dtypes, trailing dims), and the
    # non-tensor columns
    layout = repr([(str(k), str(batch.get(k).dtype), tuple(batch.get(k).shape[2:])) for k in tensor_keys] + [str(k) for k in other_keys])
    mine = {
        "layout": zlib.crc32(layout.encode()),
        "rows": rows,
        "widths": [batch.get(k).shape[1] if batch.get(k).dim() >= 2 else 0 for k in tensor_keys],
        "columns": {k: column(batch, k) for k in other_keys},
    }
    everyone: list = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    odd = [r for r, e in enumerate(everyone) if e["layout"] != everyone[0]["layout"]]
    if odd:
        raise ValueError(
            f"gather_rows: the data-parallel ranks' batches have different fields (names, dtypes or trailing "
            f"dimensions): ranks {odd} of the group differ from its first rank; every rank's Batch must come from "
            f"the same transforms. This rank's fields: {layout}"
        )
    shapes = [[e["rows"], *e["widths"]] for e in everyone]
    counts = [s[0] for s in shapes]
    max_rows = max(counts)
    # every field at the common (max_rows, width, ...) shape, as bytes, 8-byte aligned, in one buffer
    fields, chunks, offset = [], [], 0
    for j, key in enumerate(tensor_keys):
        value = batch.get(key)
        width = max(s[j + 1] for s in shapes)
        if value.dim() >= 2 and value.shape[1] < width:
            pad = width - value.shape[1]
            left = str(key).startswith("prompt")
            value = torch.nn.functional.pad(value, [0, 0] * (value.dim() - 2) + ([pad, 0] if left else [0, pad]))
        if rows < max_rows:
            value = torch.cat([value, value.new_zeros((max_rows - rows, *value.shape[1:]))])
        raw = value.to(comm).contiguous().view(-1).view(torch.uint8)  # bytes of any dtype (gloo has no bool)
        padded = -raw.numel() % 8
        chunks += [raw, raw.new_zeros(padded)] if padded else [raw]
        fields.append((key, value.dtype, tuple(value.shape), batch.get(key).device, offset, raw.numel()))
        offset += raw.numel() + padded
    out: dict = {}
    if fields:
        send = torch.cat(chunks)
        recv = send.new_empty(size * offset)
        from rlkit.parallel.reshard import all_gather_flat

        all_gather_flat(recv, send, group)
        recv = recv.view(size, offset)
        for key, dtype, shape, device, start, nbytes in fields:
            parts = [recv[r, start : start + nbytes].view(dtype).view(shape)[: counts[r]] for r in range(size)]
            out[key] = torch.cat(parts).to(device)
    merged = TensorDict(out, batch_size=[sum(counts)], device=batch.device)
    for key in other_keys:
        set_column(merged, key, [v for e in everyone for v in e["columns"][key]])
    return merged


def shard_reward(reward, mesh: DeviceMesh | None = None):
    """``reward`` (a function, a list or a ``{name: fn}`` dict, as :func:`rlkit.score` takes) with
    each function's work split over the ranks of ``mesh`` (default: all ranks).

    Under a multi-rank plan every rank holds the same global Batch, so without this every rank
    would score every response. Each wrapped function scores a contiguous 1/N of the rows and
    the values are all-gathered, so every rank still gets all of them, in row order.

    - TRL-style functions (``f(completions, **columns) -> list``): the completions and every
      per-row list argument are sliced; the function is called as :func:`rlkit.score` calls an
      unsharded one (by keyword or not: one rule, ``rlkit.transforms.score.call_trl_style``).
    - verl's batched ``compute_score(data_sources, solution_strs, ground_truths, extra_infos)``:
      every list argument is sliced.
    - Batch-style functions (``f(batch) -> Tensor``, e.g. a reward model): the batch is sliced.
    - verl-style functions (``compute_score(...)``, called once per sample) are returned as they
      are: each call is one sample, there is nothing to split.

    A function that raises on one rank raises on every rank (a ``RuntimeError`` naming the rank
    and the error on the others), so no rank waits forever in the gather. Collective: all ranks
    of ``mesh`` must call the wrapped functions together, as a Plan's step does.
    """
    rank, size = _dp_rank_size(mesh)
    if size == 1:
        return reward
    group = mesh.get_group() if mesh is not None else None
    if isinstance(reward, Mapping):
        return {name: shard_reward(fn, mesh) for name, fn in reward.items()}
    if isinstance(reward, (list, tuple)):
        return type(reward)(shard_reward(fn, mesh) for fn in reward)
    from rlkit.transforms.score import reward_style

    style = reward_style(reward)
    return reward if style == "verl" else _ShardedReward(reward, style, rank, size, group)


def contiguous_share(n: int, rank: int, size: int) -> tuple[int, int]:
    """``[lo, hi)``: rank ``rank``'s contiguous share of ``n`` items over ``size`` ranks, the
    earlier ranks taking ``ceil(n / size)`` each (so the last shares may be short or empty)."""
    per = -(-n // size)
    return min(n, rank * per), min(n, (rank + 1) * per)


class _ShardedReward:
    """One reward function scoring this rank's share of the rows (see :func:`shard_reward`)."""

    def __init__(self, fn, style: str, rank: int, size: int, group) -> None:
        import functools

        # same name and signature (inspect follows __wrapped__), but not the reward's own attributes
        # (updated=()): copied over this wrapper's, a reward object's self.rank, .size, .fn, .style or
        # .group replaced them, and a rank scored another rank's rows, silently
        functools.update_wrapper(self, fn, updated=())
        self.fn, self.style, self.rank, self.size, self.group = fn, style, rank, size, group
        # rlkit.score may pass the decoded texts as LazyRows: this wrapper slices its share first,
        # so a rank decodes only the rows it scores
        self.reads_row_shares = True

    def _share(self, b: int) -> tuple[int, int]:
        return contiguous_share(b, self.rank, self.size)

    def _gather(self, compute, rows: int) -> list:
        """Every rank's values, in rank order; ``rows``: how many this rank scores."""
        try:
            mine, error = compute(), None
            if len(mine) != rows:
                # checked per rank: a rank returning one value too many and another one too few
                # concatenated to the right total, and trained on misaligned rewards
                error = ValueError(f"reward {getattr(self.fn, '__name__', self.fn)!r} returned {len(mine)} values for the "
                                   f"{rows} rows it was given; return one value (or None) per completion")
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the gather (SystemExit, timeouts too), then re-raised
            mine, error = None, exc
        everyone: list = [None] * self.size
        dist.all_gather_object(everyone, (mine, None if error is None else f"{type(error).__name__}: {error}"), group=self.group)
        if error is not None:
            raise error
        failed = [(r, msg) for r, (_, msg) in enumerate(everyone) if msg is not None]
        if failed:
            r, msg = failed[0]
            raise RuntimeError(f"reward {getattr(self.fn, '__name__', self.fn)!r} failed on rank {r}: {msg}")
        return [v for values, _ in everyone for v in values]

    def __call__(self, *args, **kwargs):
        if self.style == "batch":
            (batch,) = args
            lo, hi = self._share(batch.batch_size[0])

            def compute():
                if hi <= lo:
                    return []
                values = self.fn(batch[lo:hi])
                values = values.detach().float().flatten().cpu() if isinstance(values, torch.Tensor) else values
                return [float(v) if v is not None else None for v in values]

            return torch.tensor([float("nan") if v is None else v for v in self._gather(compute, max(hi - lo, 0))], dtype=torch.float32)
        if self.style == "verl_batch":
            # rlkit.score passes verl's batched arguments by keyword, as verl does
            completions, rest = kwargs.pop("solution_strs"), []
        else:
            completions, *rest = args
        b = len(completions)
        lo, hi = self._share(b)

        def cut(v):
            """This rank's rows of a per-row argument (a list, or rlkit.score's LazyRows: decoded now)."""
            if isinstance(v, abc.Sequence) and not isinstance(v, (str, bytes)) and len(v) == b:
                return list(v[lo:hi])
            return v

        from rlkit.transforms.score import call_trl_style

        def call(c, args, kw):
            if self.style == "verl_batch":
                return self.fn(solution_strs=c, **kw)
            # as rlkit.score calls an unsharded one (the same rule), unless called with more positional arguments
            return self.fn(c, *args, **kw) if args else call_trl_style(self.fn, c, kw)

        def compute():
            if hi <= lo:
                return []
            mine, args, kw = cut(completions), [cut(v) for v in rest], {k: cut(v) for k, v in kwargs.items()}
            try:
                return list(call(mine, args, kw))
            except Exception as exc:  # noqa: BLE001 - re-raised naming the first row that fails alone
                n = hi - lo

                def one(v, j):
                    return v[j : j + 1] if isinstance(v, list) and len(v) == n else v

                def alone(j):
                    return call(mine[j : j + 1], [one(v, j) for v in args], {k: one(v, j) for k, v in kw.items()})

                prompts = kw.get("prompts") if isinstance(kw.get("prompts"), list) else []
                raise self._failing_row(exc, n, alone, lo, prompts, mine) from exc

        return self._gather(compute, max(hi - lo, 0))

    def _failing_row(self, exc: Exception, n: int, alone, lo: int, prompts, completions) -> Exception:
        """``exc`` (raised on this rank's ``n`` rows) re-made to name the first of them that fails
        on its own (``alone(j)`` scores row ``j`` of the share; ``lo``: the share's first global
        row), as :func:`rlkit.score` names the sample on one process. The rows are retried here, on
        this rank, with no collective in between."""
        from rlkit.transforms.score import _sample_desc

        for j in range(n):
            try:
                alone(j)
            except Exception:  # noqa: BLE001
                return _with_note(exc, f"on {_sample_desc(None, j, prompts, completions, number=lo + j)}")
        return _with_note(exc, f"(on rows {lo}-{lo + n - 1} together; every row alone succeeded)")


def _with_note(exc: Exception, note: str) -> Exception:
    """An exception of ``exc``'s type whose message ends with ``note`` (a RuntimeError naming the
    type where that type takes other constructor arguments)."""
    try:
        return type(exc)(f"{exc} {note}")
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc} {note}")
