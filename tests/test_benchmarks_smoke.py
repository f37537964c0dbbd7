"""Smoke test of the benchmark's CPU preset: it runs end to end and reports sane numbers (no timing assertions)."""
import json
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import _workload  # noqa: E402
import grpo_step  # noqa: E402


def test_word_tokenizer_one_token_per_word():
    tok = _workload.word_tokenizer(1000)
    assert len(tok) == 1000
    ids = tok("t5 t999 t4", add_special_tokens=False)["input_ids"]
    assert ids == [5, 999, 4]
    assert tok.decode(ids) == "t5 t999 t4"
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0


def test_cpu_preset_runs_and_reports(tmp_path, capsys):
    torch.manual_seed(0)
    path = tmp_path / "result.json"
    result = grpo_step.main(["--preset", "cpu", "--device", "cpu", "--steps", "1", "--warmup", "0", "--json", str(path)])
    wl = _workload.PRESETS["cpu"]
    assert result["rows"] == wl.n_prompts * wl.n == 64
    # up to 16 new tokens per row, at least one each
    assert wl.rows <= result["tokens_generated"] <= wl.rows * wl.max_new_tokens
    assert result["step_seconds_median"] > 0 and result["rollout_tokens_per_s"] > 0
    assert result["update_tflops"] > 0 and result["params"] == sum(
        p.numel() for p in _workload.build("cpu", torch.device("cpu"))[1].parameters()
    )
    # float32 on CPU: the engine's behaviour log-probs equal the training forward's
    assert result["logprob_gap_mean_abs"] < 1e-4
    assert result["clipfrac_step1"] == pytest.approx(0.0, abs=1e-6)
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT_JSON ")][-1]
    assert json.loads(line[len("RESULT_JSON ") :])["rows"] == 64
    assert json.loads(path.read_text())["preset"] == "cpu"


def test_packed_rows_attention_fallback_equals_padded_layout(monkeypatch):
    """The packed path's non-flash attention (rows scattered into a padded batch) computes the
    same log-probs as transformers' padded layout (GQA and MHA)."""
    from rlkit.batch import make_batch
    from rlkit.models import logprobs as L
    from rlkit.models import response_logprobs, tiny
    from rlkit.models.tokenizers import char_tokenizer

    tok = char_tokenizer("0123456789+= ")
    batch = make_batch([[5, 6, 7], [8], [9, 10, 11, 12, 13]], [[5, 5, 5, 6], [7], [8, 9]])
    args = [batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    for kv_heads in (2, 4):
        model = tiny(tok, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=kv_heads,
                     initializer_range=0.2)
        with torch.no_grad():
            padded, _ = response_logprobs(model, *args, layout="padded")
            monkeypatch.setattr(L, "_can_use_varlen", lambda backbone, device, tokens=0, longest=None: True)
            packed, _ = response_logprobs(model, *args)
            monkeypatch.undo()
        torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
        assert padded[batch["response_mask"]].abs().min() > 0  # real values, not an all-zero output


def test_profile_trace_names_rlkit_ranges(tmp_path):
    # --profile traces one more step: rlkit's named ranges are in it, nested where they run
    import _trace

    path = tmp_path / "step.json.gz"
    grpo_step.main(["--preset", "cpu", "--device", "cpu", "--steps", "1", "--warmup", "0", "--profile", str(path)])
    events = [e for e in _trace._load(str(path)) if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    spans = {}
    for e in events:
        spans.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
    wanted = ("rollout", "update", "rlkit.weight_sync", "rlkit.engine.generate", "rlkit.engine.prefill", "rlkit.engine.decode",
              "rlkit.rollout.batch", "rlkit.score.decode", "rlkit.update.micro_batch", "rlkit.update.optimizer")
    assert set(wanted) <= set(spans), sorted(set(wanted) - set(spans))
    inside = lambda inner, outer: all(any(a <= x and y <= b for a, b in spans[outer]) for x, y in spans[inner])  # noqa: E731
    assert inside("rlkit.engine.prefill", "rlkit.engine.generate") and inside("rlkit.engine.decode", "rlkit.engine.generate")
    assert inside("rlkit.engine.generate", "rollout") and inside("rlkit.update.micro_batch", "update")
    # the prefill ends before the decode starts
    assert spans["rlkit.engine.prefill"][0][1] <= spans["rlkit.engine.decode"][0][0]


def test_cpu_update_ab_runs_and_its_variants_train_alike():
    # benchmarks/cpu_update_ab.py toggles back the CPU training changes; the bit-identical ones
    # must give equal parameters after the same updates, the others the same up to rounding, and
    # it must leave rlkit's defaults as it found them
    import cpu_update_ab
    from rlkit.models import logprobs as L

    before = (L._shared_padded, L.CHECKPOINT_MIN_LOGITS, L.CPU_MATH_ATTENTION, L.CPU_INDEX_SELECT)
    # one thread: on a loaded 2-core machine two threads split some reductions differently from
    # update to update, so even a variant against itself is not bit-identical there (measured with
    # two busy processes beside the test); the variants' arithmetic is what is checked here
    threads = torch.get_num_threads()
    try:
        result = cpu_update_ab.main(["--repeats", "4", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    variants = result["variants"]
    assert set(variants) == set(cpu_update_ab.VARIANTS)
    assert all(v["update_ms_median"] > 0 for v in variants.values())
    assert all(variants[name]["bit_identical"] for name in cpu_update_ab.BIT_IDENTICAL)
    # lr 1e-6 for 4 updates moves a parameter by ~4e-6; rounding moves it far less
    assert all(v["max_param_diff"] < 1e-7 for v in variants.values())
    assert (L._shared_padded, L.CHECKPOINT_MIN_LOGITS, L.CPU_MATH_ATTENTION, L.CPU_INDEX_SELECT) == before


def test_cpu_bf16_preset_is_the_cpu_preset_in_bf16():
    cpu, bf16 = _workload.PRESETS["cpu"], _workload.PRESETS["cpu-bf16"]
    assert bf16.dtype == torch.bfloat16 and cpu.dtype == torch.float32
    assert {**vars(bf16), "name": "cpu", "dtype": torch.float32} == vars(cpu)
    wl, model, tok, texts = _workload.build("cpu-bf16", torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.bfloat16 and len(texts) == wl.n_prompts


def test_cpu_bounds_parts_report_consistent_figures():
    import cpu_bounds

    torch.manual_seed(0)
    mb = cpu_bounds.micro_batches(repeats=1)
    assert mb["rows"] == 64 and set(mb["update_ms_median"]) == {"1", "2", "4"}
    # the line rest + k * per_micro_batch through the three medians, against torch's least squares
    ks = sorted(mb["update_ms_median"], key=int)
    design = torch.tensor([[1.0, float(k)] for k in ks], dtype=torch.float64)
    times = torch.tensor([[mb["update_ms_median"][k]] for k in ks], dtype=torch.float64)
    rest, per = torch.linalg.lstsq(design, times).solution.flatten().tolist()
    assert mb["rest_ms"] == pytest.approx(rest, rel=1e-9, abs=1e-9)
    assert mb["per_micro_batch_ms"] == pytest.approx(per, rel=1e-9, abs=1e-9)
    # shared prompts: the forward sees each group's prompt once, so fewer tokens than the rows hold
    assert 64 <= mb["tokens"] < 64 * (16 + 8)
    rows = cpu_bounds.matmul([("t", 32, 16, 8)], reps=2)
    assert rows[0]["gflops_1t"] > 0 and rows[0]["gflops_2t"] > 0
    g = cpu_bounds.gloo(1000, reps=2)
    assert set(g) == {f"{op}_{b}B_us" for op in ("all_gather", "all_reduce") for b in (64, 4000)}
    assert all(v > 0 for v in g.values())


def test_overlapped_steps_are_followed_by_steps_with_the_phases_one_at_a_time(monkeypatch, capsys):
    """With old-policy and reference passes (the GPU preset's shape of step), the main steps queue
    the passes and the update together, so neither has a time of its own; the default run then
    times the phases one at a time as well, and the table gives the passes and the update's rate."""
    import dataclasses

    monkeypatch.setitem(_workload.PRESETS, "cpu", dataclasses.replace(_workload.PRESETS["cpu"], old_logprobs=True, beta=0.04))
    torch.manual_seed(0)
    result = grpo_step.main(["--preset", "cpu", "--device", "cpu", "--steps", "1", "--warmup", "0"])
    assert "passes_score" in result["phase_seconds_median"] and "update_tflops" not in result
    serial = result["configs"][grpo_step.SERIAL]
    assert {"old_logprobs", "ref_logprobs", "update"} <= set(serial["phase_seconds_median"])
    assert serial["update_tflops"] > 0 and serial["old_logprobs_tflops"] > 0 and serial["ref_logprobs_tflops"] > 0
    out = capsys.readouterr().out
    for row in ("old logprobs pass", "ref logprobs pass", "update (fwd+bwd+AdamW)", "phases one at a time (step)"):
        assert row in out, row
    skipped = grpo_step.main(["--preset", "cpu", "--device", "cpu", "--steps", "1", "--warmup", "0", "--no-serial"])
    assert "configs" not in skipped


def test_rounds_alternate_the_arms_and_take_ratios_within_each_round(monkeypatch, tmp_path):
    # TRL is not a test dependency: a fake run whose step time changes from round to round, as a
    # drifting machine's would; each round's ratios must use that round's TRL figure
    calls = []

    def fake_trl(args, device):
        calls.append(args.preset)
        step = 0.1 * len(calls)
        return {"framework": "trl", "step_seconds_median": step, "first_step_seconds": 2 * step,
                "responses_per_s": 64 / step, "peak_memory_gb": None}

    monkeypatch.setattr(grpo_step, "run_trl", fake_trl)
    path = tmp_path / "r.json"
    result = grpo_step.main(["--preset", "cpu", "--device", "cpu", "--steps", "1", "--warmup", "0",
                             "--compare", "trl", "--rounds", "2", "--json", str(path)])
    assert calls == ["cpu"] * 3  # the main comparison, then one TRL run per round
    rounds = result["rounds"]["rounds"]
    assert [r["trl_ms"] for r in rounds] == pytest.approx([200.0, 300.0])
    for r in rounds:
        assert r["rlkit_ms"] > 0 and r["rlkit_compiled_ms"] > 0
        assert r["speedup"] == pytest.approx(r["trl_ms"] / r["rlkit_ms"])
        assert r["speedup_compiled"] == pytest.approx(r["trl_ms"] / r["rlkit_compiled_ms"])
    assert result["rounds"]["speedup_median"] == pytest.approx(sum(r["speedup"] for r in rounds) / 2)
    assert json.loads(path.read_text())["rounds"]["rounds"][1]["trl_ms"] == pytest.approx(300.0)


def test_rounds_need_the_trl_comparison():
    with pytest.raises(SystemExit):
        grpo_step.main(["--preset", "cpu", "--device", "cpu", "--rounds", "2"])


@pytest.mark.distributed
def test_grad_reduce_benchmark_compares_the_two_modes(tmp_path):
    """``grad_reduce.py --local 2``: two gloo processes, 2 micro-batches a rank."""
    import grad_reduce

    path = tmp_path / "gr.json"
    result = grad_reduce.main(["--local", "2", "--threads", "1", "--rows", "8", "--micro", "4", "--repeats", "1",
                               "--json", str(path)])
    assert json.loads(path.read_text()) == result
    modes = result["modes"]
    # FSDP's 3 units (2 blocks and the root) reduce after each of the 2 micro-batches, or once
    assert modes["micro_batch"]["reduce_scatters_per_update"] == 6
    assert modes["step"]["reduce_scatters_per_update"] == 3
    assert result["micro_batches_per_update"] == 2
    assert result["max_param_diff"] < 1e-5  # rounding only, after the same updates


def test_prompt_widths_runs_on_the_cpu_preset(tmp_path):
    import prompt_widths

    path = tmp_path / "widths.json"
    result = prompt_widths.main(["--preset", "cpu", "--device", "cpu", "--calls", "2", "--json", str(path)])
    assert json.loads(path.read_text())["arms"].keys() == result["arms"].keys()
    assert len(set(result["widths"])) == 3 and max(result["widths"]) == _workload.PRESETS["cpu"].prompt_tokens
    for name, arm in result["arms"].items():
        assert len(arm["seconds"]) == 2 and arm["tokens_per_s"] > 0, name
        assert arm["cuda_graphs"] is False  # on a CPU no plan is kept, so nothing is padded ...
    assert result["greedy_tokens_equal"] == 1.0  # ... and both varied arms decode the same way


def test_compile_sizes_builds_each_size_and_runs_an_arm(tmp_path):
    import compile_sizes

    from transformers import AutoModelForCausalLM

    from rlkit.models import tiny_config

    # the size names are the models' parameter counts (rounded, tied embeddings)
    for name, dims in compile_sizes.SIZES.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_config(dims[-1], "qwen2.5-0.5b", **compile_sizes.shape(name)))
        count = sum(p.numel() for p in model.parameters())
        stated = float(name[:-1]) * 1e6
        assert 0.9 * stated <= count <= 1.1 * stated, (name, count)
    model = compile_sizes.build_sized("0.6M", torch.device("cpu"), compile_sizes.workload(torch.device("cpu")))[0]
    assert sum(p.numel() for p in model.parameters()) == 623_744 and model.dtype == torch.float32
    path = tmp_path / "sizes.json"
    result = compile_sizes.main(["--device", "cpu", "--sizes", "0.6M", "--arms", "eager", "--steps", "1",
                                 "--max-new-tokens", "4", "--prompts", "2", "--json", str(path)])
    arm = result["sizes"]["0.6M"]["eager"]
    assert "error" not in arm, arm.get("error")
    assert len(arm["steps_s"]) == compile_sizes.WARM + 1 and arm["step_s"] > 0
    assert json.loads(path.read_text())["sizes"]["0.6M"]["eager"]["params"] == arm["params"]


def test_compile_sizes_break_even():
    import compile_sizes

    # compiled: 2 s a step instead of 3, 40 s more to start -> even after 40 steps
    got = compile_sizes.summarize({"eager": {"step_s": 3.0, "startup_s": 10.0}, "compiled": {"step_s": 2.0, "startup_s": 50.0}})
    assert got["speedup"] == pytest.approx(1.5) and got["break_even_steps"] == pytest.approx(40.0)
    # slower compiled steps never catch up
    assert compile_sizes.summarize({"eager": {"step_s": 1.0, "startup_s": 1.0},
                                    "compiled": {"step_s": 1.5, "startup_s": 30.0}})["break_even_steps"] is None
    assert compile_sizes.summarize({"eager": {"error": "x"}, "compiled": {"step_s": 1.0, "startup_s": 1.0}}) == {}


def test_child_json_takes_the_last_tagged_line_and_reports_failures():
    """The benchmarks' child processes (TRL's run, compile_sizes' arms) report through one tagged
    JSON line; a child that fails, or prints none, is an error naming the exit code and its output."""
    py = sys.executable
    out = _workload.child_json([py, "-c", "print('X_JSON {\"a\": 1}'); print('noise'); print('X_JSON {\"a\": 2}')"], "X_JSON")
    assert out["a"] == 2 and out["process_s"] > 0
    failed = _workload.child_json([py, "-c", "print('X_JSON {\"a\": 1}'); import sys; sys.exit('boom')"], "X_JSON")
    assert set(failed) == {"error"} and failed["error"].startswith("exit 1:") and "boom" in failed["error"]
    silent = _workload.child_json([py, "-c", "print('X_JSONL {}')"], "X_JSON")
    assert silent["error"].startswith("exit 0:")
    env = {**os.environ, "RLKIT_CHILD_PROBE": "seen"}
    probe = [py, "-c", "import json, os; print('X_JSON ' + json.dumps({'v': os.environ.get('RLKIT_CHILD_PROBE')}))"]
    assert _workload.child_json(probe, "X_JSON", env=env)["v"] == "seen"


def test_summarize_rates_are_per_step_not_the_last_steps_count_over_the_median_time():
    # responses stop at EOS on the CPU presets, so the generated count varies by step; the last
    # step's 900 over the median 1 s reported 900 tok/s where every step ran at 600 or 900
    wl = _workload.PRESETS["cpu"]
    times = [{"rollout": 1.0, "update": 2.0, "step": 4.0}] * 3
    metrics = [{"rollout/seconds": 1.0, "tokens_total": g + 400.0, "tokens_generated": g} for g in (600.0, 600.0, 900.0)]
    r = grpo_step.summarize(wl, times, metrics, 1000, None, torch.device("cpu"))
    assert r["tokens_generated"] == 600 and r["tokens_total"] == 1000
    assert r["rollout_tokens_per_s"] == r["rollout_call_tokens_per_s"] == 600
    assert r["generated_tokens_per_s_step"] == 150
    assert r["update_tflops"] == pytest.approx(6 * 1000 * 1000 / 2.0 / 1e12)


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--json", "/nonexistent-folder-rlkit/r.json"], "its folder does not exist"),
])
def test_bad_flags_stop_before_the_run_with_the_flag_named(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        grpo_step.main(["--preset", "cpu", "--device", "cpu", *argv])
    assert stop.value.code == 2 and says in capsys.readouterr().err
