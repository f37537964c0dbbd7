"""Exact resume: N steps + save + restore into a fresh state + N steps == 2N uninterrupted steps.

In-process through ``rlkit.loop.fit`` with the real GRPO recipe, and through the CLI with a real
``kill -9`` of the training process and ``--resume auto``.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import rlkit as rk
from rlkit import recipes
from rlkit.checkpoint import Checkpointer, latest
from rlkit.loop import fit
from rlkit.models import tiny
from rlkit.tasks import arithmetic

N = 2
BATCH = 4


def digit_reward(completions, **kwargs):
    """Dense shaped reward (a random tiny model never gets an exact match, so GRPO's advantages
    would all be zero and nothing would train): digits in the answer, capped at 3."""
    return [min(3, sum(ch.isdigit() for ch in c)) / 3 for c in completions]


@pytest.fixture(scope="module")
def task():
    # 8 training prompts at batch 4: an epoch is N=2 steps, so the resume is at an epoch boundary
    return arithmetic(n_train=2 * BATCH, n_test=4)


def _build(task, model_seed=0):
    model = tiny(task.tokenizer, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, seed=model_seed)
    spec = rk.optim.adamw(lr=1e-2, warmup_steps=1, total_steps=2 * N, schedule="cosine", weight_decay=0.01)
    return rk.init(model, spec, tokenizer=task.tokenizer, ref="copy", seed=5)


def _recipe(task):
    return recipes.get("grpo").with_(n=4, max_new_tokens=task.max_new_tokens, kl=("low_var_kl", 0.1))


def test_resume_equals_uninterrupted_bit_for_bit(tmp_path, task):
    recipe = _recipe(task)
    initial = {k: v.clone() for k, v in _build(task).actor.state_dict().items()}
    full, full_history = fit(_build(task), recipe, digit_reward, task.train, steps=2 * N, batch_size=BATCH)

    saver = Checkpointer(tmp_path, every=N, keep=3, save_on_sigterm=False)
    half, _ = fit(_build(task), recipe, digit_reward, task.train, steps=N, batch_size=BATCH, checkpointer=saver)
    assert saver.latest() == tmp_path / "step_000002"
    del half
    # "a fresh process": a new model (another random init), optimizer, schedule and ref
    template = _build(task, model_seed=1)
    assert not torch.equal(template.actor.lm_head.weight, full.actor.lm_head.weight)
    resumed = saver.restore(template)
    assert (resumed.step, resumed.data_position) == (N, N) and N == len(task.train) // BATCH
    resumed, resumed_history = fit(resumed, recipe, digit_reward, task.train, steps=2 * N, batch_size=BATCH, checkpointer=saver)

    assert len(resumed_history) == N  # resuming at the epoch boundary trains the remaining steps
    assert (resumed.step, resumed.policy_version, resumed.data_position) == (full.step, full.policy_version, full.data_position)
    # every extra equal except the wall clock, which goes on from the checkpoint's (see test below)
    drop = lambda e: {k: v for k, v in e.items() if k != "fit/elapsed_s"}  # noqa: E731
    assert drop(resumed.extras) == drop(full.extras)
    assert resumed.extras["fit/elapsed_s"] > 0 and resumed_history[0]["time/elapsed_s"] > resumed_history[0]["time/step_s"]
    # the run really trained (non-zero advantages), so equality is not trivial
    assert any(h["actor/grad_norm"] > 0 for h in full_history[N:])
    final = full.actor.state_dict()
    assert any(not torch.equal(initial[k], final[k]) for k in initial)
    for role in ("actor", "ref"):
        a, b = getattr(full, role).state_dict(), getattr(resumed, role).state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{role}.{k} differs after resume"
    oa, ob = full.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    for i, moments in oa["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, ob["state"][i][name]), (i, name)
    assert resumed.lr == full.lr and resumed.scheduler.state_dict() == full.scheduler.state_dict()
    for h_full, h_resumed in zip(full_history[N:], resumed_history):
        for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr"):
            assert h_full[key] == h_resumed[key], key
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step_000002", "step_000004"]


def test_a_finished_run_keeps_its_last_step_and_resumes_finished(tmp_path, task):
    """fit saved only every `every` steps: a 3-step run with every=2 kept step 2, and resuming it
    trained step 3 again."""
    recipe = _recipe(task)
    saver = Checkpointer(tmp_path, every=2, save_on_sigterm=False)
    done, _ = fit(_build(task), recipe, digit_reward, task.train, steps=3, batch_size=BATCH, checkpointer=saver)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step_000002", "step_000003"]
    again = Checkpointer(tmp_path, every=2, save_on_sigterm=False).resume(_build(task, model_seed=1), "auto")
    assert again.step == 3
    for k, v in done.actor.state_dict().items():
        assert torch.equal(v, again.actor.state_dict()[k]), k
    _, history = fit(again, recipe, digit_reward, task.train, steps=3, batch_size=BATCH, checkpointer=saver)
    assert history == []
    # every=0 (no periodic saves) still saves the last step: the finished run resumes finished
    no_periodic = Checkpointer(tmp_path / "no_periodic", every=0, save_on_sigterm=False)
    fit(_build(task), recipe, digit_reward, task.train, steps=1, batch_size=BATCH, checkpointer=no_periodic)
    assert no_periodic.latest() == tmp_path / "no_periodic" / "step_000001"


JOB = dict(algo="ppo", kl=0.01, steps=8, checkpoint_every=2, sft_steps=5, batch_size=4, n=4, eval_every=0, eval_size=4, quiet=True)


def _cli(out, *extra):
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in JOB.items()]
    return [sys.executable, "-m", "rlkit.cli", "run", "arithmetic", "--out", str(out), *flags, *extra]


@pytest.mark.slow
def test_cli_kill9_then_resume_auto_equals_uninterrupted(tmp_path):
    """PPO (a critic gives non-zero advantages even at zero reward) with a KL reference: the
    checkpoint must carry actor, critic, ref, both optimizers and schedules."""
    from safetensors.torch import load_file

    from rlkit.jobs import run_task

    ref_out, run_out = tmp_path / "uninterrupted", tmp_path / "killed"
    # one intra-op thread in every run (they are compared bit for bit, and two run at once)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    victim = subprocess.Popen(_cli(run_out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = run_task("arithmetic", {**JOB, "out": str(ref_out)})  # meanwhile, the uninterrupted run
    finally:
        torch.set_num_threads(threads)
    first = run_out / "checkpoints" / "step_000002" / "COMPLETE"
    deadline = time.monotonic() + 300
    while not first.exists():
        assert victim.poll() is None, f"the run ended before its first checkpoint: {victim.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint after 300 s"
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(timeout=60) == -signal.SIGKILL
    victim.stderr.close()
    assert not (run_out / "model").exists(), "the run finished before the kill; nothing was resumed"
    saved_at = int(latest(run_out / "checkpoints").name.removeprefix("step_"))
    assert saved_at < 8

    resumed = subprocess.run(_cli(run_out, "--resume", "auto", "--json"), env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["steps"] == reference["steps"] == 8 and summary["resumed_from"].endswith(f"step_{saved_at:06d}")
    assert summary["accuracy_before_rl"] == reference["accuracy_before_rl"]  # carried in the checkpoint
    # each step once, in order: the resumed process dropped the rows the victim logged after its
    # checkpoint (it redoes those steps) before logging the remaining ones
    steps = [json.loads(line)["step"] for line in (run_out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    ref_rows = [json.loads(line) for line in (ref_out / "metrics.jsonl").read_text().splitlines()]
    assert any(r["actor/grad_norm"] > 0 for r in ref_rows[saved_at:])  # the actor really trained

    a = load_file(str(ref_out / "model" / "model.safetensors"))
    b = load_file(str(run_out / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs between the uninterrupted and the resumed run"


def test_job_options_errors(tmp_path):
    from rlkit.checkpoint import CheckpointNotFoundError
    from rlkit.jobs import run_task

    with pytest.raises(ValueError, match=r"--resume auto needs --out DIR"):
        run_task("arithmetic", {"resume": "auto"})
    with pytest.raises(ValueError, match=r"--checkpoint-every needs --out DIR"):
        run_task("arithmetic", {"checkpoint_every": 5})
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        run_task("arithmetic", {"resume": str(tmp_path / "missing"), "out": str(tmp_path / "o")})


def test_job_sigterm_saves_at_step_boundary_and_exits_143(tmp_path):
    import threading

    from rlkit.checkpoint import Preempted, resolve
    from rlkit.jobs import run_task

    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"

    def preempt():  # like a scheduler's SIGTERM, once the job is training
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    killer = threading.Thread(target=preempt)
    killer.start()
    try:
        with pytest.raises(Preempted) as info:
            run_task("arithmetic", {**JOB, "algo": "grpo", "kl": 0.0, "steps": 200, "checkpoint_every": 0, "out": str(out)})
    finally:
        killer.join()
    assert info.value.code == 143 and signal.getsignal(signal.SIGTERM) == before
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    # saved exactly at the boundary after the last finished step, though no periodic saves were asked for
    assert resolve(out).name == f"step_{int(logged[-1]):06d}" and logged[-1] < 200
