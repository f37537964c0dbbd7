"""Read a torch.profiler Chrome trace: where each benchmark phase spends its GPU time.

    python benchmarks/_trace.py trace.json.gz [--per-phase K] [--phases NAME,NAME,...]

For every phase range (the ``record_function`` names that ``_workload.Clock`` opens: rollout,
score_advantage, old_logprobs, ref_logprobs, passes_score, update; or, with ``--phases``, any
range names, such as the ``rlkit.*`` ranges every rlkit step records) it prints the range's wall time and, on the
GPU inside that range: the busy time (union of all kernel intervals), the time of communication
kernels (NCCL) and of the rest, how much of the communication ran alongside other kernels, and
the idle time (range wall minus busy). The top kernels by total time follow. Idle time means the
GPU waited for the host (launch overhead, a host sync, Python); communication that does not
overlap means collectives on the critical path.

The other direction, the host waiting for the GPU or for other ranks, is ``host_wait_ms``: the
time of blocking calls inside the phase (CUDA runtime synchronisations, copies to the host that
wait for the stream, waits on collectives, e.g. gloo's). With ``--per-phase K`` each phase also
lists where its waits come from: the innermost rlkit frame around each in traces with Python
stacks (the benchmarks' ``--profile-stacks``; stacks slow the host several-fold, so host-bound
phases then look longer than they are), else the innermost operator.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json

PHASES = ("rollout", "score_advantage", "old_logprobs", "ref_logprobs", "passes_score", "update")


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def profiler(device, stacks: bool = False):
    """``torch.profiler.profile`` recording the CPU and, on CUDA, the GPU; ``stacks``: Python
    stacks too (they name the host waits' call sites but slow the host several-fold)."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, with_stack=stacks)


def export(prof, path: str) -> list[dict]:
    """Write ``prof``'s Chrome trace to ``path`` (gzipped when it ends in .gz) and return its events."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        with open(tmp.name, "rb") as src:
            data = src.read()
    with (gzip.open if path.endswith(".gz") else open)(path, "wb") as dst:
        dst.write(data)
    return json.loads(data)["traceEvents"]


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _clip(intervals, lo, hi):
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


#: a copy or synchronisation call at least this long (us) made the host wait
_WAIT_MIN_US = 20.0


def _is_wait(e: dict) -> bool:
    """A host event that blocks: a CUDA synchronisation, a copy that waited for the stream (a
    copy to pageable host memory returns only when the GPU is done), or a collective's
    ``Work.wait()`` (gloo's collectives run on their own threads; the caller blocks there)."""
    name, cat = e.get("name", ""), e.get("cat")
    if e.get("dur", 0) < _WAIT_MIN_US:
        return False
    if cat == "cuda_runtime":
        return "Synchronize" in name or "Memcpy" in name
    return cat == "python_function" and name.startswith("<built-in method wait of")


def _ranked(items, k: int, width: int | None = None) -> list[tuple[str, float, int]]:
    """``(name, ms, count)`` of the ``k`` names with the most time, from ``(name, us)`` pairs."""
    tally = collections.defaultdict(lambda: [0.0, 0])
    for name, us in items:
        tally[name][0] += us
        tally[name][1] += 1
    return [(n[:width], t / 1e3, c) for n, (t, c) in sorted(tally.items(), key=lambda kv: -kv[1][0])[:k]]


def _wait_sites(waits: list[dict], frames: list[dict]) -> list[tuple[str, float]]:
    """``(site, us)`` of each wait: the wait under its innermost enclosing frame on the same
    thread (an rlkit Python frame where the trace has stacks, else the innermost operator). One
    sweep in time order with a stack of open frames per thread (a thread's events nest)."""
    sites = []
    order = sorted([(f["ts"], -f["dur"], 0, i) for i, f in enumerate(frames)] + [(w["ts"], -w["dur"], 1, i) for i, w in enumerate(waits)])
    open_frames: dict = collections.defaultdict(list)
    for ts, _, is_wait, i in order:
        e = waits[i] if is_wait else frames[i]
        stack = open_frames[e.get("tid")]
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < ts + e["dur"]:
            stack.pop()  # ended before this event does: not around it
        if not is_wait:
            stack.append(e)
            continue
        ours = next((f for f in reversed(stack) if f.get("cat") == "python_function" and "rlkit" in f["name"]), None)
        pick = ours or next((f for f in reversed(stack) if f.get("cat") == "cpu_op" and f is not e), None)
        what = "Work.wait" if e["name"].startswith("<built-in method wait") else e["name"]
        sites.append((f"{pick['name'][:70]} > {what}" if pick is not None else what, e["dur"]))
    return sites


def _gaps(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of ``[lo, hi)`` that no interval covers (the GPU idle), in time order."""
    out, at = [], lo
    for a, b in sorted(intervals):
        if a > at:
            out.append((at, min(a, hi)))
        at = max(at, b)
        if at >= hi:
            break
    if at < hi:
        out.append((at, hi))
    return [(a, b) for a, b in out if b > a]


def _host_in(lo: float, hi: float, frames: list[dict], samples: int = 16) -> str:
    """What the host was doing during ``[lo, hi)`` on the phase's thread, as a small sampling
    profile: at ``samples`` evenly spaced instants, the innermost rlkit frame (traces with
    stacks) and the innermost operator or runtime call under it; the two most frequent labels
    with their share, e.g. ``"70% rlkit/batch.py(78): _pad_left > aten::copy_"``."""
    inside = sorted((f for f in frames if f["ts"] < hi and f["ts"] + f["dur"] > lo), key=lambda f: -f["dur"])
    counts: collections.Counter = collections.Counter()
    for j in range(samples):
        t = lo + (j + 0.5) * (hi - lo) / samples
        around = [f for f in inside if f["ts"] <= t < f["ts"] + f["dur"]]  # outermost first
        ours = [f for f in around if f.get("cat") == "python_function" and "rlkit" in f["name"]]
        ops = [f for f in around if f.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")]
        parts = ([ours[-1]["name"][:60]] if ours else []) + ([ops[-1]["name"][:50]] if ops else [])
        counts[" > ".join(parts) or "(no range: Python between operators)"] += 1
    return "; ".join(f"{100 * n // samples}% {label}" for label, n in counts.most_common(2))


def summarise(events: list[dict], top: int = 15, per_phase: int = 0, phases: tuple[str, ...] = PHASES) -> dict:
    """Phase rows and the top kernels; with ``per_phase`` > 0 also each phase's own top
    ``per_phase`` kernels (by time inside the phase) and its kernel count, its top ``per_phase``
    host-wait sites (``waits``: site, ms, count) and its longest GPU idle gaps (``gaps``: start
    ms into the phase, ms, what the host was doing then: :func:`_host_in`). ``phases``: the range
    names to report (default the benchmarks' phases; any ``record_function`` names, e.g. rlkit's
    own ``rlkit.engine.decode``); a name seen more than once is reported as ``name``, ``name#2``, ..."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    waits = [e for e in events if e.get("ph") == "X" and _is_wait(e)]
    ranges_all = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    ranges = [e for e in ranges_all if e.get("name") in phases]
    is_comm = lambda e: "nccl" in e["name"].lower()  # noqa: E731
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if is_comm(e)]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if not is_comm(e)]
    rows = {}
    seen: collections.Counter = collections.Counter()
    for r in sorted(ranges, key=lambda e: e["ts"]):
        lo, hi = r["ts"], r["ts"] + r["dur"]
        seen[r["name"]] += 1
        key = r["name"] if seen[r["name"]] == 1 else f"{r['name']}#{seen[r['name']]}"
        c, k = _clip(comm, lo, hi), _clip(compute, lo, hi)
        busy = _union(c + k)
        comm_t, comp_t = _union(c), _union(k)
        rows[key] = {
            "wall_ms": r["dur"] / 1e3,
            "gpu_busy_ms": busy / 1e3,
            "compute_ms": comp_t / 1e3,
            "comm_ms": comm_t / 1e3,
            "comm_exposed_ms": (busy - comp_t) / 1e3,
            "idle_ms": (r["dur"] - busy) / 1e3,
            "host_wait_ms": _union(_clip([(e["ts"], e["ts"] + e["dur"]) for e in waits], lo, hi)) / 1e3,
        }
        if per_phase:
            inside = [e for e in kernels if e["ts"] >= lo and e["ts"] + e["dur"] <= hi]
            rows[key]["kernels"] = len(inside)
            rows[key]["top"] = _ranked(((e["name"], e["dur"]) for e in inside), per_phase, width=90)
            mine = [e for e in waits if e["ts"] >= lo and e["ts"] + e["dur"] <= hi]
            frames = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op", "cuda_runtime")
                      and e["ts"] < hi and e["ts"] + e["dur"] > lo]
            rows[key]["waits"] = _ranked(_wait_sites(mine, frames), per_phase)
            mine_frames = [f for f in frames + [e for e in ranges_all if e["ts"] < hi and e["ts"] + e["dur"] > lo]
                           if f.get("tid") == r.get("tid")]
            gaps = sorted(_gaps(c + k, lo, hi), key=lambda g: g[0] - g[1])[:per_phase]
            rows[key]["gaps"] = [((a - lo) / 1e3, (b - a) / 1e3, _host_in(a, b, mine_frames)) for a, b in gaps]
    return {"phases": rows, "top_kernels": _ranked(((e["name"], e["dur"]) for e in kernels), top, width=90)}


def print_summary(s: dict) -> None:
    cols = ("wall_ms", "gpu_busy_ms", "compute_ms", "comm_ms", "comm_exposed_ms", "idle_ms", "host_wait_ms")
    w = max([16] + [len(name) + 2 for name in s["phases"]])
    print(f"{'phase':<{w}}" + "".join(f"{c:>16}" for c in cols))
    for name, row in s["phases"].items():
        print(f"{name:<{w}}" + "".join(f"{row[c]:>16.1f}" for c in cols))
    print(f"\n{'kernel (top by total time)':<92}{'ms':>9}{'calls':>8}")
    for name, ms, calls in s["top_kernels"]:
        print(f"{name:<92}{ms:>9.1f}{calls:>8}")
    for phase, row in s["phases"].items():
        if "top" in row:
            print(f"\n{phase}: {row['kernels']} kernels")
            for name, ms, calls in row["top"]:
                print(f"  {name:<90}{ms:>9.2f}{calls:>8}")
            if row.get("gaps"):
                print(f"  longest GPU idle gaps (of {row['idle_ms']:.1f} ms idle): at ms, ms, host inside")
                for at, ms, where in row["gaps"]:
                    print(f"    {at:>9.2f}{ms:>9.2f}  {where}")
            if row.get("waits"):
                print(f"  host waits ({row['host_wait_ms']:.1f} ms):")
                for name, ms, calls in row["waits"]:
                    print(f"    {name:<88}{ms:>9.2f}{calls:>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--per-phase", type=int, default=0, metavar="K",
                    help="also each phase's top K kernels, host-wait sites and longest GPU idle gaps")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help="comma-separated range names to report (default: the benchmarks' phases); e.g. "
                         "rlkit.engine.generate,rlkit.old_logprobs,rlkit.update.micro_batch for any rlkit step's trace")
    args = ap.parse_args()
    print_summary(summarise(_load(args.trace), args.top, args.per_phase, tuple(p for p in args.phases.split(",") if p)))


if __name__ == "__main__":
    main()
