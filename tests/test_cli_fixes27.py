"""``rlkit run``: a run that trains 0 steps into --out still leaves a checkpoint there; the hint
after an earlier run is set aside only when it would help; --eval-size above the test set is
refused; every flag of ``rlkit run --help`` says what it does."""
import json
import re

import pytest

TINY = {"sft_steps": 0, "steps": 1, "batch_size": 2, "n": 2, "eval_size": 4, "eval_every": 0, "quiet": True}


def test_a_run_that_trains_no_step_into_out_leaves_a_checkpoint_that_resume_auto_continues(tmp_path, capsys):
    """Resumed from a checkpoint already at --steps, the run wrote model/ and summary.json into
    --out but no checkpoint (fit saves only after a step), so a later --resume auto there moved
    the run to previous-1 and started over from a fresh model."""
    from rlkit.jobs import run_task

    first, second = tmp_path / "first", tmp_path / "second"
    run_task("arithmetic", {**TINY, "out": str(first)})
    summary = run_task("arithmetic", {**TINY, "out": str(second), "resume": str(first)})
    assert summary["steps"] == 1 and (second / "summary.json").is_file()
    assert (second / "checkpoints" / "step_000001" / "COMPLETE").is_file()
    capsys.readouterr()
    summary = run_task("arithmetic", {**TINY, "steps": 2, "out": str(second), "resume": "auto"})
    assert summary["steps"] == 2
    assert summary["resumed_from"] == str(second / "checkpoints" / "step_000001")
    assert not list(second.glob("previous-*")) and "were moved to" not in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in open(second / "metrics.jsonl")] == [2]


def test_resume_auto_on_its_own_newest_checkpoint_saves_nothing_again(tmp_path):
    """The 0-step save is skipped when the state was loaded, unchanged, from OUT's newest checkpoint."""
    from rlkit.jobs import run_task

    out = tmp_path / "out"
    run_task("arithmetic", {**TINY, "out": str(out)})
    ckpt = out / "checkpoints" / "step_000001"
    stamp = (ckpt / "COMPLETE").stat().st_mtime_ns
    summary = run_task("arithmetic", {**TINY, "out": str(out), "resume": "auto"})
    assert summary["resumed_from"] == str(ckpt) and "checkpoint_save_s" not in summary
    assert (ckpt / "COMPLETE").stat().st_mtime_ns == stamp and not list(out.glob("previous-*"))


def _earlier_run_without_checkpoints(out):
    out.mkdir()
    (out / "summary.json").write_text("{}")


def test_the_set_aside_message_does_not_tell_resume_auto_to_pass_resume_auto(tmp_path, capsys):
    """--resume auto with no checkpoint in OUT was told "To continue the run in --out instead, pass
    --resume auto", the option it was given."""
    from rlkit.jobs import run_task

    out = tmp_path / "out"
    _earlier_run_without_checkpoints(out)
    run_task("arithmetic", {**TINY, "out": str(out), "resume": "auto"})
    err = capsys.readouterr().err
    assert f"moved to {out / 'previous-1'}" in err
    assert "pass --resume auto" not in err
    assert f"--resume auto found no complete checkpoint in {out / 'checkpoints'}" in err


def test_the_set_aside_message_gives_the_resume_hint_only_when_there_is_a_checkpoint(tmp_path, capsys):
    from rlkit.jobs import run_task

    out = tmp_path / "out"
    _earlier_run_without_checkpoints(out)
    run_task("arithmetic", {**TINY, "out": str(out)})  # the earlier run has no checkpoint: --resume auto would not help
    err = capsys.readouterr().err
    assert f"moved to {out / 'previous-1'}" in err and "--resume auto" not in err
    run_task("arithmetic", {**TINY, "out": str(out)})  # this one left step_000001: the hint helps
    err = capsys.readouterr().err
    assert f"moved to {out / 'previous-2'}" in err and "To continue the run in --out instead, pass --resume auto." in err


def test_eval_size_above_the_test_set_is_refused_before_the_warm_up(monkeypatch, capsys):
    """--eval-size 500 was capped at the 200 test prompts without a word: the accuracies were over
    fewer prompts than asked."""
    import rlkit.sft
    from rlkit.cli import main
    from rlkit.jobs import check_options

    def no_warmup(*a, **k):
        raise AssertionError("the warm-up ran before the options were checked")

    monkeypatch.setattr(rlkit.sft, "warmup", no_warmup)
    monkeypatch.delenv("RLKIT_TRACEBACK", raising=False)
    assert main(["run", "arithmetic", "--quiet", "--eval-size", "500"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlkit run: error: option 'eval_size' (--eval-size) is 500, more than the 200 held-out test "
                          "prompts of task 'arithmetic'; use --eval-size 200 or less")
    with pytest.raises(ValueError, match=r"--eval-size\) is 201, more than the 200"):
        check_options("arithmetic", {"eval_size": 201})
    assert check_options("arithmetic", {"eval_size": 200})[0].eval_size == 200  # the whole test set (the default)


@pytest.mark.parametrize("flag", ["--sft-lr", "--temperature", "--seed", "--eval-every", "--eval-size", "--samples"])
def test_every_run_flag_has_help(flag):
    import argparse

    from rlkit.jobs import DEFAULTS, add_run_arguments

    parser = argparse.ArgumentParser(prog="rlkit run")
    add_run_arguments(parser)
    action = next(a for a in parser._actions if flag in a.option_strings)
    assert action.help, f"{flag} has no help text"
    default = DEFAULTS[action.dest]
    assert re.search(rf"default {re.escape(format(default, 'g') if isinstance(default, float) else str(default))}\b", action.help)
    assert flag in parser.format_help()
