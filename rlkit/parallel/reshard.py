"""Train -> generate weight movement with zero redundancy (HybridFlow's 3D resharding).

The trainer holds each parameter as FSDP2 row shards: training rank ``i`` of ``S`` holds rows
``torch.chunk(W, S, dim=0)[i]``. The generation layout wants, on each generation rank:

- ``replicated``: every full tensor;
- ``tensor_parallel(k)``: its TP shard only. Column-parallel projections (q/k/v, gate/up;
  weight and bias) are ``Shard(0)`` (row chunk ``j`` of ``k``), row-parallel ones (o_proj,
  down_proj weight) ``Shard(1)`` (column chunk ``j`` of ``k``), everything else (norms,
  embeddings, lm_head) is replicated. Generation ranks form TP groups of ``k`` consecutive
  ranks; TP rank ``j = position % k``; the ``len(ranks) / k`` groups are data-parallel replicas.
- ``split(actor_ranks, rollout_ranks)``: the same, but the generation ranks are other processes
  than the training ranks; weights cross groups by collectives.

Every case is one plan: for each bucket of parameters, each (training rank ``s``, generation
rank ``t``) pair exchanges exactly the block ``rows(s) ∩ rows_needed(t)`` x ``cols_needed(t)``,
so a generation rank receives only what it keeps: no rank materialises a tensor (or part of
one) that it will not generate with. Colocated replicated copies use one ``all_gather`` per
bucket; every other layout one ``all_to_all_single`` per bucket (a broadcast / send-recv
pattern expressed as one collective). At any moment a rank holds its outputs plus one bucket's
send and receive buffers (each at most ``bucket_bytes`` of full-tensor bytes).

``gather_weights`` is SPMD: every rank of the group calls it with the same architecture (a
training-only rank passes its FSDP model, a generation-only rank its generation model or a dict
of meta tensors) and gets back its own generation weights (``{}`` on ranks that do not generate).
"""
from __future__ import annotations

import fnmatch
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

Style = Literal["colwise", "rowwise", "replicate"]

#: default tensor-parallel plan for Llama/Qwen2/Mistral-style models (module-path globs)
DEFAULT_TP_PLAN: tuple[tuple[str, Style], ...] = (
    ("*.q_proj", "colwise"),
    ("*.k_proj", "colwise"),
    ("*.v_proj", "colwise"),
    ("*.gate_proj", "colwise"),
    ("*.up_proj", "colwise"),
    ("*.o_proj", "rowwise"),
    ("*.down_proj", "rowwise"),
)

DEFAULT_BUCKET_BYTES = 256 << 20
_FSDP_PLACEMENTS = (Shard(0),)


@dataclass(frozen=True)
class Layout:
    """Where the generation copy lives. Build with :func:`replicated`, :func:`tensor_parallel`, :func:`split`.

    - ``tp``: tensor-parallel degree of the generation layout (1 = full tensors).
    - ``src_ranks``: global ranks holding the training shards (``None``: the FSDP mesh of the
      model, or every rank for an unsharded model).
    - ``dst_ranks``: global ranks that generate (``None``: the same as ``src_ranks``).
    - ``plan``: ``(module-path glob, "colwise" | "rowwise" | "replicate")`` pairs, first match wins;
      ``None`` = :data:`DEFAULT_TP_PLAN`.
    - ``dtype``: cast to this dtype before sending (e.g. bf16 generation copies of fp32 weights).
    """

    tp: int = 1
    src_ranks: tuple[int, ...] | None = None
    dst_ranks: tuple[int, ...] | None = None
    plan: tuple[tuple[str, str], ...] | None = None
    dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"Layout.tp must be >= 1, got {self.tp}")
        for name in ("src_ranks", "dst_ranks"):
            ranks = getattr(self, name)
            if ranks is not None and (len(ranks) == 0 or len(set(ranks)) != len(ranks)):
                raise ValueError(f"Layout.{name}={ranks} must be a non-empty list of distinct ranks")
        if self.dst_ranks is not None and len(self.dst_ranks) % self.tp:
            raise ValueError(
                f"Layout: {len(self.dst_ranks)} generation ranks {self.dst_ranks} cannot form TP groups of {self.tp}; "
                "use a tp that divides the number of generation ranks"
            )


def replicated(ranks: Sequence[int] | None = None, *, dtype: torch.dtype | None = None) -> Layout:
    """Full copies on every generation rank (``ranks``; default: the training ranks)."""
    return Layout(tp=1, dst_ranks=tuple(ranks) if ranks is not None else None, dtype=dtype)


def tensor_parallel(
    k: int,
    ranks: Sequence[int] | None = None,
    *,
    plan: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
    dtype: torch.dtype | None = None,
) -> Layout:
    """TP(``k``) x DP(``len(ranks) / k``) on the generation ranks (default: the training ranks)."""
    return Layout(tp=k, dst_ranks=tuple(ranks) if ranks is not None else None, plan=_plan_tuple(plan), dtype=dtype)


def split(
    actor_ranks: Sequence[int],
    rollout_ranks: Sequence[int],
    *,
    tp: int = 1,
    plan: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
    dtype: torch.dtype | None = None,
) -> Layout:
    """Split placement: training on ``actor_ranks``, generation (TP ``tp``) on ``rollout_ranks``."""
    return Layout(tp=tp, src_ranks=tuple(actor_ranks), dst_ranks=tuple(rollout_ranks), plan=_plan_tuple(plan), dtype=dtype)


def _plan_tuple(plan) -> tuple[tuple[str, str], ...] | None:
    if plan is None:
        return None
    items = tuple(plan.items()) if isinstance(plan, Mapping) else tuple(tuple(p) for p in plan)
    for pattern, style in items:
        if _style_kind(style) is None:
            raise ValueError(f"TP plan entry {pattern!r}: style {style!r}; use 'colwise', 'rowwise' or 'replicate'")
    return items


def _style_kind(style: str) -> Style | None:
    if style in ("colwise", "rowwise", "replicate"):
        return style  # type: ignore[return-value]
    return None


def tp_style(name: str, plan: Sequence[tuple[str, str]] | None = None) -> Style:
    """TP style of parameter ``name`` (``"model.layers.0.self_attn.q_proj.weight"`` -> ``"colwise"``).

    Patterns match the module path (the name without ``.weight``/``.bias``), either whole or as
    a dotted suffix, so HF ``base_model_tp_plan`` keys such as ``"layers.*.self_attn.q_proj"``
    work as given.
    """
    module_path = name.rsplit(".", 1)[0] if "." in name else ""
    for pattern, style in plan if plan is not None else DEFAULT_TP_PLAN:
        if fnmatch.fnmatchcase(module_path, pattern) or fnmatch.fnmatchcase(module_path, "*." + pattern):
            return style  # type: ignore[return-value]
    return "replicate"


def shard_dim(name: str, ndim: int, plan: Sequence[tuple[str, str]] | None = None) -> int | None:
    """The dimension a TP layout shards ``name`` on (0 column-parallel, 1 row-parallel), ``None`` if replicated.

    Row-parallel biases (and any 1-D parameter of a row-parallel module) are replicated: the
    bias is added once after the reduction.
    """
    style = tp_style(name, plan)
    if style == "colwise":
        return 0
    if style == "rowwise" and ndim >= 2:
        return 1
    return None


@dataclass
class SyncReport:
    """What one weight sync cost on this rank.

    - ``bytes``: bytes this rank received into its generation weights (its own training shard
      included); 0 when nothing moved (single process, weights shared).
    - ``bytes_sent``: bytes this rank put into collectives as a training rank.
    - ``seconds``: wall time of the whole sync on this rank (device-synchronised).
    - ``tensors`` / ``buckets``: parameters delivered to this rank / collective rounds.
    - ``peak_buffer_bytes``: the largest send + receive buffer alive at once (one bucket).
    - ``sharded_fraction``: for TP-sharded parameters, the largest fraction of a full tensor this
      rank ever received (``1/k`` for TP(k): no full copy); ``0.0`` when none is sharded.
    """

    bytes: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    tensors: int = 0
    buckets: int = 0
    peak_buffer_bytes: int = 0
    sharded_fraction: float = 0.0
    layout: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Received GB/s (1e9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        return {
            f"{prefix}bytes": float(self.bytes),
            f"{prefix}seconds": self.seconds,
            f"{prefix}gbps": self.gbps,
            f"{prefix}buckets": float(self.buckets),
            f"{prefix}peak_buffer_bytes": float(self.peak_buffer_bytes),
        }


@dataclass(frozen=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # communication / output dtype
    shard_dim: int | None  # TP shard dim in the generation layout
    local: torch.Tensor | None  # this rank's training rows, if it is a training rank

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _chunk_rows(d0: int, parts: int, index: int) -> tuple[int, int]:
    """Rows of ``torch.chunk(x, parts, dim=0)[index]`` (empty past the last chunk), as FSDP2 shards."""
    size = math.ceil(d0 / parts) if d0 else 0
    start = min(index * size, d0)
    return start, min(start + size, d0)


def _even_part(extent: int, parts: int, index: int, name: str, dim: int) -> tuple[int, int]:
    if extent % parts:
        raise ValueError(
            f"parameter {name!r} has size {extent} on dim {dim}, not divisible by tensor-parallel size {parts}; "
            "use a tp that divides the head counts and the MLP width, or mark it 'replicate' in the TP plan"
        )
    size = extent // parts
    return index * size, (index + 1) * size


def _need(p: _Param, tp: int, tp_rank: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(rows, cols) block of ``p`` a generation rank keeps; ``cols=None`` means all of dims 1..."""
    d0 = p.shape[0]
    if tp == 1 or p.shard_dim is None:
        return (0, d0), None
    if p.shard_dim == 0:
        return _even_part(d0, tp, tp_rank, p.name, 0), None
    return (0, d0), _even_part(p.shape[1], tp, tp_rank, p.name, 1)


def _block_numel(p: _Param, rows: tuple[int, int], cols: tuple[int, int] | None) -> int:
    rest = math.prod(p.shape[1:])
    if cols is not None:
        rest = rest // p.shape[1] * (cols[1] - cols[0])
    return max(rows[1] - rows[0], 0) * rest


def _out_shape(p: _Param, rows: tuple[int, int], cols: tuple[int, int] | None) -> tuple[int, ...]:
    shape = list(p.shape)
    shape[0] = rows[1] - rows[0]
    if cols is not None:
        shape[1] = cols[1] - cols[0]
    return tuple(shape)


def _intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if hi > lo else (lo, lo)


def comm_device(group) -> torch.device:
    """Where tensors for a collective on ``group`` live: this rank's GPU for NCCL, else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _named_tensors(model: nn.Module | Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    if isinstance(model, nn.Module):
        return list(model.named_parameters())
    return list(model.items())


def _src_ranks_of(tensors: list[tuple[str, torch.Tensor]], layout: Layout, world_size: int) -> tuple[int, ...]:
    mesh_ranks = None
    seen: dict[int, tuple[int, ...]] = {}  # DeviceMesh.mesh rebuilds a tensor per access: once per mesh
    for name, t in tensors:
        mesh = getattr(t, "device_mesh", None)
        if mesh is not None:
            if id(mesh) not in seen:
                seen[id(mesh)] = tuple(int(r) for r in mesh.mesh.flatten().tolist())
            ranks = seen[id(mesh)]
            if mesh.ndim != 1:
                raise ValueError(
                    f"gather_weights: parameter {name!r} is sharded over a {mesh.ndim}-D mesh {mesh.mesh_dim_names}; "
                    "only 1-D FSDP meshes are supported as the training layout"
                )
            if mesh_ranks is not None and ranks != mesh_ranks:
                raise ValueError(f"gather_weights: parameter {name!r} lives on ranks {ranks}, others on {mesh_ranks}; shard the whole model on one mesh")
            mesh_ranks = ranks
    if layout.src_ranks is not None:
        if mesh_ranks is not None and tuple(layout.src_ranks) != mesh_ranks:
            raise ValueError(
                f"gather_weights: layout.src_ranks={layout.src_ranks} but the model is sharded over ranks {mesh_ranks}; "
                "give the training mesh's ranks in order"
            )
        return tuple(layout.src_ranks)
    return mesh_ranks if mesh_ranks is not None else tuple(range(world_size))


def _local_rows(name: str, t: torch.Tensor, src_index: int, n_src: int) -> torch.Tensor:
    """This training rank's row chunk of ``t`` (a FSDP Shard(0) DTensor or a full tensor)."""
    if isinstance(t, DTensor):
        if tuple(t.placements) != _FSDP_PLACEMENTS:
            raise ValueError(
                f"gather_weights: parameter {name!r} has placements {t.placements}; the training layout must be "
                "FSDP's Shard(0) (shard_model's default)"
            )
        # _local_tensor is what to_local() returns under no_grad, minus ~30 us of call overhead per parameter
        local = t._local_tensor if hasattr(t, "_local_tensor") else t.to_local()
        rows = _chunk_rows(t.shape[0], n_src, src_index)
        if local.shape[0] != rows[1] - rows[0]:
            raise RuntimeError(
                f"gather_weights: parameter {name!r} local shard has {local.shape[0]} rows, expected {rows[1] - rows[0]} "
                "(torch.chunk layout); this torch version shards differently, please report it"
            )
        return local
    rows = _chunk_rows(t.shape[0], n_src, src_index)
    return t.detach()[rows[0] : rows[1]]


def _fingerprint(params: list[_Param], src: tuple[int, ...], dst: tuple[int, ...], tp: int) -> int:
    h = hashlib.sha256(repr((src, dst, tp)).encode())
    for p in params:
        h.update(repr((p.name, p.shape, str(p.dtype), p.shard_dim)).encode())
    return int.from_bytes(h.digest()[:7], "little")


def _check_agreement(fp: int, group, device: torch.device) -> None:
    size = dist.get_world_size(group)
    mine = torch.tensor([fp], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(everyone, mine, group=group)
    values = [int(v.item()) for v in everyone]
    if len(set(values)) != 1:
        odd = [dist.get_global_rank(group, g) if group is not None else g for g, v in enumerate(values) if v != values[0]]
        raise RuntimeError(
            f"gather_weights: ranks disagree on the parameter list (names, shapes, dtypes) or the layout; ranks {odd} "
            "differ from the group's first rank. Every rank must pass the same architecture and the same Layout "
            "(give Layout.dtype when training and generation models have different dtypes)"
        )


def _buckets(params: list[_Param], bucket_bytes: int) -> list[list[int]]:
    """Consecutive parameter indices, one dtype per bucket, at most ``bucket_bytes`` of full tensors (or one tensor)."""
    out: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, p in enumerate(params):
        if current and (size + p.nbytes > bucket_bytes or params[current[0]].dtype != p.dtype):
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += p.nbytes
    if current:
        out.append(current)
    return out


@torch.no_grad()
def gather_weights(
    model: nn.Module | Mapping[str, torch.Tensor],
    layout: Layout | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> tuple[dict[str, torch.Tensor], SyncReport]:
    """Move the training weights into the generation layout; returns ``(weights, report)``.

    ``weights``: this rank's generation tensors by parameter name (``model.named_parameters()``
    names; pass the inner HF model to get HF names), full or TP shards per ``layout``; ``{}`` on
    ranks outside ``layout.dst_ranks``. Values equal the training weights exactly (a pure copy,
    plus the optional ``layout.dtype`` cast).

    ``layout``: :func:`replicated` (default), :func:`tensor_parallel`, :func:`split`.
    ``bucket_bytes``: full-tensor bytes per collective round. ``group``: the process group
    spanning training and generation ranks (default: the world); every rank of it must call.
    ``device``: where results live (default: the communication device).

    Without torch.distributed (one process) the parameters are returned without a copy: the
    generation engine reads the training storage and the sync costs nothing.
    """
    layout = layout or replicated()
    t0 = time.perf_counter()
    tensors = _named_tensors(model)
    if not (dist.is_available() and dist.is_initialized()):
        if layout.tp != 1 or (layout.dst_ranks not in (None, (0,))) or (layout.src_ranks not in (None, (0,))):
            raise ValueError(f"gather_weights: layout {layout} needs several processes; torch.distributed is not initialised")
        out = {n: (t.detach() if layout.dtype in (None, t.dtype) else t.detach().to(layout.dtype)) for n, t in tensors}
        return out, SyncReport(seconds=time.perf_counter() - t0, tensors=len(out), layout="local")

    world_size = dist.get_world_size(group)
    me = dist.get_rank()
    group_rank = (lambda r: dist.get_group_rank(group, r)) if group is not None else (lambda r: r)
    src = _src_ranks_of(tensors, layout, dist.get_world_size())
    dst = tuple(layout.dst_ranks) if layout.dst_ranks is not None else src
    if len(dst) % layout.tp:
        raise ValueError(f"gather_weights: {len(dst)} generation ranks {dst} cannot form TP groups of {layout.tp}")
    comm = comm_device(group)
    out_device = torch.device(device) if device is not None else comm
    src_index = src.index(me) if me in src else None
    dst_index = dst.index(me) if me in dst else None

    params: list[_Param] = []
    for name, t in tensors:
        if t.dim() == 0:
            raise ValueError(f"gather_weights: parameter {name!r} is 0-dimensional; reshape it to (1,) to shard it")
        dtype = layout.dtype or t.dtype
        local = _local_rows(name, t, src_index, len(src)) if src_index is not None else None
        sdim = shard_dim(name, t.dim(), layout.plan) if layout.tp > 1 else None
        params.append(_Param(name, tuple(t.shape), dtype, sdim, local))
    _check_agreement(_fingerprint(params, src, dst, layout.tp), group, comm)

    report = SyncReport(layout=f"tp={layout.tp} src={list(src)} dst={list(dst)}")
    tp_rank = dst_index % layout.tp if dst_index is not None else 0
    weights: dict[str, torch.Tensor] = {}
    if dst_index is not None:
        for p in params:
            rows, cols = _need(p, layout.tp, tp_rank)
            weights[p.name] = torch.empty(_out_shape(p, rows, cols), dtype=p.dtype, device=out_device)
    colocated_full = (
        layout.tp == 1 and dst == src and world_size == len(src) and all(group_rank(r) == i for i, r in enumerate(src))
    )
    for bucket in _buckets(params, bucket_bytes):
        chunk = [params[i] for i in bucket]
        if colocated_full:
            _all_gather_bucket(chunk, weights, src_index, len(src), group, comm, report)
        else:
            _all_to_all_bucket(chunk, weights, src, dst, layout.tp, group_rank, world_size, src_index, dst_index, group, comm, report)
        report.buckets += 1
    _sync(comm)
    report.tensors = len(weights)
    report.seconds = time.perf_counter() - t0
    return weights, report


def all_gather_flat(out: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    """Every rank's ``tensor``, concatenated in rank order, into ``out``: ``all_gather_single``
    where torch has it (2.13 deprecates ``all_gather_into_tensor``, with a FutureWarning at every
    call: every step of a multi-process run printed one), else ``all_gather_into_tensor``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor, group=group)


def _all_gather_bucket(chunk, weights, src_index, n_src, group, device, report) -> None:
    """Colocated replicated copy: each rank contributes its padded rows, receives everyone's."""
    dtype = chunk[0].dtype
    padded = [math.ceil(p.shape[0] / n_src) * math.prod(p.shape[1:]) for p in chunk]
    per_rank = sum(padded)
    send = torch.zeros(per_rank, dtype=dtype, device=device)
    offset = 0
    for p, n in zip(chunk, padded):
        local = p.local.reshape(-1)
        send[offset : offset + local.numel()].copy_(local)
        offset += n
    recv = torch.empty(n_src * per_rank, dtype=dtype, device=device)
    all_gather_flat(recv, send, group)
    recv = recv.view(n_src, per_rank)
    offset = 0
    for p, n in zip(chunk, padded):
        rest = math.prod(p.shape[1:])
        rows_per_rank = n // rest if rest else 0
        if rows_per_rank * n_src == p.shape[0]:  # even chunks: one strided copy
            weights[p.name].view(n_src, n).copy_(recv[:, offset : offset + n])
        else:
            target = weights[p.name].view(p.shape[0], rest)
            for s in range(n_src):
                lo, hi = _chunk_rows(p.shape[0], n_src, s)
                if hi > lo:
                    target[lo:hi].copy_(recv[s, offset : offset + (hi - lo) * rest].view(hi - lo, rest))
        offset += n
    report.bytes += sum(p.nbytes for p in chunk)  # payload; the chunk padding is not counted
    report.bytes_sent += sum(p.local.numel() for p in chunk) * send.element_size()
    report.peak_buffer_bytes = max(report.peak_buffer_bytes, (send.numel() + recv.numel()) * send.element_size())


def _all_to_all_bucket(chunk, weights, src, dst, tp, group_rank, world_size, src_index, dst_index, group, device, report) -> None:
    """General plan: training rank ``s`` sends generation rank ``t`` exactly the block ``t`` keeps from ``s``'s rows."""
    dtype = chunk[0].dtype
    n_src = len(src)
    # blocks[(s_idx, d_idx)] = list of (param, rows (global), cols) with a non-empty intersection
    def blocks(s_idx: int, d_idx: int):
        out = []
        for p in chunk:
            have = _chunk_rows(p.shape[0], n_src, s_idx)
            rows_needed, cols = _need(p, tp, d_idx % tp)
            rows = _intersect(have, rows_needed)
            if rows[1] > rows[0]:
                out.append((p, rows, cols))
        return out

    send_splits = [0] * world_size
    send_plan: list[tuple] = []  # (param, rows, cols) in send order
    if src_index is not None:
        for d_idx in sorted(range(len(dst)), key=lambda i: group_rank(dst[i])):
            d_blocks = blocks(src_index, d_idx)
            send_plan.extend(d_blocks)
            send_splits[group_rank(dst[d_idx])] = sum(_block_numel(p, rows, cols) for p, rows, cols in d_blocks)
    send = torch.empty(sum(send_splits), dtype=dtype, device=device)
    offset = 0
    for p, rows, cols in send_plan:
        have_lo = _chunk_rows(p.shape[0], n_src, src_index)[0]
        piece = p.local[rows[0] - have_lo : rows[1] - have_lo]
        if cols is not None:
            piece = piece[:, cols[0] : cols[1]]
        send[offset : offset + piece.numel()].view(piece.shape).copy_(piece)
        offset += piece.numel()
    recv_splits = [0] * world_size
    recv_plan: list[tuple] = []  # (param, rows, cols) in receive order
    sharded_received: dict[str, int] = {}
    if dst_index is not None:
        for s_idx in sorted(range(n_src), key=lambda i: group_rank(src[i])):
            n = 0
            for p, rows, cols in blocks(s_idx, dst_index):
                recv_plan.append((p, rows, cols))
                k = _block_numel(p, rows, cols)
                n += k
                if p.shard_dim is not None and tp > 1:
                    sharded_received[p.name] = sharded_received.get(p.name, 0) + k
            recv_splits[group_rank(src[s_idx])] = n
    recv = torch.empty(sum(recv_splits), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    offset = 0
    for p, rows, cols in recv_plan:
        k = _block_numel(p, rows, cols)
        target = weights[p.name]
        rows_needed, _ = _need(p, tp, dst_index % tp)
        lo = rows[0] - rows_needed[0]
        target[lo : lo + rows[1] - rows[0]].copy_(recv[offset : offset + k].view((rows[1] - rows[0], *target.shape[1:])))
        offset += k
    full_numel = {p.name: p.numel for p in chunk}
    for name, k in sharded_received.items():
        report.sharded_fraction = max(report.sharded_fraction, k / full_numel[name])
    report.bytes += recv.numel() * recv.element_size()
    report.bytes_sent += send.numel() * send.element_size()
    report.peak_buffer_bytes = max(report.peak_buffer_bytes, (send.numel() + recv.numel()) * recv.element_size())


def load_into(module: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy gathered full weights into a plain (unsharded) module's parameters, in place, by name."""
    params = dict(module.named_parameters())
    missing = [n for n in weights if n not in params]
    if missing:
        raise KeyError(f"load_into: {type(module).__name__} has no parameters {missing[:5]}; gather from a model with the same names")
    with torch.no_grad():
        for name, value in weights.items():
            if params[name].shape != value.shape:
                raise ValueError(
                    f"load_into: parameter {name!r} has shape {tuple(params[name].shape)} but the gathered tensor has "
                    f"{tuple(value.shape)}; TP shards need a TP model"
                )
            params[name].copy_(value)
