"""``rlkit run --samples K``: K sampled responses (from different prompts) with their rewards, as a
table at each evaluation and in OUT/metrics.jsonl every step; none by default."""
import json

import pytest

TINY = {"sft_steps": 0, "steps": 2, "batch_size": 2, "n": 2, "eval_size": 4}


def _rows(out):
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_samples_show_at_each_evaluation_and_reach_the_metrics_file(tmp_path, capsys):
    from rlkit.jobs import run_task

    out = tmp_path / "run"
    run_task("arithmetic", {**TINY, "samples": 2, "eval_every": 1, "out": str(out)})
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert len(r["samples"]) == 2
        assert all(isinstance(s["prompt"], str) and s["prompt"].endswith("=") and isinstance(s["response"], str)
                   and s["reward"] in (0.0, 1.0) for s in r["samples"])
        assert r["samples"][0]["prompt"] != r["samples"][1]["prompt"]  # two prompts, not two samples of one
    err = capsys.readouterr().err
    assert "samples (step 1)" in err and "samples (step 2)" in err  # the console's table, at each evaluation
    assert rows[-1]["samples"][0]["response"][:8] in err


def test_the_last_step_shows_its_samples_where_it_is_no_multiple_of_eval_every(tmp_path, capsys):
    # --steps 3 --eval-every 2 evaluates at steps 2 and 3; the table showed at step 2 only
    from rlkit.jobs import run_task

    run_task("arithmetic", {**TINY, "steps": 3, "samples": 1, "eval_every": 2})
    err = capsys.readouterr().err
    assert "samples (step 2)" in err and "samples (step 3)" in err and "samples (step 1)" not in err


def test_no_samples_by_default_and_a_negative_count_is_refused(tmp_path, capsys):
    from rlkit.jobs import check_options, run_task

    out = tmp_path / "run"
    run_task("arithmetic", {**TINY, "steps": 1, "eval_every": 0, "out": str(out)})
    assert "samples" not in _rows(out)[0]
    assert "samples (step" not in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"option 'samples' \(--samples\) must be >= 0"):
        check_options("arithmetic", {"samples": -1})
