"""Resume defects: a reused Checkpointer, a changed optimizer spec, metrics logged twice, another
batch size, save's step argument, every=0 and the final step, a metric named "step".

Fast: a linear "model" and a made-up training step stand in for a language model and a recipe
(what is checked is the bookkeeping around the step, not the step)."""
import json
import os
import signal
import warnings

import pytest
import torch

import rlkit as rk
from rlkit import checkpoint as ck
from rlkit.loop import fit
from rlkit.observe.sinks import JSONLSink, ListSink


def _state(seed=0, spec=None):
    torch.manual_seed(seed)
    return rk.init(torch.nn.Linear(4, 3), spec or rk.optim.adamw(lr=1e-2), seed=7)


def _train_step(state, prompts, reward):
    """One AdamW step on a made-up loss (the optimizer and schedule get state to save)."""
    state.optimizer.zero_grad()
    loss = sum((p.float() ** 2).sum() for p in state.actor.parameters())
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()
    # a float "step" metric, as rk.update reports one
    return state.replace(step=state.step + 1, policy_version=state.policy_version + 1), {"loss": loss.detach().item(), "step": float(state.step + 1)}


class _Recipe:
    def __init__(self):
        self.seen: list[list[str]] = []

    def step(self, state, prompts, reward):
        self.seen.append(list(prompts.text))
        return _train_step(state, prompts, reward)


def _reward(completions, **kwargs):
    return [0.0 for _ in completions]


@pytest.fixture
def prompts(char_tok):
    return rk.load_prompts([f"{i}+{i}=" for i in range(8)], char_tok)


def _weights(state):
    return {k: v.detach().clone() for k, v in state.actor.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------- 1: a reused Checkpointer
def test_a_reused_checkpointer_saves_the_next_run_and_resume_restores_that_run(tmp_path, prompts):
    """The Checkpointer remembered only the step it last saved: a second, fresh run through it
    skipped its save of that step (periodic and final), and resume restored the first run's weights."""
    saver = ck.Checkpointer(tmp_path, every=2, save_on_sigterm=False)
    a, _ = fit(_state(seed=0), _Recipe(), _reward, prompts, steps=2, batch_size=4, checkpointer=saver)
    b, _ = fit(_state(seed=1), _Recipe(), _reward, prompts, steps=2, batch_size=4, checkpointer=saver)
    assert not _same(_weights(a), _weights(b))
    resumed = ck.Checkpointer(tmp_path, save_on_sigterm=False).resume(_state(seed=2), "auto")
    assert resumed.step == 2 and _same(_weights(resumed), _weights(b))
    # the state it restored, unchanged, is not saved again; another state of that step is
    assert saver.saved_path(b) == tmp_path / "step_000002" and saver.save_final(b) is None
    again = ck.Checkpointer(tmp_path, every=2, save_on_sigterm=False)
    restored = again.resume(_state(seed=3), "auto")
    assert again.saved_path(restored) == tmp_path / "step_000002" and again.save_final(restored) is None
    assert again.save_final(_state(seed=4).replace(step=2, policy_version=2)) == tmp_path / "step_000002"


def test_sigterm_saves_the_running_state_not_another_runs_checkpoint_of_its_step(tmp_path):
    saver = ck.Checkpointer(tmp_path, every=100)
    saver.save(_state(seed=0).replace(step=2, policy_version=2, extras={"run": "A"}))
    b = _state(seed=1).replace(step=2, policy_version=2, extras={"run": "B"})
    with pytest.raises(ck.Preempted) as info:
        with saver.armed():
            os.kill(os.getpid(), signal.SIGTERM)
            saver.maybe_save(b)
    assert info.value.path.endswith("step_000002")
    restored = ck.load(_state(seed=2), info.value.path)
    assert restored.extras == {"run": "B"} and _same(_weights(restored), _weights(b))


def test_replacing_a_checkpoint_keeps_the_old_one_when_the_swap_fails(tmp_path, monkeypatch):
    saver = ck.Checkpointer(tmp_path, save_on_sigterm=False)
    saver.save(_state(seed=0).replace(step=2, extras={"run": "A"}))
    real = os.replace

    def failing(src, dst):
        if ".tmp-" in os.fspath(src):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(ck.os, "replace", failing)
    with pytest.raises(OSError, match="No space left"):
        saver.save(_state(seed=1).replace(step=2, extras={"run": "B"}))
    monkeypatch.setattr(ck.os, "replace", real)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000002"]
    assert ck.load(_state(seed=2), tmp_path / "step_000002").extras == {"run": "A"}


def test_a_crash_inside_the_swap_keeps_the_new_complete_checkpoint(tmp_path):
    """Killed between renaming the old step_k away and renaming the new one in: both directories
    were leftovers, and the next Checkpointer deleted them, so the step had no checkpoint at all."""
    ck.save(_state(seed=0).replace(step=2, extras={"run": "A"}), tmp_path)
    ck.save(_state(seed=1).replace(step=2, extras={"run": "B"}), tmp_path / "new")
    os.replace(tmp_path / "step_000002", tmp_path / "step_000002.old-0123abcd")
    os.replace(tmp_path / "new" / "step_000002", tmp_path / "step_000002.tmp-0123456789ab")
    os.rmdir(tmp_path / "new")
    os.makedirs(tmp_path / "step_000003.tmp-0123456789ab")  # an interrupted save: no marker, deleted
    saver = ck.Checkpointer(tmp_path, save_on_sigterm=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]
    assert saver.resume(_state(seed=2), "auto").extras == {"run": "B"}


# ----------------------------------------------------------------- 2: a changed optimizer spec
def test_resuming_with_another_optimizer_spec_follows_the_saved_spec_entirely(tmp_path, prompts):
    saved_spec = rk.optim.adamw(lr=1e-2, warmup_steps=1, total_steps=4, schedule="linear", weight_decay=0.01)
    given = rk.optim.adamw(lr=1e-3, warmup_steps=1, total_steps=100, schedule="linear", weight_decay=0.5)
    full, _ = fit(_state(spec=saved_spec), _Recipe(), _reward, prompts, steps=3, batch_size=4)
    saver = ck.Checkpointer(tmp_path, every=2, save_on_sigterm=False)
    fit(_state(spec=saved_spec), _Recipe(), _reward, prompts, steps=2, batch_size=4, checkpointer=saver)
    with pytest.warns(RuntimeWarning) as caught:
        resumed = saver.resume(_state(seed=1, spec=given), "auto")
    message = " ".join(str(w.message) for w in caught if "optimizer_spec" in str(w.message))
    for field, was, now in (("lr", 0.01, 0.001), ("weight_decay", 0.01, 0.5), ("total_steps", 4, 100)):
        assert f"{field} (saved {was}, given {now})" in message, message
    assert "the saved values apply" in message
    assert resumed.optimizer_spec == saved_spec  # what the optimizer follows, and the next checkpoint stores
    resumed, _ = fit(resumed, _Recipe(), _reward, prompts, steps=3, batch_size=4)
    assert resumed.lr == full.lr == saved_spec.lr * saved_spec.lr_factor(3)
    assert resumed.optimizer.param_groups[0]["weight_decay"] == 0.01
    assert _same(_weights(resumed), _weights(full))


# ----------------------------------------------------------------- 3: metrics logged twice
class _StopAt:
    def __init__(self, step):
        self.step = step

    def on_step(self, step, metrics):
        if step == self.step:
            raise KeyboardInterrupt


def test_a_resumed_fit_logs_each_step_once_in_order(tmp_path, prompts):
    """Interrupted after step 3 was logged, resumed from the step-2 checkpoint: metrics.jsonl had
    steps 1, 2, 3, 3, 4, 5."""
    path, saver = tmp_path / "metrics.jsonl", ck.Checkpointer(tmp_path / "ckpt", every=2, save_on_sigterm=False)
    log, mem = JSONLSink(path), ListSink()
    with pytest.raises(KeyboardInterrupt):
        fit(_state(), _Recipe(), _reward, prompts, steps=5, batch_size=4, sinks=[log, mem, _StopAt(3)], checkpointer=saver)
    log.close()
    resumed = ck.Checkpointer(tmp_path / "ckpt", save_on_sigterm=False).resume(_state(seed=1), "auto")
    assert resumed.step == 2
    log = JSONLSink(path)  # a new process appends to the same file
    fit(resumed, _Recipe(), _reward, prompts, steps=5, batch_size=4, sinks=[log, mem])
    log.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5] and all(type(s) is int for s in steps)
    assert [row["step"] for row in mem.history] == [1, 2, 3, 4, 5]


def test_jsonl_rewind_drops_later_rows_and_a_line_cut_short(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"note": "kept"}\n{"step": 2, "a": 2}\n{"step": 3, "a": 3}\n{"step": 4, "a"')
    sink = JSONLSink(path)
    sink.rewind(2)
    sink.on_step(3, {"a": 30})
    sink.close()
    assert path.read_text() == '{"step": 1, "a": 1}\n{"note": "kept"}\n{"step": 2, "a": 2}\n{"step": 3, "a": 30}\n'
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl"]


# ----------------------------------------------------------------- 4: another batch size
def test_resuming_with_another_batch_size_continues_with_the_unseen_prompts(prompts):
    recipe = _Recipe()
    state, _ = fit(_state(), recipe, _reward, prompts, steps=1, batch_size=4)
    state, _ = fit(state, recipe, _reward, prompts, steps=3, batch_size=2)
    first, rest = recipe.seen[0], [p for batch in recipe.seen[1:] for p in batch]
    assert sorted(first + rest) == sorted(prompts.text)  # the epoch's other four, none twice
    assert state.data_position == 4 and state.extras["fit/batch_size"] == 2
    # the next epoch starts where the run with batches of 2 from the start would be
    assert prompts.batch_at(state.data_position, 2, seed=state.seed).text == prompts.batch_at(4, 2, seed=state.seed).text


def test_resuming_with_a_batch_size_that_cannot_continue_the_epoch_is_refused(prompts):
    state, _ = fit(_state(), _Recipe(), _reward, prompts, steps=1, batch_size=4)
    with pytest.raises(ValueError, match=r"batch_size=3 differs from the batch_size=4 .*4 prompt\(s\) of epoch 0 .*Pass batch_size=4"):
        fit(state, _Recipe(), _reward, prompts, steps=2, batch_size=3)
    assert state.step == 1  # refused before the first step: the state is still usable


# ----------------------------------------------------------------- 5: save's step argument
def test_save_refuses_a_step_other_than_the_states(tmp_path):
    state = _state().replace(step=2)
    with pytest.raises(ValueError, match=r"step=100 differs from state.step=2.*state.replace\(step=100\)"):
        ck.save(state, tmp_path, step=100)
    assert not list(tmp_path.iterdir())
    assert ck.save(state, tmp_path, step=2) == tmp_path / "step_000002"


# ----------------------------------------------------------------- 6: every=0 saves the last step
def test_fit_saves_the_last_step_with_every_0(tmp_path, prompts):
    saver = ck.Checkpointer(tmp_path, every=0, save_on_sigterm=False)
    done, _ = fit(_state(), _Recipe(), _reward, prompts, steps=2, batch_size=4, checkpointer=saver)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2]
    resumed = ck.Checkpointer(tmp_path, every=0, save_on_sigterm=False).resume(_state(seed=1), "auto")
    assert resumed.step == 2 and _same(_weights(resumed), _weights(done))


# ----------------------------------------------------------------- 7: a metric named "step"
def test_sinks_keep_their_own_integer_step_over_a_metric_named_step(tmp_path):
    from rlkit.observe.notebook import Dashboard

    log, mem, board = JSONLSink(tmp_path / "m.jsonl"), ListSink(), Dashboard(total=5)
    board._widgets = None  # its history only: no figure drawn
    sinks = [log, mem, board]
    try:
        from rlkit.observe.prometheus import PrometheusSink

        sinks.append(PrometheusSink(start_server=False))
    except ImportError:
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PrometheusSink warned about "step" on every run
        for sink in sinks:
            sink.on_step(3, {"step": 99.0, "loss": 0.5})
    log.close()
    row = json.loads((tmp_path / "m.jsonl").read_text())
    assert row == {"step": 3, "loss": 0.5} and type(row["step"]) is int
    assert mem.history == board.history == [{"step": 3, "loss": 0.5}]
    if len(sinks) == 4:
        assert sinks[3].registry.get_sample_value("rlkit_step") == 3.0
