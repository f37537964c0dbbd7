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


def test_warmup_reports_steps_done_to_sinks_and_on_step_as_fit_does(monkeypatch):
    """Sinks and ``on_step`` get (steps done, metrics), 1..steps, so a progress bar ends full; a
    notebook dashboard passed as a sink ends at its total even when ``every`` does not divide it."""
    import importlib.util

    import matplotlib

    from rlkit.observe import notebook

    if importlib.util.find_spec("ipywidgets") is not None:  # as in a kernel: the dashboard builds its widgets
        import IPython.display

        monkeypatch.setattr(notebook, "_in_kernel", lambda: True)
        monkeypatch.setattr(IPython.display, "display", lambda *objs: None)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = len(plt.get_fignums())
    task = rk.tasks.arithmetic(n_train=16, n_test=2)
    seen, called = rk.observe.ListSink(), []
    board = rk.observe.notebook.Dashboard(total=7, keys=("sft/loss",), every=5)
    history = warmup(_model(task), task.tokenizer, task.sft_examples, steps=7, batch_size=4, seed=0,
                     sinks=[seen, board], on_step=lambda step, metrics: called.append((step, metrics)))
    assert [s for s, _ in called] == list(range(1, 8))
    assert [{"step": s, **m} for s, m in called] == history == seen.history  # the returned rows are a ListSink's
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


def test_warmup_refuses_characters_the_tokenizer_encodes_as_unknown():
    """``("12+34=", "46 ✓")`` with the character tokenizer trained on ``<unk>`` in silence: decoding
    drops it, so the model learned to emit a token that rewards never see."""
    task = rk.tasks.arithmetic(n_train=8, n_test=2)
    tok, model = task.tokenizer, _model(task)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="warmup: example 0's completion '46 ✓' has characters the tokenizer does not know: "
                                         "\\['✓'\\] .*char_tokenizer\\(alphabet \\+ '✓'\\)\\) or remove them from the data"):
        warmup(model, tok, [("12+34=", "46 ✓")], steps=2, batch_size=2)
    with pytest.raises(ValueError, match="warmup: example 0's prompt '2×3=' has characters the tokenizer does not know: \\['×'\\]"):
        warmup(model, tok, [("2×3=", "6")], steps=2, batch_size=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # refused before any step
    # a bad example among good ones was refused when first drawn, after the steps before that draw
    # had trained; now every draw is checked before the first step
    good = [(f"{a}+{b}=", str(a + b)) for a in range(10, 20) for b in range(10, 14)]
    seen: list[int] = []
    with pytest.raises(ValueError, match="warmup: example 40's completion '1 ✓'"):
        warmup(model, tok, good + [("0+1=", "1 ✓")], steps=30, batch_size=2, on_step=lambda step, m: seen.append(step))
    assert seen == [] and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="sft_batch: pair 1's completion 'six' has characters .*\\['s', 'i', 'x'\\]"):
        sft_batch(tok, [("1+1=", "2"), ("3+3=", "six")])
    # "<unk>" written out is five characters outside this alphabet, refused and named as the text
    # "<unk>" (the character tokenizer never reads special tokens from text); where the unknown token is also EOS (GPT-2's
    # "<|endoftext|>"), writing it out is that special token, not an unknown character
    with pytest.raises(ValueError, match="sft_batch: pair 0's completion '4<unk>' .*\\['<unk>'\\]"):
        sft_batch(tok, [("1+3=", "4<unk>")])
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(["<pad>", "<eos>", *"0123456789+="])}, unk_token="<eos>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    shared = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<eos>")
    batch = sft_batch(shared, [("1+1=", "2<eos>")])
    assert batch["response_ids"][0][batch["response_mask"][0]].tolist() == shared.encode("2") + [shared.eos_token_id] * 2
    with pytest.raises(ValueError, match="completion '2×' has characters the tokenizer does not know: \\['×'\\]"):
        sft_batch(shared, [("1+1=", "2×")])


def test_warmup_refuses_an_example_with_nothing_to_train_on_before_the_first_step():
    """An empty completion with a tokenizer that has no EOS gives no target token: it failed at the
    first step that drew it, with a rollout's "response_mask is all False"."""
    task = rk.tasks.arithmetic(n_train=8, n_test=2)
    tok, model = task.tokenizer, _model(task)
    tok.eos_token = None
    seen: list[int] = []
    with pytest.raises(ValueError, match="warmup: example 1's completion '' gives no token to train on"):
        warmup(model, tok, [("1+1=", "2"), ("2+2=", "")], steps=3, batch_size=2, on_step=lambda step, m: seen.append(step))
    assert seen == []


def test_warmup_accepts_a_generator_of_examples():
    """A generator was consumed by the validation pass, then failed with ``object of type
    'generator' has no len()``."""
    task = rk.tasks.arithmetic(n_train=16, n_test=2)
    from_list = warmup(_model(task), task.tokenizer, task.sft_examples, steps=3, batch_size=4, seed=1)
    from_generator = warmup(_model(task), task.tokenizer, (pair for pair in task.sft_examples), steps=3, batch_size=4, seed=1)
    assert from_generator == from_list
    with pytest.raises(ValueError, match="warmup got no examples"):
        warmup(_model(task), task.tokenizer, iter(()), steps=1)
    with pytest.raises(TypeError, match="warmup: examples must be a list \\(or any iterable\\) of \\(prompt, completion\\) pairs.*got int 3"):
        warmup(_model(task), task.tokenizer, 3, steps=1)


def test_warmup_reports_the_learning_rate_each_step_used(monkeypatch):
    """``sft/lr`` was read after ``scheduler.step()``: the next step's rate, not the one used."""
    import math

    used = []
    step = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):
        used.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    task = rk.tasks.arithmetic(n_train=16, n_test=2)
    steps, warm, lr = 6, 2, 0.5
    history = warmup(_model(task), task.tokenizer, task.sft_examples, steps=steps, batch_size=2, lr=lr, warmup_steps=warm)
    # linear warm-up to lr, then cosine decay to 0.1 * lr over the remaining steps, written out here
    expected = [lr * (s + 1) / warm if s < warm else
                lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm)))) for s in range(steps)]
    assert used == pytest.approx(expected)
    assert [h["sft/lr"] for h in history] == pytest.approx(expected)
