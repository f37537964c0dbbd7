"""``rlkit run``: ``--quiet`` hides the progress bars but still prints the result; a resumed run
refuses another ``--eval-size`` (its accuracy gain would compare different prompt sets) and warns
about another ``--algo``, whose summary then lists which recipe trained which steps."""
import json
import warnings

import pytest

TINY = {"sft_steps": 0, "steps": 1, "batch_size": 2, "n": 2, "eval_size": 4, "eval_every": 0, "quiet": True}
FLAGS = ["--sft-steps", "3", "--steps", "1", "--batch-size", "2", "--n", "2", "--eval-size", "4", "--eval-every", "0"]


def test_quiet_prints_the_accuracies_and_the_summary_but_no_progress_bar(tmp_path, capsys, monkeypatch):
    """--quiet printed nothing at all (rc 0, empty stdout and stderr): without --json the run's
    result never appeared, though the help said only "no progress bar"."""
    from rlkit.cli import main

    monkeypatch.delenv("RLKIT_TRACEBACK", raising=False)
    assert main(["run", "arithmetic", *FLAGS, "--quiet", "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert out == ""  # no --json: stdout stays empty
    assert "held-out accuracy after warm-up: " in err
    for row in ("held-out accuracy after warm-up", "held-out accuracy after RL", "gain (points)", "RL steps"):
        assert err.count(row) >= 1, err
    assert "rlkit run arithmetic --algo grpo (seed 0)" in err
    # the bars (and transformers' "Writing model shards" when the model is saved) stay hidden
    assert "warm-up 3/3" not in err and "RL (grpo)" not in err and "Writing model shards" not in err
    assert (tmp_path / "out" / "model").is_dir()

    assert main(["run", "arithmetic", *FLAGS, "--out", str(tmp_path / "loud")]) == 0
    err = capsys.readouterr().err
    assert "warm-up 3/3" in err and "RL (grpo) 1/1" in err  # what --quiet hides


def test_quiet_help_says_what_it_hides():
    import argparse

    from rlkit.jobs import add_run_arguments

    parser = argparse.ArgumentParser(prog="rlkit run")
    add_run_arguments(parser)
    text = next(a for a in parser._actions if "--quiet" in a.option_strings).help
    assert "progress bars" in text and "accuracies and the summary table still print" in text


def test_resume_with_another_eval_size_is_refused_naming_the_saved_one(tmp_path, capsys, monkeypatch):
    """Resumed with --eval-size 8 after a run that measured its accuracy after warm-up on 4 prompts,
    accuracy_gain subtracted one from the other without a word."""
    from rlkit.cli import main
    from rlkit.jobs import run_task

    out = tmp_path / "out"
    run_task("arithmetic", {**TINY, "out": str(out)})
    with pytest.raises(ValueError, match=r"--eval-size\) is 8, but the run this resumes .* on --eval-size 4 prompts.*"
                                         r"Pass --eval-size 4 to continue it, or start a fresh run"):
        run_task("arithmetic", {**TINY, "steps": 2, "eval_size": 8, "out": str(out), "resume": "auto"})
    monkeypatch.delenv("RLKIT_TRACEBACK", raising=False)
    capsys.readouterr()
    assert main(["run", "arithmetic", "--quiet", "--steps", "2", "--batch-size", "2", "--n", "2", "--eval-size", "2",
                 "--eval-every", "0", "--out", str(out), "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlkit run: error: option 'eval_size' (--eval-size) is 2, but the run this resumes") and "Traceback" not in err
    # nothing was trained, logged or saved by the refused runs
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1]
    summary = run_task("arithmetic", {**TINY, "steps": 2, "out": str(out), "resume": "auto"})  # the same --eval-size goes on
    assert summary["steps"] == 2 and summary["accuracy_before_rl"] is not None


def test_resume_with_another_algo_warns_and_the_summary_lists_each_algos_steps(tmp_path, capsys):
    """grpo for step 1, then --algo dapo on resume: no warning, and the summary said "algo": "dapo"
    for a run whose first step was grpo."""
    from rlkit.jobs import run_task

    out = tmp_path / "out"
    first = run_task("arithmetic", {**TINY, "out": str(out)})
    assert first["algos"] == [{"algo": "grpo", "steps": [1, 1]}]
    with pytest.warns(RuntimeWarning, match=r"trained with --algo grpo \(steps 1-1\) but this run continues it with --algo "
                                            r"dapo: steps 2-3 use the dapo recipe"):
        second = run_task("arithmetic", {**TINY, "algo": "dapo", "steps": 3, "out": str(out), "resume": "auto"})
    assert second["algo"] == "dapo"
    assert second["algos"] == [{"algo": "grpo", "steps": [1, 1]}, {"algo": "dapo", "steps": [2, 3]}]
    assert json.loads((out / "summary.json").read_text())["algos"] == second["algos"]
    assert "grpo (steps 1-1), dapo (steps 2-3)" in capsys.readouterr().err  # a row of the summary table

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*trained with --algo")  # the same --algo again: no warning
        third = run_task("arithmetic", {**TINY, "algo": "dapo", "steps": 4, "out": str(out), "resume": "auto"})
    assert third["algos"] == [{"algo": "grpo", "steps": [1, 1]}, {"algo": "dapo", "steps": [2, 4]}]
    with pytest.warns(RuntimeWarning, match=r"trained with --algo dapo \(steps 2-4\)"):
        fourth = run_task("arithmetic", {**TINY, "steps": 5, "out": str(out), "resume": "auto"})
    assert fourth["algos"] == [{"algo": "grpo", "steps": [1, 1]}, {"algo": "dapo", "steps": [2, 4]}, {"algo": "grpo", "steps": [5, 5]}]


def test_a_resume_that_trains_no_step_adds_no_algo(tmp_path):
    """At --steps already, the new --algo trains nothing: no warning, and the summary does not
    credit it with steps."""
    from rlkit.jobs import run_task

    out = tmp_path / "out"
    run_task("arithmetic", {**TINY, "out": str(out)})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*trained with --algo")
        summary = run_task("arithmetic", {**TINY, "algo": "rloo", "out": str(out), "resume": "auto"})
    assert summary["algos"] == [{"algo": "grpo", "steps": [1, 1]}]


def test_resume_with_other_sampling_options_warns_naming_each_and_how_to_keep_them(tmp_path):
    """--n, --temperature and a non-zero --kl changed on resume trained the new steps with them
    silently (a changed --lr warns)."""
    from rlkit.jobs import run_task

    out = tmp_path / "out"
    run_task("arithmetic", {**TINY, "out": str(out)})
    with pytest.warns(RuntimeWarning, match=r"other RL options than this run continues it with \(--n 2 -> 4, --temperature "
                                            r"1 -> 0.7\): steps 2-2 use the new values\. To continue the run as it was, pass "
                                            r"--n 2 --temperature 1"):
        run_task("arithmetic", {**TINY, "n": 4, "temperature": 0.7, "steps": 2, "out": str(out), "resume": "auto"})
    with warnings.catch_warnings():  # the values it continued with are the checkpoint's now: no warning
        warnings.filterwarnings("error", message=".*other RL options")
        run_task("arithmetic", {**TINY, "n": 4, "temperature": 0.7, "steps": 3, "out": str(out), "resume": "auto"})
