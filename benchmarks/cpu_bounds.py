"""Where the CPU preset's GRPO step is bound on this machine: the measurements behind issue 5's
CPU target (3x TRL's throughput on 2 cores), each taken side by side in one run.

    python benchmarks/cpu_bounds.py [--threads 2] [--repeats 20] [--json out.json]

Four parts, each a table; one ``RESULT_JSON {...}`` line at the end:

- ``micro-batches``: the update of one fixed GRPO batch (64 rows) in 1, 2 and 4 micro-batches,
  interleaved. A least-squares line ``t = rest + k x per_micro_batch`` over the micro-batch count
  ``k`` splits the update into what every forward+backward costs whatever its size (operator
  calls, autograd, Python) and the rest (the work that scales with tokens, and the optimizer).
- ``matmul``: ``F.linear`` at the update's and the decode step's shapes, 1 and 2 threads, in
  GFLOP/s: how close the matrix products already are to the cores' float32 peak.
- ``cores``: the whole step (rollout, score, advantage, update) in one process on all threads,
  against two processes of one thread each running concurrently on half the prompts each, with no
  communication: the ceiling of data parallelism over the cores.
- ``gloo``: the latency of one ``all_gather`` and one ``all_reduce`` between two local processes
  (gloo, one thread each) for 64 B and for the preset's gradient size, which any data-parallel
  step over the cores pays per collective.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _workload import PRESETS, build, param_count, reward  # noqa: E402


def _state_and_batch():
    from rlkit.data import as_prompts
    from rlkit.optim import adamw
    from rlkit.state import init
    from rlkit.transforms.advantage import advantage
    from rlkit.transforms.rollout import rollout
    from rlkit.transforms.score import score

    wl, model, tok, texts = build("cpu", torch.device("cpu"))
    prompts = as_prompts(texts, tok)
    state = init(model, adamw(lr=wl.lr), tokenizer=tok)
    batch = advantage(score(rollout(state, prompts, n=wl.n, max_new_tokens=wl.max_new_tokens, seed=0), reward,
                            tokenizer=tok), "grpo")
    return wl, model, tok, batch


def micro_batches(repeats: int) -> dict:
    import copy

    from rlkit.optim import adamw
    from rlkit.state import init
    from rlkit.transforms.update import update

    wl, model, tok, batch = _state_and_batch()
    rows = batch.batch_size[0]
    counts = (1, 2, 4)
    states = {k: init(copy.deepcopy(model), adamw(lr=wl.lr), tokenizer=tok) for k in counts}
    times: dict[int, list[float]] = {k: [] for k in counts}
    for r in range(repeats + 3):
        for k in counts:
            t = time.perf_counter()
            states[k], _ = update(states[k], batch, loss="ppo_clip", micro_batch_size=rows // k)
            if r >= 3:
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    xs, ys = list(counts), [med[k] for k in counts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    rest = my - slope * mx
    # the tokens the training forward sees: the responses, and each group's prompt once (shared)
    first = torch.ones_like(batch["group"], dtype=torch.bool)
    first[1:] = batch["group"][1:] != batch["group"][:-1]
    tokens = float(batch["response_mask"].sum() + batch["prompt_mask"][first].sum())
    return {"rows": rows, "tokens": tokens, "update_ms_median": {str(k): 1e3 * med[k] for k in counts},
            "per_micro_batch_ms": 1e3 * slope, "rest_ms": 1e3 * rest}


def matmul(shapes: list[tuple[str, int, int, int]], reps: int = 200) -> list[dict]:
    out = []
    before = torch.get_num_threads()
    for name, m, k, n in shapes:
        row = {"shape": name, "m": m, "k": k, "n": n}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x, w = torch.randn(m, k), torch.randn(n, k)
            for _ in range(20):
                F.linear(x, w)
            t = time.perf_counter()
            for _ in range(reps):
                F.linear(x, w)
            dt = (time.perf_counter() - t) / reps
            row[f"us_{threads}t"] = 1e6 * dt
            row[f"gflops_{threads}t"] = 2 * m * k * n / dt / 1e9
        out.append(row)
    torch.set_num_threads(before)
    return out


def _step_child(n_prompts: int, threads: int, steps: int) -> None:
    """Child process of ``cores``: the step ``grpo_step.py`` times, on ``n_prompts`` prompts and
    ``threads`` threads."""
    torch.set_num_threads(threads)
    from grpo_step import grpo_step

    from rlkit.data import as_prompts
    from rlkit.optim import adamw
    from rlkit.state import init

    wl, model, tok, texts = build("cpu", torch.device("cpu"))
    state = init(model, adamw(lr=wl.lr), tokenizer=tok)
    prompts = as_prompts(texts[:n_prompts], tok)
    times = []
    for i in range(steps + 3):
        state, t, _ = grpo_step(state, prompts, wl, torch.device("cpu"))
        if i >= 3:
            times.append(t["step"])
    print("STEP_MS " + json.dumps([1e3 * t for t in times]), flush=True)


def cores(threads: int, steps: int) -> dict:
    wl = PRESETS["cpu"]
    me = os.path.abspath(__file__)

    def launch(n_prompts: int, t: int) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": str(t)}
        return subprocess.Popen([sys.executable, me, "--child", str(n_prompts), str(t), str(steps)], env=env,
                                stdout=subprocess.PIPE, text=True)

    def read(p: subprocess.Popen) -> list[float]:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"child exited with {p.returncode}")
        return json.loads(next(line for line in out.splitlines() if line.startswith("STEP_MS "))[8:])

    one = read(launch(wl.n_prompts, threads))
    half = wl.n_prompts // 2
    pair = [launch(half, 1), launch(half, 1)]
    two = [read(p) for p in pair]
    # the pair's step is the slower process's: a data-parallel step waits for both
    paired = [max(a, b) for a, b in zip(*two)]
    return {"one_process_ms": statistics.median(one), "two_processes_ms": statistics.median(paired),
            "two_processes_each_ms": [statistics.median(t) for t in two],
            "ceiling_speedup": statistics.median(one) / statistics.median(paired)}


def _gloo_child(rank: int, init_file: str, sizes: list[int], reps: int, queue) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    result = {}
    for numel in sizes:
        x, out = torch.randn(numel), torch.empty(2 * numel)
        for name, fn in (("all_gather", lambda: dist.all_gather_into_tensor(out, x)),
                         ("all_reduce", lambda: dist.all_reduce(x))):
            for _ in range(10):
                fn()
            dist.barrier()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            result[f"{name}_{numel * 4}B_us"] = 1e6 * (time.perf_counter() - t) / reps
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def gloo(grad_numel: int, reps: int = 100) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_gloo_child, args=(r, init_file, [16, grad_numel], reps, queue)) for r in range(2)]
        for p in procs:
            p.start()
        result = queue.get(timeout=300)
        for p in procs:
            p.join(timeout=60)
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--threads", type=int, default=2, help="threads of the one-process measurements")
    ap.add_argument("--repeats", type=int, default=20, help="timed updates per micro-batch count, timed steps per process")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for flag, value in (("--threads", args.threads), ("--repeats", args.repeats)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    if args.json and (os.path.isdir(args.json) or not os.path.isdir(os.path.dirname(os.path.abspath(args.json)))):
        ap.error(f"--json {args.json}: give a file path in a folder that exists")
    if args.child:
        return _step_child(*args.child)
    torch.set_num_threads(args.threads)
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "python": platform.python_version(),
              "cpu_threads": args.threads, "cpus": os.cpu_count()}

    mb = micro_batches(args.repeats)
    result["micro_batches"] = mb
    print(f"\nupdate of one fixed batch ({mb['rows']} rows, {mb['tokens']:.0f} tokens), median of {args.repeats}")
    for k, ms in mb["update_ms_median"].items():
        print(f"  {k} micro-batch(es)                  {ms:7.2f} ms")
    print(f"  fit: per micro-batch              {mb['per_micro_batch_ms']:7.2f} ms")
    print(f"  fit: the rest (tokens, optimizer) {mb['rest_ms']:7.2f} ms")

    t = int(mb["tokens"])
    shapes = [("update q/o (tokens x 128 -> 128)", t, 128, 128), ("update gate/up (tokens x 128 -> 512)", t, 128, 512),
              ("update down (tokens x 512 -> 128)", t, 512, 128), ("decode gate/up (64 x 128 -> 512)", 64, 128, 512),
              ("decode down (64 x 512 -> 128)", 64, 512, 128)]
    mm = matmul(shapes)
    result["matmul"] = mm
    print(f"\n{'F.linear':40s} {'1 thread':>18s} {'2 threads':>18s}")
    for row in mm:
        print(f"{row['shape']:40s} {row['us_1t']:8.1f} us {row['gflops_1t']:4.0f} GF/s {row['us_2t']:8.1f} us {row['gflops_2t']:4.0f} GF/s")

    c = cores(args.threads, args.repeats)
    result["cores"] = c
    print(f"\nwhole step, median of {args.repeats} (no communication between the two processes)")
    print(f"  one process, {args.threads} threads, all prompts     {c['one_process_ms']:7.2f} ms")
    print(f"  two processes, 1 thread, half each   {c['two_processes_ms']:7.2f} ms (each {c['two_processes_each_ms'][0]:.1f}, "
          f"{c['two_processes_each_ms'][1]:.1f})")
    print(f"  data parallelism over the cores: at most {c['ceiling_speedup']:.2f}x before any collective")

    model = build("cpu", torch.device("cpu"))[1]
    g = gloo(param_count(model))
    result["gloo"] = g
    print("\ngloo between two local processes, one collective")
    for k, v in g.items():
        print(f"  {k:32s} {v:8.0f} us")
    print("RESULT_JSON " + json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
