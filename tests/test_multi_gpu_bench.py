"""Smoke test of benchmarks/multi_gpu.py on the CPU preset: 2 processes (gloo) under torchrun, and 1.

No timing assertions; the figures that have an exact expected value are checked against it
(weight-sync bytes = the model's bytes, greedy TP tokens = one device's, the --compare ratios).
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "multi_gpu.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import multi_gpu  # noqa: E402
from _workload import PRESETS  # noqa: E402

pytestmark = pytest.mark.distributed


def _torchrun(env: dict, nproc: int, out_json, *extra: str) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), SCRIPT,
           "--preset", "cpu", "--steps", "1", "--warmup", "1", "--json", str(out_json), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out_json) as f:
        return json.load(f), proc.stdout


@pytest.fixture(scope="module")
def two(tmp_path_factory, child_env):
    return _torchrun(child_env(2), 2, tmp_path_factory.mktemp("mg") / "two.json", "--scenario", "all")


def test_two_processes_every_scenario(two):
    result, stdout = two
    wl = PRESETS["cpu"]
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    for name in ("colocated", "split", "tp"):
        assert "error" not in result[name] and "skipped" not in result[name], (name, result[name])
    # the printed RESULT_JSON line is the object written to --json
    line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT_JSON ")]
    assert len(line) == 1 and json.loads(line[0][len("RESULT_JSON "):]).keys() == result.keys()

    col = result["colocated"]
    assert col["rows"] == wl.rows == 64
    assert wl.rows <= col["tokens_generated"] <= wl.rows * wl.max_new_tokens
    assert col["responses_per_s"] == pytest.approx(wl.rows / col["step_seconds_median"])
    assert set(col["phase_seconds_median"]) >= {"rollout", "update"}
    # FSDP(2) -> replicated after the warm-up update: every rank receives the whole float32 model
    assert col["sync_bytes_median"] == 4 * col["params"]

    split = result["split"]
    assert split["beta"] == 0.0 and "NotImplementedError" in split["kl_reference_under_split"]
    assert "ranks [0]" in split["layout"] and "ranks [1]" in split["layout"]
    # the rollout rank (1) received the full model from the actor rank (0) once per timed step
    assert split["sync_bytes_per_step_median"] == 4 * col["params"] > 0
    assert split["sync_bytes_sent_last_step"] == split["sync_bytes_per_step_median"]

    tp = result["tp"]
    greedy = tp["greedy_vs_single_device"]
    assert tp["token_agreement"] == 1.0 and greedy["rows_identical_frac"] == 1.0
    assert tp["float32_check"]["token_agreement"] == 1.0 and tp["float32_check"]["rows_identical_frac"] == 1.0
    assert greedy["first_divergence_min"] is None
    assert wl.n_prompts <= greedy["tokens_compared"] <= wl.n_prompts * wl.max_new_tokens
    assert tp["reshard_bytes_total"] > 0
    for key in ("tp_sampling", "tp_eager_sampling", "replicated_sampling", "replicated_eager_sampling"):
        assert tp[key]["tokens_per_s"] > 0 and tp[key]["tokens"] >= wl.rows
    # on CPU the engine's fast paths are off by default; the record says so (on GPU: all on)
    assert tp["tp_engine"] == {"cuda_graphs": False, "graph_capture_failed": False, "fused": False, "compiled": False,
                               "compile_error": None}
    assert tp["float32_check"]["single_device_fast_vs_eager"]["token_agreement"] == 1.0


def test_one_process_and_compare(two, tmp_path, child_env):
    one, _ = _torchrun(child_env(1), 1, tmp_path / "one.json", "--scenario", "all")
    assert one["world_size"] == 1 and "error" not in one["colocated"]
    assert "skipped" in one["split"] and "skipped" in one["tp"]
    out = multi_gpu.compare(str(tmp_path / "one.json"), _write(tmp_path / "two.json", two[0]))
    speedup = one["colocated"]["step_seconds_median"] / two[0]["colocated"]["step_seconds_median"]
    assert out["speedup"] == pytest.approx(speedup) and out["efficiency"] == pytest.approx(speedup / 2)


def test_compare_hand_worked(tmp_path):
    base = {"preset": "cpu", "colocated": {"rows": 64, "tokens_generated": 640.0, "step_seconds_median": 3.0,
                                           "responses_per_s": 64 / 3.0, "generated_tokens_per_s": 640 / 3.0,
                                           "phase_seconds_median": {"rollout": 1.0, "update": 2.0}}}
    one = {**base, "world_size": 1}
    four = {**base, "world_size": 4, "colocated": {**base["colocated"], "step_seconds_median": 1.0,
                                                   "responses_per_s": 64.0, "generated_tokens_per_s": 640.0,
                                                   "phase_seconds_median": {"rollout": 0.5, "update": 0.5}}}
    out = multi_gpu.compare(_write(tmp_path / "1.json", one), _write(tmp_path / "4.json", four))
    assert out == {"speedup": 3.0, "efficiency": 0.75, "world_sizes": [1, 4]}


def _write(path, obj) -> str:
    with open(path, "w") as f:
        json.dump(obj, f)
    return str(path)


def test_weak_scaling_doubles_the_global_batch_and_compares_throughput(two, tmp_path, child_env):
    trace = tmp_path / "weak_trace.json.gz"
    weak, stdout = _torchrun(child_env(2), 2, tmp_path / "weak.json", "--scenario", "colocated", "--weak", "--profile", str(trace))
    col = weak["colocated"]
    assert "error" not in col and col["scaling"] == "weak"
    # --profile: rank 0 wrote a Chrome trace whose phase ranges _trace.py finds, and printed them
    import _trace

    summary = _trace.summarise(_trace._load(str(trace)))
    assert {"rollout", "passes_score", "update"} <= set(summary["phases"])
    assert "-- profiled step (rank 0 of 2)" in stdout
    assert set(col["gc_during_timed_steps"]) == {"gen0", "gen1", "gen2"}
    assert col["rows"] == 2 * PRESETS["cpu"].rows
    assert col["responses_per_s"] == pytest.approx(col["rows"] / col["step_seconds_median"])
    strong = two[0]["colocated"]
    assert strong["scaling"] == "strong" and strong["rows"] == PRESETS["cpu"].rows
    out = multi_gpu.compare(_write(tmp_path / "strong.json", two[0]), str(tmp_path / "weak.json"))
    # throughput ratio: twice the rows per step, at the ratio of the step times
    expected = 2 * strong["step_seconds_median"] / col["step_seconds_median"]
    assert out["speedup"] == pytest.approx(expected)


def test_trace_summary_hand_worked():
    # one phase 0..100 us; compute kernels 10-40 and 50-60, an NCCL kernel 30-70:
    # busy = union 10-70 = 60, compute 40, communication 40, exposed = 60 - 40 = 20, idle 40
    import _trace

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "update", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10, "dur": 30},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 50, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 30, "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "late", "ts": 150, "dur": 5},  # outside the phase
    ]
    row = _trace.summarise(events)["phases"]["update"]
    expected = {"wall_ms": 0.1, "gpu_busy_ms": 0.06, "compute_ms": 0.04, "comm_ms": 0.04, "comm_exposed_ms": 0.02, "idle_ms": 0.04, "host_wait_ms": 0.0}
    assert row == pytest.approx(expected)
    top = _trace.summarise(events)["top_kernels"]
    assert top[0][0] == "gemm" and top[0][1] == pytest.approx(0.04) and top[0][2] == 2
    # per phase: only the kernels inside the phase, ranked by their time there
    row = _trace.summarise(events, per_phase=2)["phases"]["update"]
    assert row["kernels"] == 3
    assert [(n, c) for n, _, c in row["top"]] == [("gemm", 2), ("ncclDevKernel_AllGather", 1)]
    assert row["top"][0][1] == pytest.approx(0.04) and row["top"][1][1] == pytest.approx(0.04)


def test_trace_host_waits_hand_worked():
    # phase 0..1000 us on thread 1: an rlkit frame 100-500 holding aten::item 200-400, which
    # holds a cudaStreamSynchronize 250-390 (140 us); a 5 us cudaMemcpyAsync (not a wait); a
    # collective's Work.wait 600-700 under another rlkit frame; a wait on thread 2 outside any frame;
    # and a synchronisation after the phase (not counted)
    import _trace

    x = lambda cat, name, ts, dur, tid=1: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}  # noqa: E731
    events = [
        x("user_annotation", "update", 0, 1000),
        x("python_function", "rlkit/transforms/update.py(10): update", 50, 900),
        x("python_function", "rlkit/batch.py(5): pull", 100, 400),
        x("cpu_op", "aten::item", 200, 200),
        x("cuda_runtime", "cudaStreamSynchronize", 250, 140),
        x("cuda_runtime", "cudaMemcpyAsync", 420, 5),
        x("python_function", "rlkit/parallel/placement.py(7): gather", 580, 200),
        x("python_function", "<built-in method wait of pybind11 object at 0x1>", 600, 100),
        x("cuda_runtime", "cudaDeviceSynchronize", 800, 30, tid=2),
        x("cuda_runtime", "cudaStreamSynchronize", 1200, 50),
    ]
    row = _trace.summarise(events, per_phase=5)["phases"]["update"]
    assert row["host_wait_ms"] == pytest.approx((140 + 100 + 30) / 1e3)
    assert {(n, c) for n, _, c in row["waits"]} == {
        ("rlkit/batch.py(5): pull > cudaStreamSynchronize", 1),
        ("rlkit/parallel/placement.py(7): gather > Work.wait", 1),
        ("cudaDeviceSynchronize", 1),
    }
    assert row["waits"][0][0].startswith("rlkit/batch.py") and row["waits"][0][1] == pytest.approx(0.14)
    # without stacks (no python_function events) the innermost operator names the site
    plain = [e for e in events if e["cat"] != "python_function"]
    sites = [n for n, _, _ in _trace.summarise(plain, per_phase=5)["phases"]["update"]["waits"]]
    assert "aten::item > cudaStreamSynchronize" in sites


def test_trace_idle_gaps_hand_worked():
    # phase 0..100 us; kernels 10-30 and 25-40 (one busy stretch 10-40) and 70-80: idle 0-10,
    # 40-70, 80-100; the host was inside "rlkit.score.decode" during 40-70
    import _trace

    x = lambda cat, name, ts, dur, tid=1: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}  # noqa: E731
    events = [
        x("user_annotation", "passes_score", 0, 100),
        x("kernel", "a", 10, 20, tid=7), x("kernel", "b", 25, 15, tid=7), x("kernel", "c", 70, 10, tid=7),
        x("user_annotation", "rlkit.score.decode", 35, 40),
        x("cpu_op", "aten::copy_", 85, 10, tid=2),  # another thread: not the host's main thread
    ]
    assert _trace._gaps([(10, 30), (25, 40), (70, 80)], 0, 100) == [(0, 10), (40, 70), (80, 100)]
    row = _trace.summarise(events, per_phase=2)["phases"]["passes_score"]
    assert row["idle_ms"] == pytest.approx(0.06)
    assert row["gaps"] == [(pytest.approx(0.04), pytest.approx(0.03), "100% rlkit.score.decode"),
                           (pytest.approx(0.08), pytest.approx(0.02), "100% passes_score")]
    # the sampling profile of a gap: an rlkit frame over its first quarter, another over the
    # rest, each with the innermost operator under it
    frames = [x("python_function", "rlkit/a.py(1): f", 0, 25), x("cpu_op", "aten::copy_", 0, 25),
              x("python_function", "rlkit/b.py(2): g", 25, 75)]
    assert _trace._host_in(0, 100, frames) == "75% rlkit/b.py(2): g; 25% rlkit/a.py(1): f > aten::copy_"


def test_trace_phases_by_name_with_repeats():
    # any range names can be the phases; a name seen twice is reported twice, in time order
    import _trace

    x = lambda cat, name, ts, dur: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1}  # noqa: E731
    events = [
        x("user_annotation", "rlkit.update.micro_batch", 0, 100), x("kernel", "gemm", 10, 50),
        x("user_annotation", "rlkit.update.micro_batch", 200, 100), x("kernel", "gemm", 200, 100),
        x("user_annotation", "update", 0, 300),
    ]
    rows = _trace.summarise(events, phases=("rlkit.update.micro_batch",))["phases"]
    assert list(rows) == ["rlkit.update.micro_batch", "rlkit.update.micro_batch#2"]
    assert rows["rlkit.update.micro_batch"]["idle_ms"] == pytest.approx(0.05)
    assert rows["rlkit.update.micro_batch#2"]["idle_ms"] == pytest.approx(0.0)


def test_weight_sync_bench_checks_every_layout_exactly(tmp_path, child_env):
    """benchmarks/weight_sync.py (the tutorial's sync table) on 2 gloo processes, tiny shape: FSDP
    equals one process, every layout arrives equal to the training weights, and the bytes each
    rank receives are what the layout says (every parameter for replicated, in its dtype)."""
    out = tmp_path / "sync.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", "weight_sync.py"), "--check", "--sync", "--train", "--tiny",
           "--repeats", "1", "--steps", "1", "--batch", "2", "--seq", "16", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(2), timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r.get("layout", r["what"]): r for r in json.loads(out.read_text())}
    assert rows["fsdp_vs_single"]["grad_err"] < 1e-5 and rows["fsdp_vs_single"]["param_err"] < 1e-5
    params = rows["model"]["params"]
    assert rows["replicated_fp32"]["exact"] and rows["replicated_fp32"]["gbytes"] * 1e9 == pytest.approx(4 * params)
    assert rows["replicated_bf16"]["exact"] and rows["replicated_bf16"]["gbytes"] * 1e9 == pytest.approx(2 * params)
    assert rows["tp2_bf16"]["exact"] and rows["tp2_bf16"]["gbytes"] < rows["replicated_bf16"]["gbytes"]
    assert rows["train"]["world"] == 2 and rows["train"]["tokens_per_second"] > 0
