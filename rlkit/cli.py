"""The ``rlkit`` command: ``doctor``, ``run <task>``, ``launch``."""
from __future__ import annotations

import argparse
import json
import os
import sys


def doctor(args) -> int:
    """Print versions, devices, CUDA/NCCL and GPU memory: the first environment check."""
    import platform

    import torch
    import transformers
    from rich.console import Console
    from rich.table import Table

    import rlkit

    rows = [
        ("rlkit", rlkit.__version__),
        ("python", platform.python_version()),
        ("platform", platform.platform()),
        ("torch", torch.__version__),
        ("transformers", transformers.__version__),
    ]
    for name in ("tensordict", "einops", "tokenizers", "vllm", "wandb", "ipywidgets"):
        try:
            mod = __import__(name)
            rows.append((name, getattr(mod, "__version__", "installed")))
        except Exception:  # noqa: BLE001 - optional packages
            rows.append((name, "not installed"))
    rows.append(("cpu threads", str(torch.get_num_threads())))
    cuda = torch.cuda.is_available()
    rows.append(("cuda available", str(cuda)))
    if cuda:
        rows.append(("cuda version", str(torch.version.cuda)))
        try:
            rows.append(("nccl version", ".".join(map(str, torch.cuda.nccl.version()))))
        except Exception:  # noqa: BLE001
            rows.append(("nccl version", "unavailable"))
        rows.append(("gpu count", str(torch.cuda.device_count())))
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"gpu {i}", f"{p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}"))
    else:
        rows.append(("gpu count", "0"))
    rows.append(("distributed", f"gloo={torch.distributed.is_gloo_available()} nccl={torch.distributed.is_nccl_available()}"))
    if args.json:
        print(json.dumps(dict(rows)))
        return 0
    table = Table(title="rlkit doctor")
    table.add_column("component")
    table.add_column("version / state")
    for k, v in rows:
        table.add_row(k, v)
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
    from rlkit.checkpoint import CheckpointError, Preempted

    try:
        return args.fn(args)
    except (ValueError, CheckpointError) as e:
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
