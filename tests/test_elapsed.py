"""``time/elapsed_s`` is the run's training wall time, not the current ``fit`` call's: it goes on
across a second ``fit`` on the same state and across a checkpoint resume (it is kept in
``state.extras["fit/elapsed_s"]``), so a metrics file or a plot of reward against wall time of a
resumed run has no jump back to zero. Time spent between calls (a notebook idle) is not counted."""
import time

import pytest

import rlkit as rk
from rlkit.checkpoint import Checkpointer
from rlkit.loop import ELAPSED_KEY


TASK_N_TRAIN = 32  # the size of the training split of conftest's ``task``


def _fit(state, task, steps, **kw):
    return rk.fit(state, rk.recipes.get("grpo").with_(n=2, max_new_tokens=4), task.reward, task.train, steps=steps,
                  batch_size=2, **kw)


def test_elapsed_goes_on_across_fit_calls_and_skips_the_idle_time_between(task, fresh_state):
    state, first = _fit(fresh_state(), task, 2)
    assert state.extras[ELAPSED_KEY] == first[-1]["time/elapsed_s"]
    time.sleep(0.3)  # idle in the notebook: not training time
    state, second = _fit(state, task, 4)
    clock = [h["time/elapsed_s"] for h in first + second]
    assert clock == sorted(clock) and len(set(clock)) == 4
    gap = second[0]["time/elapsed_s"] - first[-1]["time/elapsed_s"]
    # the second call's first step adds about its own duration to the clock, not a restart at zero
    # and not the idle sleep
    assert gap == pytest.approx(second[0]["time/step_s"], abs=0.25)
    assert second[0]["time/elapsed_s"] > second[0]["time/step_s"]


def test_a_resumed_run_continues_the_checkpointed_clock(task, fresh_state, tmp_path):
    saver = Checkpointer(tmp_path, every=2, save_on_sigterm=False)
    _, history = _fit(fresh_state(), task, 2, checkpointer=saver)
    resumed = saver.restore(fresh_state())
    assert resumed.extras[ELAPSED_KEY] == pytest.approx(history[-1]["time/elapsed_s"])
    _, more = _fit(resumed, task, 3)
    assert more[0]["time/elapsed_s"] > history[-1]["time/elapsed_s"]


def test_a_fresh_run_at_step_0_starts_at_zero_even_with_copied_extras(task, fresh_state):
    """A state at step 0 carrying another run's extras (copied in by hand) is a new run: its clock
    starts at zero. A bad stored value (not a number, negative) is ignored the same way."""
    for stale in (1e6, -3.0, "soon"):
        state = fresh_state()
        state = state.replace(extras={**state.extras, ELAPSED_KEY: stale})
        _, history = _fit(state, task, 1)
        assert history[0]["time/elapsed_s"] == pytest.approx(history[0]["time/step_s"], abs=0.25)
    state, _ = _fit(fresh_state(), task, 1)
    state = state.replace(extras={**state.extras, ELAPSED_KEY: "soon"})  # past step 0, unreadable: from zero
    _, history = _fit(state, task, 2)
    assert history[0]["time/elapsed_s"] == pytest.approx(history[0]["time/step_s"], abs=0.25)
