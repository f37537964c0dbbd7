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
