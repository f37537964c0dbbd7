"""The supervised warm-up: the batches it trains on, and that it learns."""
from __future__ import annotations

import random

import pytest
import torch

import rlkit as rk
from rlkit.models import tiny
from rlkit.sft import sft_batch, warmup


def _model(task, seed=0):
    return tiny(task.tokenizer, seed=seed, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1)


def test_warmup_trains_on_the_batches_sft_batch_builds():
    # warmup tokenizes each example once and reuses it; a reference loop that re-tokenizes every
    # draw through sft_batch (same draws, same optimizer) must give the same losses and weights
    from rlkit.models.logprobs import response_logprobs
    from rlkit.optim import adamw

    task = rk.tasks.arithmetic(n_train=64, n_test=8)
    examples, steps, size = task.sft_examples, 4, 8
    model = _model(task)
    history = warmup(model, task.tokenizer, examples, steps=steps, batch_size=size, lr=1e-2, warmup_steps=2, seed=3)

    ref = _model(task)
    spec = adamw(lr=1e-2, weight_decay=0.0, warmup_steps=2, total_steps=steps, schedule="cosine", min_lr_ratio=0.1)
    opt, sched = spec.build(ref.parameters())
    rng, losses = random.Random(3), []
    ref.train()
    for _ in range(steps):
        batch = sft_batch(task.tokenizer, [examples[rng.randrange(len(examples))] for _ in range(size)])
        lp, _ = response_logprobs(ref, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"])
        mask = batch["response_mask"]
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    assert [h["sft/loss"] for h in history] == losses
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_sft_batch_appends_eos_to_the_completion():
    task = rk.tasks.arithmetic(n_train=8, n_test=2)
    tok = task.tokenizer
    batch = sft_batch(tok, [("12+34=", "46")])
    ids = batch["response_ids"][0][batch["response_mask"][0]].tolist()
    assert ids == tok("46", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert batch["prompt_ids"][0][batch["prompt_mask"][0]].tolist() == tok("12+34=", add_special_tokens=False)["input_ids"]


def test_warmup_learns():
    task = rk.tasks.arithmetic(n_train=64, n_test=8)
    history = warmup(_model(task), task.tokenizer, task.sft_examples, steps=60, batch_size=16, lr=1e-2, seed=0)
    first, last = history[0]["sft/loss"], sum(h["sft/loss"] for h in history[-5:]) / 5
    assert last < 0.6 * first, (first, last)


def test_warmup_reports_steps_done_to_sinks_and_on_step_as_fit_does():
    """Sinks and ``on_step`` get (steps done, metrics), 1..steps, so a progress bar ends full; a
    notebook dashboard passed as a sink ends at its total even when ``every`` does not divide it."""
    import importlib.util

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = len(plt.get_fignums())
    task = rk.tasks.arithmetic(n_train=16, n_test=2)
    seen, called = rk.observe.ListSink(), []
    board = rk.observe.notebook.Dashboard(total=7, keys=("sft/loss",), every=5)
    history = warmup(_model(task), task.tokenizer, task.sft_examples, steps=7, batch_size=4, seed=0,
                     sinks=[seen, board], on_step=lambda step, metrics: called.append((step, metrics)))
    assert [s for s, _ in called] == list(range(1, 8))
    assert [m for _, m in called] == history
    assert [h["step"] for h in seen.history] == list(range(1, 8))
    assert [h["step"] for h in board.history] == list(range(1, 8))
    if importlib.util.find_spec("ipywidgets") is not None:  # a test dependency: the dashboard has its widgets
        assert board._widgets is not None
        assert board._bar.value == 7  # the last step shows
        assert len(plt.get_fignums()) == figures  # its redraws (steps 5 and 7) left no figure open


def test_observe_submodules_load_on_first_use():
    """``rk.observe.notebook`` and friends work after a plain ``import rlkit``, which itself loads
    none of their optional packages."""
    import subprocess
    import sys

    code = ("import sys, rlkit as rk; heavy = [m for m in ('matplotlib', 'ipywidgets', 'wandb', 'prometheus_client') if m in sys.modules]; "
            "assert not heavy, heavy; print(rk.observe.notebook.Dashboard.__name__, rk.observe.console.ConsoleSink.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Dashboard", "ConsoleSink"]


def test_zero_warmup_steps_leave_the_model_alone_and_bad_examples_are_named():
    """``rlkit run arithmetic --sft-steps 0`` crashed: warmup(steps=0) built a cosine schedule over
    0 steps ("schedule='cosine' needs total_steps")."""
    import pytest

    from rlkit.jobs import run_task

    task = rk.tasks.arithmetic(n_train=32, n_test=8)
    model = tiny(task.tokenizer, seed=0, hidden_size=64, intermediate_size=128)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert warmup(model, task.tokenizer, task.sft_examples, steps=0) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="example 1 is '1\\+1=2'; each example must be a \\(prompt, completion\\) pair"):
        warmup(model, task.tokenizer, [("1+1=", "2"), "1+1=2"], steps=1)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        warmup(model, task.tokenizer, task.sft_examples, steps=1, batch_size=0)
    with pytest.raises(ValueError, match="steps must be an int >= 0, got -1"):
        warmup(model, task.tokenizer, task.sft_examples, steps=-1)
    summary = run_task("arithmetic", {"sft_steps": 0, "steps": 1, "batch_size": 2, "n": 2, "eval_size": 4, "quiet": True})
    assert summary["steps"] == 1 and summary["accuracy_before_rl"] is not None


def test_evaluate_reads_plain_prompts_and_refuses_an_empty_set():
    import pytest

    from rlkit.data import DataError

    task = rk.tasks.arithmetic(n_train=32, n_test=8)
    model = tiny(task.tokenizer, seed=0, hidden_size=64, intermediate_size=128)
    rows = [{"prompt": t, "answer": a} for t, a in zip(task.test.text, task.test.columns["answer"])]
    from_rows = rk.evaluate(model, task.tokenizer, rows, task.reward, max_new_tokens=4, batch_size=3)
    from_set = rk.evaluate(model, task.tokenizer, task.test, task.reward, max_new_tokens=4)
    assert from_rows == from_set and from_rows["n"] == len(task.test)
    with pytest.raises(DataError, match="empty"):
        rk.evaluate(model, task.tokenizer, [], task.reward)
    with pytest.raises(ValueError, match="batch_size must be a positive int.*got 0"):
        rk.evaluate(model, task.tokenizer, task.test, task.reward, batch_size=0)


def test_warmup_and_evaluate_check_model_tokenizer_and_context():
    """Prompts past the model's context trained or evaluated silently (rollout refused them);
    a TrainState or a None tokenizer failed with a bare AttributeError; warmup always left the
    model in eval mode."""
    task = rk.tasks.arithmetic(n_train=16, n_test=2)
    model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, max_position_embeddings=16)
    state = rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)
    long = [{"prompt": "1" * 14 + "=", "answer": "2"}]
    with pytest.raises(ValueError, match="evaluate: prompt 0 \\(15 tokens\\) with max_new_tokens=4 needs 19 positions, over the model's context of 16"):
        rk.evaluate(model, task.tokenizer, long, task.reward, max_new_tokens=4)
    with pytest.raises(ValueError, match="warmup: example 0 .* over the model's context of 16"):
        warmup(model, task.tokenizer, [("1" * 14 + "=", "12345")], steps=1, batch_size=1)
    with pytest.raises(TypeError, match="evaluate needs a tokenizer"):
        rk.evaluate(model, None, task.test, task.reward, max_new_tokens=4)
    with pytest.raises(TypeError, match="warmup takes a model, not a TrainState; pass state.actor"):
        warmup(state, task.tokenizer, task.sft_examples, steps=1)
    # a TrainState evaluates its actor
    assert rk.evaluate(state, task.tokenizer, task.test, task.reward, max_new_tokens=4) == \
        rk.evaluate(model, task.tokenizer, task.test, task.reward, max_new_tokens=4)
    model.train()
    warmup(model, task.tokenizer, task.sft_examples, steps=1, batch_size=2)
    assert model.training  # the caller's mode is kept, as evaluate keeps it
