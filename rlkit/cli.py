"""The ``rlkit`` command: ``doctor``, ``run <task>``, ``launch``."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading


def doctor_report() -> dict:
    """What ``rlkit doctor`` checks, typed (``--json`` prints it): versions, the optional packages
    (a version, or None when not installed), CPU threads, CUDA and its GPUs, the distributed
    backends."""
    import platform

    import torch
    import transformers

    import rlkit

    packages = {}
    for name in ("tensordict", "einops", "tokenizers", "vllm", "wandb", "ipywidgets"):
        try:
            packages[name] = getattr(__import__(name), "__version__", "installed")
        except Exception:  # noqa: BLE001 - optional packages (an import may fail in other ways too)
            packages[name] = None
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            nccl = None
    gpus = []
    for i in range(torch.cuda.device_count() if cuda else 0):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "sm": f"{p.major}{p.minor}"})
    return {
        "rlkit": rlkit.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "packages": packages,
        "cpu_threads": torch.get_num_threads(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda if cuda else None,
        "nccl_version": nccl,
        "gpu_count": len(gpus),
        "gpus": gpus,
        "distributed": {"gloo": torch.distributed.is_gloo_available(), "nccl": torch.distributed.is_nccl_available()},
    }


def doctor(args) -> int:
    """Print versions, devices, CUDA/NCCL and GPU memory: the first environment check. ``--json``
    prints :func:`doctor_report` as one JSON object (booleans and counts as JSON booleans and
    numbers; it printed every value as text)."""
    from rich.console import Console
    from rich.table import Table

    report = doctor_report()
    if args.json:
        print(json.dumps(report))
        return 0
    rows = [(k, report[k]) for k in ("rlkit", "python", "platform", "torch", "transformers")]
    rows += [(name, version or "not installed") for name, version in report["packages"].items()]
    rows += [("cpu threads", report["cpu_threads"]), ("cuda available", report["cuda_available"])]
    if report["cuda_available"]:
        rows += [("cuda version", report["cuda_version"]), ("nccl version", report["nccl_version"] or "unavailable")]
    rows.append(("gpu count", report["gpu_count"]))
    rows += [(f"gpu {g['index']}", f"{g['name']}, {g['memory_gib']:.1f} GiB, sm_{g['sm']}") for g in report["gpus"]]
    rows.append(("distributed", " ".join(f"{k}={v}" for k, v in report["distributed"].items())))
    table = Table(title="rlkit doctor")
    table.add_column("component")
    table.add_column("version / state")
    for k, v in rows:
        table.add_row(k, str(v))
    Console().print(table)
    return 0


def run(args) -> int:
    from rlkit.jobs import check_options, json_ready, run_task

    options = {k: v for k, v in vars(args).items() if k not in ("command", "fn", "task")}
    if args.nproc_per_node and args.nproc_per_node > 1:
        from rlkit.launch import launch

        check_options(args.task, options)  # here, as rlkit run: error: ..., not as a worker's traceback

        result = launch(run_task, args.task, options, nproc_per_node=args.nproc_per_node)
    else:
        result = run_task(args.task, options)
    if args.json:
        print(json.dumps(json_ready(result), allow_nan=False))  # an unknown number is null, never NaN (not JSON)
    return 0


def launch_cmd(argv) -> int:
    from rlkit.launch import main_launch

    return main_launch(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        return launch_cmd(argv[1:])
    parser = argparse.ArgumentParser(prog="rlkit", description="RL post-training of language models")
    from rlkit import __version__

    parser.add_argument("--version", action="version", version=f"rlkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="versions, devices, CUDA/NCCL, GPU memory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=doctor)
    from rlkit.jobs import add_run_arguments

    p = sub.add_parser("run", help="run a built-in job, e.g. `rlkit run arithmetic`")
    add_run_arguments(p)
    p.set_defaults(fn=run)
    sub.add_parser("launch", help="torchrun-style launcher: rlkit launch --nproc-per-node N script.py")
    args = parser.parse_args(argv)
    if args.command != "run" or os.environ.get("RLKIT_TRACEBACK") == "1":
        return args.fn(args)
    from rlkit.checkpoint import CheckpointError, CheckpointSaveError, Preempted
    from rlkit.launch import Terminated, WorkerError

    # a bad option or input (its message names the fix): status 2, in this process or in a worker
    bad_input = (ValueError, CheckpointError)
    # SIGTERM outside the Checkpointer's watch (the warm-up, the evaluations): the process died
    # with status 143 and no word, so a preemption wrapper could not tell that nothing was saved
    previous = _on_sigterm_raise()
    try:
        return args.fn(args)
    except _SigtermOutsideSave as e:
        print(f"\nrlkit run: stopped by SIGTERM{_where_it_stopped(e, args.out)}", file=sys.stderr)
        return e.code
    except WorkerError as e:
        # a worker of --nproc-per-node N failed: its exception's line, not the whole traceback of
        # the launcher's wrapper around it; that stays in the launch's run directory
        where = (f"rank {e.rank}'s traceback is in {e.traceback_file}; RLKIT_TRACEBACK=1 prints it" if e.traceback_file
                 else "RLKIT_TRACEBACK=1 shows the worker's traceback")
        if e.exception_message is not None and _raised_one_of(e, (CheckpointSaveError,)):
            # not bad input (status 2): the run failed, and where it can go on from is what matters
            print(f"rlkit run: error: {e.exception_message.splitlines()[0]}\n"
                  f"rlkit run: stopped{_where_it_stopped(e, args.out)}\n({where})", file=sys.stderr)
            return 1
        if e.exception_message is not None and _raised_one_of(e, bad_input):
            # the same line and status one process gives for it (below): it exited 1 after a
            # "worker rank 1 failed (ranks [0] failed too)" preamble, as if the run had crashed
            print(f"rlkit run: error: {e.exception_message}\n({where})", file=sys.stderr)
            return 2
        lines = [line for line in e.worker_traceback.strip().splitlines() if line.strip()]
        cause = lines[-1].strip() if lines else "no traceback"
        first = str(e).split("; its traceback:", 1)[0]
        print(f"rlkit run: error: {first}: {cause}\n({where})", file=sys.stderr)
        return 1
    except CheckpointSaveError as e:
        # a checkpoint that could not be written (a full disk): the cause, the last complete
        # checkpoint and the command that goes on from it, as for Ctrl-C; not DCP's traceback dump
        # nor rk.fit's notebook hint (before bad_input: a CheckpointError, but not a bad option)
        from rlkit.checkpoint import _DISK_FULL

        full = " (the disk is full: free space on it before you rerun)" if e.errno in _DISK_FULL else ""
        print(f"\nrlkit run: error: saving checkpoint {e.path} failed: {e.reason}{full}\n"
              f"rlkit run: stopped{_where_it_stopped(e, args.out)}\n(RLKIT_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 1
    except bad_input as e:
        # a bad option or input: its message names the fix, a traceback would bury it
        print(f"rlkit run: error: {e}\n(RLKIT_TRACEBACK=1 shows where it was raised)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # Ctrl-C: where the run stopped and how to go on, not a traceback through the model's forward
        # nor the notebook hint rk.fit attaches
        print(f"\nrlkit run: interrupted{_where_it_stopped(e, args.out)}", file=sys.stderr)
        return 130
    except Preempted as e:  # SIGTERM: Checkpointer saved before exiting
        print(f"\nrlkit run: stopped by SIGTERM; saved {e.path}; {_resume_hint(args.out)}", file=sys.stderr)
        return e.code
    except Terminated as e:  # SIGTERM to `rlkit run --nproc-per-node N`: the workers saved, each as one process does
        print(f"\nrlkit run: stopped by SIGTERM{_where_it_stopped(e, args.out)}", file=sys.stderr)
        return e.code
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _SigtermOutsideSave(SystemExit):
    """SIGTERM to ``rlkit run`` where no Checkpointer is armed (exit status 143)."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


def _on_sigterm_raise():
    """Make SIGTERM raise :class:`_SigtermOutsideSave` (a Checkpointer arms its own handler over it
    during training and falls back to it); returns the previous handler, None off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def raise_stop(signum, frame):
        raise _SigtermOutsideSave()

    return signal.signal(signal.SIGTERM, raise_stop)


def _raised_one_of(error, classes: tuple[type, ...]) -> bool:
    """Whether the worker exception behind ``error`` (a :class:`rlkit.launch.WorkerError`) is an
    instance of one of ``classes``, as ``except classes`` would have caught it in this process:
    told by the qualified class names the worker recorded of its exception and its bases."""
    names = {f"{c.__module__}.{c.__qualname__}" for c in classes}
    return bool(names.intersection(error.exception_types))


def _resume_hint(out: str | None) -> str:
    return "rerun the same command with --resume auto to continue" if out else "rerun with --resume PATH to continue"


def _where_it_stopped(exc: BaseException, out: str | None) -> str:
    """`` after step N; the last checkpoint is ...`` for an interrupted ``rlkit run``."""
    state = getattr(exc, "state", None)
    text = f" after step {state.step}" if state is not None else ""
    if not out:
        return text + " (no checkpoints are kept without --out DIR)"
    from rlkit.checkpoint import latest

    root = os.path.join(out, "checkpoints")
    found = latest(root) if os.path.isdir(root) else None
    if found is None:
        return text + f"; no checkpoint in {root} yet"
    return text + f"; the last checkpoint is {found}: {_resume_hint(out)}"


if __name__ == "__main__":
    sys.exit(main())
