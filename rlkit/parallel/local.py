"""Run a function on N local processes (for tests and quick experiments, CPU/gloo friendly).

``run_local(fn, 2, *args)`` spawns two processes with the torchrun environment set (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), calls ``fn(*args)`` in each
and returns the per-rank results. The rendezvous store is created here on a port the OS picks
(no race for a "free" port) and the workers join it as clients, as torchrun's agent does.
``fn`` must be importable by the workers (a module-level function); for notebooks use
:func:`rlkit.launch.launch`, which ships closures with cloudpickle and streams metrics.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable


def _entry(local_rank: int, fn: Callable, args: tuple, env: dict[str, str], out_dir: str, threads: int) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    import torch

    torch.set_num_threads(threads)
    try:
        result = fn(*args)
    except BaseException:
        with open(os.path.join(out_dir, f"rank{local_rank}.err"), "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
        raise
    with open(os.path.join(out_dir, f"rank{local_rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def device_env(nprocs: int, device: str | None = None) -> dict[str, str]:
    """The environment variables that put ``nprocs`` local processes on ``device``: ``"cpu"``
    gives ``{RLKIT_DEVICE: "cpu"}`` (gloo on the CPU), ``"cuda"`` nothing (one GPU each), ``None``
    the CPU when this machine has fewer GPUs than ``nprocs`` (NCCL allows one process per GPU).
    :func:`run_local` uses it; so can anything else that starts processes (torchrun, ``rlkit.launch``)."""
    import torch

    from rlkit.parallel.mesh import DEVICE_ENV

    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"run_local: device must be None, 'cpu' or 'cuda', got {device!r}")
    if device is None:
        device = "cpu" if nprocs > torch.cuda.device_count() else "cuda"
    return {DEVICE_ENV: "cpu"} if device == "cpu" else {}


def run_local(fn: Callable, nprocs: int, *args: Any, timeout: float = 120.0, threads: int = 1,
              device: str | None = None) -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank nprocs-1]``, each in its own spawned process.

    ``timeout``: seconds for the whole run; past it the workers are killed and ``TimeoutError``
    is raised (a hung collective fails the test instead of blocking it). ``threads``: torch
    intra-op threads per worker. ``device``: ``"cpu"`` runs the workers on the CPU over gloo
    (``RLKIT_DEVICE=cpu``), ``"cuda"`` one GPU each; ``None`` picks the CPU when there are fewer
    GPUs than workers (NCCL allows one process per GPU). A worker exception is re-raised here
    with its traceback. Workers should tear their process group down with
    :func:`rlkit.parallel.mesh.shutdown`.
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    device_vars = device_env(nprocs, device)
    store = dist.TCPStore("127.0.0.1", 0, world_size=nprocs, is_master=True, wait_for_workers=False)
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": "0",
        # join the store created above as clients instead of racing to bind a port
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    env.update(device_vars)
    out_dir = tempfile.mkdtemp(prefix="rlkit_local_")
    try:
        context = mp.start_processes(
            _entry, args=(fn, args, env, out_dir, threads), nprocs=nprocs, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run_local: {fn.__qualname__} on {nprocs} processes did not finish in {timeout:.0f} s")
        except BaseException:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join(5)
            raise
        results = []
        for rank in range(nprocs):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        del store
