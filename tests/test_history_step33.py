"""A metric named "step" does not overwrite the step of rk.fit's or sft.warmup's history rows (the
rows are a ListSink's, whose step wins; fit's rows had the metric's value as their step)."""
import rlkit as rk


class _StepMetric:
    """A recipe of one's own whose metrics include a key named "step"."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, state, prompts, reward):
        state, metrics = self.inner.step(state, prompts, reward)
        return state, {**metrics, "step": 99.0}


def test_fit_rows_keep_their_step_over_a_metric_named_step(task, fresh_state):
    seen = rk.observe.ListSink()
    recipe = _StepMetric(rk.recipes.get("grpo").with_(n=2, max_new_tokens=2))
    _, history = rk.fit(fresh_state(), recipe, task.reward, task.train, steps=2, batch_size=2, sinks=[seen])
    assert [h["step"] for h in history] == [1, 2]
    assert history == seen.history
    assert list(history[0])[0] == "step"  # first, as a ListSink's and a JSONL file's rows


def test_step_row_puts_the_step_first_and_lets_it_win():
    from rlkit.observe.sinks import step_row

    assert step_row(3, {"loss": 1.0, "step": 7}) == {"step": 3, "loss": 1.0}
    assert list(step_row(3, {"loss": 1.0})) == ["step", "loss"]
