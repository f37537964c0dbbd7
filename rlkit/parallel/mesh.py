"""Process groups and device meshes: who this process is, and how ranks split into roles.

``init_distributed()`` reads the environment that torchrun / torch.distributed.elastic (and so
``rlkit.launch``) sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``); with none of it set it is a no-op and everything here describes a world of one
process. The code is device agnostic: NCCL for CUDA tensors (plus gloo for CPU tensors, which
CPU offload and object collectives need), gloo alone on CPU-only machines.

One GPU per process: NCCL refuses two ranks on one GPU, so :func:`init_distributed` stops with an
error naming the fix when a node runs more processes than it has GPUs. To run several processes
on the CPU of a GPU machine (tests, a quick experiment), pass ``backend="gloo"`` or set
``RLKIT_DEVICE=cpu``: either makes :func:`default_device` the CPU. :func:`rlkit.parallel.local.run_local`
sets ``RLKIT_DEVICE=cpu`` by itself when it starts more processes than there are GPUs.

Role groups (HybridFlow's "placement"): ``split_ranks({"actor": 2, "rollout": 2})`` gives
``{"actor": [0, 1], "rollout": [2, 3]}`` and ``role_mesh(ranks)`` a DeviceMesh over a subset of
ranks. Creating a sub-mesh is collective: every rank of the world must call it, in the same
order, even ranks outside the subset (they get a mesh they are not a member of).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class World:
    """This process's place in the job.

    ``rank``/``world_size``: global; ``local_rank``/``local_world_size``: on this node;
    ``device``: the device this process computes on (``cuda:<local_rank>`` or ``cpu``);
    ``backend``: the process-group backend, ``None`` when not distributed.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return self.device.type


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; unset it or fix the launcher") from None


#: environment variable: ``cpu`` makes every process compute on the CPU over gloo, GPUs or not
DEVICE_ENV = "RLKIT_DEVICE"


def _cpu_requested() -> bool:
    value = os.environ.get(DEVICE_ENV, "").strip().lower()
    if value not in ("", "cpu", "auto"):
        raise ValueError(f"{DEVICE_ENV}={value!r}: use 'cpu' (compute on the CPU over gloo), or 'auto' or unset (a GPU per process where there are GPUs)")
    return value == "cpu"


def _gloo_only() -> bool:
    """True when the default process group is initialised without NCCL (CPU tensors only)."""
    return dist.is_available() and dist.is_initialized() and "nccl" not in str(dist.get_backend())


def default_backend() -> str:
    """``"cpu:gloo,cuda:nccl"`` when CUDA is available (CPU tensors still work), else ``"gloo"``
    (also with ``RLKIT_DEVICE=cpu``)."""
    if torch.cuda.is_available() and not _cpu_requested():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def check_gpus_per_process(local_world_size: int, gpus: int) -> None:
    """Raise when ``local_world_size`` processes of a node would share its ``gpus`` GPUs under NCCL."""
    if local_world_size > gpus:
        raise RuntimeError(
            f"{local_world_size} processes on this node but {gpus} visible CUDA device(s): NCCL needs one GPU per "
            f"process (LOCAL_WORLD_SIZE={local_world_size}). Start at most {gpus} process(es) per node "
            "(nproc_per_node), or run on the CPU with init_distributed('gloo') or RLKIT_DEVICE=cpu"
        )


def default_device() -> torch.device:
    """The device this process should compute on: its local GPU, else the CPU. The CPU too with
    ``RLKIT_DEVICE=cpu`` or when the process group was initialised with gloo alone."""
    if torch.cuda.is_available() and not _cpu_requested() and not _gloo_only():
        return torch.device("cuda", _env_int("LOCAL_RANK", 0) % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def init_distributed(backend: str | None = None, *, timeout: timedelta | float | None = None) -> World:
    """Join the job described by the torchrun environment; a no-op for a single process.

    Idempotent: calling it again (or after someone else initialised the default group) just
    returns :func:`world`. Sets the current CUDA device to ``LOCAL_RANK`` on GPU machines.

    ``backend``: ``None`` picks :func:`default_backend`; ``"gloo"`` alone computes on the CPU
    even on a GPU machine. With NCCL, more processes on this node than GPUs is an error naming
    the fix. ``timeout``: seconds or a timedelta for collectives (torch's default otherwise).
    """
    if dist.is_available() and dist.is_initialized():
        return world()
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size <= 1 and "MASTER_ADDR" not in os.environ:
        return world()
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise RuntimeError(
                f"WORLD_SIZE={world_size} but environment variable {name} is not set; start the job with "
                "rlkit.launch, `rlkit launch` or torchrun, which set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
            )
    backend = backend or default_backend()
    if "nccl" in backend:
        check_gpus_per_process(_env_int("LOCAL_WORLD_SIZE", 1), torch.cuda.device_count())
        device = default_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    # Measured on torch 2.13 (gloo, torchrun --standalone, --max-restarts): when a restarted
    # worker group takes a few seconds to reach init_process_group (importing transformers is
    # enough), gloo's eager full-mesh connect fails with "Connection refused" and the restart is
    # lost. Connecting lazily, at the first collective, makes elastic restarts reliable.
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    dist.init_process_group(backend=backend, **kwargs)
    return world()


def world() -> World:
    """The current :class:`World` (rank 0 of 1 when torch.distributed is not initialised)."""
    device = default_device()
    if not (dist.is_available() and dist.is_initialized()):
        return World(device=device)
    return World(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=_env_int("LOCAL_RANK", 0),
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        device=device,
        backend=str(dist.get_backend()),
    )


def barrier() -> None:
    """A barrier on the default group; nothing when not distributed."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl" and torch.cuda.is_available():
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def shutdown(*, wait: bool = True) -> None:
    """Barrier, collect garbage, then destroy every process group (safe when not distributed).
    Called while an exception propagates (from a ``finally`` or ``except``), or with
    ``wait=False`` (:func:`rlkit.launch`'s teardown once the other ranks did not arrive in time),
    it skips the barrier.

    Both steps matter on gloo, where a process otherwise aborts at exit with "terminate called
    without an active exception". The barrier: every rank has finished its collectives before
    any group is torn down. The garbage collection: with a DeviceMesh sub-group in use, cyclic
    garbage still holding collective work was left to interpreter finalization, which aborted
    4-6 of 12 two-process runs under CPU load (a bare init_device_mesh + all_reduce + barrier +
    destroy script); with ``gc.collect()`` first, 0 of 36.
    """
    if dist.is_available() and dist.is_initialized():
        import gc
        import sys

        if wait and sys.exc_info()[0] is None:
            barrier()
        # else: called while an exception propagates (a `finally: shutdown()` on a rank that
        # raised): the other ranks may be inside a collective this rank will never join, and the
        # barrier paired with it, so the job hung instead of reporting the error. Without it this
        # rank exits, and theirs fails with a connection error the launcher reports.
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def device_mesh(
    shape: int | Sequence[int] | None = None,
    names: str | Sequence[str] | None = None,
    *,
    device_type: str | None = None,
) -> DeviceMesh:
    """A DeviceMesh over all ranks: ``device_mesh((2, 4), ("dp", "tp"))``.

    ``shape=None`` means one dimension of ``world_size``; one entry may be ``-1`` (inferred).
    ``names`` defaults to ``("dp",)`` for 1-D and ``("dim0", "dim1", ...)`` otherwise. The mesh's
    device type follows :func:`default_device` unless ``device_type`` is given. Needs
    :func:`init_distributed` first when ``world_size > 1``; on a single process it still works
    (a gloo group of one is created so that DTensor and FSDP code paths run unchanged).
    """
    info = world()
    if shape is None:
        shape = (info.world_size,)
    elif isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise ValueError(f"device_mesh shape {shape} has more than one -1; give all but one dimension")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known <= 0 or info.world_size % known:
            raise ValueError(f"device_mesh shape {shape} cannot be completed for world_size={info.world_size}")
        shape = tuple(info.world_size // known if s == -1 else s for s in shape)
    if math.prod(shape) != info.world_size:
        raise ValueError(
            f"device_mesh shape {shape} has {math.prod(shape)} ranks but world_size={info.world_size}; "
            "the product of the mesh dimensions must equal the number of processes (or use role_mesh for a subset)"
        )
    if names is None:
        names = ("dp",) if len(shape) == 1 else tuple(f"dim{i}" for i in range(len(shape)))
    elif isinstance(names, str):
        names = (names,)
    names = tuple(names)
    if len(names) != len(shape):
        raise ValueError(f"device_mesh names {names} must have one name per dimension of shape {shape}")
    if not dist.is_initialized():
        _init_single_process_group()
    return init_device_mesh(device_type or info.device_type, shape, mesh_dim_names=names)


def _init_single_process_group() -> None:
    # A group of one lets FSDP2/DTensor code run unchanged in a notebook without torchrun;
    # an in-process HashStore needs no port.
    dist.init_process_group(default_backend(), store=dist.HashStore(), rank=0, world_size=1)


def split_ranks(sizes: Mapping[str, int] | Sequence[tuple[str, int]], world_size: int | None = None) -> dict[str, list[int]]:
    """Consecutive rank ranges per role: ``{"actor": 2, "rollout": 2}`` -> ``{"actor": [0, 1], "rollout": [2, 3]}``.

    The sizes must add up to ``world_size`` (default: the current world); give a role size
    ``-1`` to take whatever is left.
    """
    items = list(sizes.items()) if isinstance(sizes, Mapping) else list(sizes)
    world_size = world().world_size if world_size is None else world_size
    fill = [name for name, n in items if n == -1]
    if len(fill) > 1:
        raise ValueError(f"split_ranks: only one role may have size -1, got {fill}")
    fixed = sum(n for _, n in items if n != -1)
    out: dict[str, list[int]] = {}
    start = 0
    for name, n in items:
        n = world_size - fixed if n == -1 else n
        if n <= 0:
            raise ValueError(f"split_ranks: role {name!r} gets {n} ranks; every role needs at least one (world_size={world_size})")
        out[name] = list(range(start, start + n))
        start += n
    if start != world_size:
        raise ValueError(
            f"split_ranks: role sizes {dict(items)} add up to {start} but world_size={world_size}; "
            "make them add up (or give one role -1 for the rest)"
        )
    return out


def role_mesh(
    ranks: Sequence[int],
    shape: int | Sequence[int] | None = None,
    names: str | Sequence[str] | None = None,
    *,
    device_type: str | None = None,
) -> DeviceMesh:
    """A DeviceMesh over a subset of global ranks (collective: every rank must call it).

    ``role_mesh([2, 3, 4, 5], (2, 2), ("dp", "tp"))``. Ranks outside ``ranks`` get a mesh whose
    ``get_coordinate()`` is ``None``; use :func:`in_mesh` to test membership.
    """
    ranks = [int(r) for r in ranks]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"role_mesh ranks {ranks} contain duplicates")
    shape = (len(ranks),) if shape is None else ((shape,) if isinstance(shape, int) else tuple(shape))
    if math.prod(shape) != len(ranks):
        raise ValueError(f"role_mesh shape {shape} has {math.prod(shape)} ranks but {len(ranks)} ranks were given")
    if names is None:
        names = ("dp",) if len(shape) == 1 else tuple(f"dim{i}" for i in range(len(shape)))
    elif isinstance(names, str):
        names = (names,)
    info = world()
    bad = [r for r in ranks if not 0 <= r < info.world_size]
    if bad:
        raise ValueError(f"role_mesh ranks {bad} are outside the world of {info.world_size} processes")
    if not dist.is_initialized():
        _init_single_process_group()
    mesh = torch.tensor(ranks, dtype=torch.int).view(shape)
    return DeviceMesh(device_type or info.device_type, mesh, mesh_dim_names=tuple(names))


def mesh_ranks(mesh: DeviceMesh | None) -> list[int]:
    """The global ranks of a mesh, in mesh order (``[0]`` for ``None``: the single local process)."""
    if mesh is None:
        return [0]
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def in_mesh(mesh: DeviceMesh | None) -> bool:
    """Whether this process is a member of ``mesh`` (``None`` = the local process: always True)."""
    return mesh is None or world().rank in mesh_ranks(mesh)
