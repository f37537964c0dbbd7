"""rk.fit stopped early, as a notebook user meets it: a step whose evaluation was interrupted keeps
its training metrics (history and sinks), the donated handle passed in points at the run's latest
state when the cell is run again (a DonatedStateError carrying it as .state), and a donated state
still has a repr (a notebook and a debugger display it)."""
import pytest

import rlkit as rk
from rlkit.state import DonatedStateError


TASK_N_TRAIN = 64  # the size of the training split of conftest's ``task``


def test_a_step_whose_evaluation_is_interrupted_keeps_its_metrics(task, fresh_state):
    """Ctrl-C in eval_fn at step 2: exc.state was at step 2 but exc.history and the sinks ended at
    step 1, and a fit continued from exc.state began at 3: step 2 was logged nowhere."""
    sink = rk.observe.ListSink()

    def eval_fn(state):
        if state.step == 2:
            raise KeyboardInterrupt
        return {"accuracy": 0.5}

    with pytest.raises(KeyboardInterrupt) as info:
        rk.fit(fresh_state(), "grpo", task.reward, task.train, steps=3, batch_size=2, sinks=[sink], eval_fn=eval_fn,
               eval_every=1)
    assert info.value.state.step == 2
    assert len(info.value.history) == 2
    assert "eval/accuracy" in info.value.history[0] and "eval/accuracy" not in info.value.history[1]
    assert [row["step"] for row in sink.history] == [1, 2]


def test_running_the_cell_again_points_at_the_runs_latest_state(task, fresh_state):
    calls = {"n": 0}

    def flaky(completions, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("reward server timed out")
        return task.reward(completions, **kw)

    state = fresh_state()
    with pytest.raises(Exception) as first:
        rk.fit(state, "grpo", flaky, task.train, steps=4, batch_size=2)
    latest = first.value.state
    assert latest.step == 2
    with pytest.raises(DonatedStateError) as again:  # the same cell, run again with the donated handle
        rk.fit(state, "grpo", flaky, task.train, steps=4, batch_size=2)
    message = str(again.value)
    assert "passed to rk.fit, which stopped with RewardError" in message and "after step 2" in message
    assert "sys.last_value.state" in message
    assert again.value.state is latest  # what `state = sys.last_value.state` now reaches
    state, history = rk.fit(again.value.state, "grpo", flaky, task.train, steps=4, batch_size=2)
    assert state.step == 4 and len(history) == 2
    # once the latest state is itself used up, the old handle no longer points at it
    with pytest.raises(DonatedStateError) as stale:
        latest.step  # noqa: B018
    assert getattr(stale.value, "state", None) is None
    assert "passed to rk.fit" not in str(stale.value)


def test_a_donated_state_has_a_repr(task, fresh_state):
    state = fresh_state()
    assert repr(state).startswith("TrainState(actor=")
    batch = rk.advantage(rk.score(rk.rollout(state, task.train.take(range(2)), n=2, max_new_tokens=2), task.reward), "grpo")
    new, _ = rk.update(state, batch, max_logprob_gap=None)
    assert repr(state) == "TrainState(<donated to rlkit.update: use the state it returned>)"
    assert str(state) == repr(state)
    assert repr(new).startswith("TrainState(actor=")


def test_a_sink_interrupted_at_a_step_does_not_keep_the_step_from_the_others(task, fresh_state):
    """Ctrl-C inside an earlier sink (the Dashboard's redraw) left the later sinks without the step."""
    class Slow:
        def on_step(self, step, metrics):
            if step == 2:
                raise KeyboardInterrupt

    later = rk.observe.ListSink()
    with pytest.raises(KeyboardInterrupt) as info:
        rk.fit(fresh_state(), "grpo", task.reward, task.train, steps=3, batch_size=2, sinks=[Slow(), later])
    assert info.value.state.step == 2
    assert [row["step"] for row in later.history] == [1, 2]
