"""The notebook Dashboard, as a probe found it wrong:

- a run whose last step is off its redraw schedule (32 of a ``total=30, every=5`` dashboard, or
  any last step neither a multiple of ``every`` nor ``total``) left the display at an earlier step
  and the bar at a guessed end (30/35): ``rk.fit`` now calls ``sink.on_end(step)``, also when an
  exception stops it;
- reused for a fresh run (a cell run again), it showed the old run's values and joined both runs
  into one line (x going 1..4, 1..4);
- 30 metrics made one row of 30 panels (a 120-inch figure);
- an infinite or NaN value left no mark on its panel.

Fast: a linear "model" and a made-up training step stand in for a language model and a recipe,
and stand-in widgets for ipywidgets (what is checked is what the dashboard shows)."""
from __future__ import annotations

import json

import matplotlib
import pytest
import torch

import rlkit as rk
from rlkit.loop import fit
from rlkit.observe.sinks import JSONLSink, ListSink, end_all

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rlkit.observe.notebook import Dashboard  # noqa: E402


@pytest.fixture
def board_of(drawn_dashboard):
    """``board_of(**kwargs)``: a drawing Dashboard (conftest's ``drawn_dashboard``) counting the steps
    it drew at in ``board.drawn``."""

    def make(**kwargs) -> Dashboard:
        board = drawn_dashboard(**kwargs)
        board.drawn = []
        plot = board.plot

        def counted(*args, **kw):
            board.drawn.append(board.history[-1]["step"] if board.history else None)
            return plot(*args, **kw)

        board.plot = counted
        return board

    return make


@pytest.fixture(autouse=True)
def _no_figures_left():
    yield
    plt.close("all")


def _state(seed=0):
    torch.manual_seed(seed)
    return rk.init(torch.nn.Linear(4, 3), rk.optim.adamw(lr=1e-2), seed=7)


class _Recipe:
    """A made-up training step; ``fail_at``: raise there (before the step's update)."""

    def __init__(self, fail_at=None, extra=None):
        self.fail_at, self.extra = fail_at, extra or {}

    def step(self, state, prompts, reward):
        step = state.step + 1
        if step == self.fail_at:
            raise ValueError(f"made-up failure at step {step}")
        return state.replace(step=step, policy_version=state.policy_version + 1), {"loss": step / 10, **self.extra}


def _reward(completions, **kwargs):
    return [0.0 for _ in completions]


@pytest.fixture
def prompts(char_tok):
    return rk.load_prompts([f"{i}+{i}=" for i in range(8)], char_tok)


# ----------------------------------------------------------------- 1: the run's last step shows
def test_a_second_fit_past_total_ends_the_bar_at_its_last_step_and_draws_it(board_of, prompts):
    """Dashboard(total=3, every=2), then a second fit to step 5: the bar stopped at 4/6 (the end
    moved on to the next multiple of every) and the text and plots at step 4."""
    board = board_of(total=3, every=2, keys=("loss",))
    state, _ = fit(_state(), _Recipe(), _reward, prompts, steps=3, batch_size=4, sinks=[board])
    assert board.drawn == [2, 3] and (board._bar.value, board._bar.max) == (3, 3)
    state, _ = fit(state, _Recipe(), _reward, prompts, steps=5, batch_size=4, sinks=[board])
    assert board.drawn == [2, 3, 4, 5]
    assert (board._bar.value, board._bar.max) == (5, 5) and board.total == 5
    assert board._text.value == "<code>loss: 0.5</code>"


def test_a_run_ending_off_the_redraw_schedule_draws_its_last_step(board_of, prompts):
    board = board_of(total=10, every=4, keys=("loss",))
    fit(_state(), _Recipe(), _reward, prompts, steps=5, batch_size=4, sinks=[board])
    assert board.drawn == [4, 5]
    assert (board._bar.value, board._bar.max) == (5, 10)  # a run that stopped short of total: its bar shows it
    assert board._text.value == "<code>loss: 0.5</code>"


def test_fit_stopped_by_an_exception_ends_the_sinks_and_raises_the_exception_as_it_was(board_of, prompts):
    board, ended = board_of(total=10, every=5, keys=("loss",)), []

    class Ends:
        def on_step(self, step, metrics):
            pass

        def on_end(self, step):
            ended.append(step)
            raise RuntimeError("the sink's own failure")

    with pytest.raises(ValueError, match="made-up failure at step 3") as info:
        fit(_state(), _Recipe(fail_at=3), _reward, prompts, steps=6, batch_size=4, sinks=[Ends(), board, ListSink()])
    assert ended == [2] and board.drawn == [2] and board._bar.value == 2  # the sink after the failing one got it too
    assert info.value.state.step == 2
    notes = getattr(info.value, "__notes__", [])
    assert any("on_end raised RuntimeError: the sink's own failure" in n for n in notes), notes


def test_an_on_end_failure_after_a_finished_run_carries_the_trained_state(prompts):
    later = []

    class Fails:
        def on_step(self, step, metrics):
            pass

        def on_end(self, step):
            raise RuntimeError("on_end broke")

    class Later(ListSink):
        def on_end(self, step):
            later.append(step)

    with pytest.raises(RuntimeError, match="on_end broke") as info:
        fit(_state(), _Recipe(), _reward, prompts, steps=2, batch_size=4, sinks=[Fails(), Later()])
    assert later == [2]  # told the run ended, though an earlier sink failed there
    assert info.value.state.step == 2 and len(info.value.history) == 2


def test_end_all_skips_sinks_without_on_end():
    seen = []

    class Ends:
        def on_end(self, step):
            seen.append(step)

    end_all([ListSink(), Ends(), object()], 7)
    assert seen == [7]


# ----------------------------------------------------------------- 2: a fresh run on a reused dashboard
def test_a_reused_dashboard_shows_only_the_fresh_run_and_nothing_is_lost(board_of, prompts, tmp_path):
    """Run 1 evaluated at step 4; run 2 (a fresh state, the cell run again) showed run 1's
    eval/accuracy at its step 2, and plot() joined both runs (x 1..4, 1..4)."""
    board = board_of(total=4, keys=("loss", "eval/accuracy"))
    log = JSONLSink(tmp_path / "m.jsonl")
    seen = {}

    class Peek:
        def on_step(self, step, metrics):
            seen[len(seen)] = board._text.value

    fit(_state(), _Recipe(), _reward, prompts, steps=4, batch_size=4, sinks=[board, log],
        eval_fn=lambda state: {"accuracy": 0.9}, eval_every=4)
    fit(_state(seed=1), _Recipe(), _reward, prompts, steps=4, batch_size=4, sinks=[board, log, Peek()],
        eval_fn=lambda state: {"accuracy": 0.1}, eval_every=4)
    log.close()
    assert seen[1] == "<code>loss: 0.2</code>"  # run 2's step 2: no eval/accuracy of run 1
    assert board._text.value == "<code>loss: 0.4 | eval/accuracy: 0.1</code>"
    assert (board._bar.value, board._bar.max) == (4, 4)
    fig = board.plot()
    assert [list(ax.lines[0].get_xdata()) for ax in fig.axes] == [[1, 2, 3, 4], [4]]
    assert list(fig.axes[1].lines[0].get_ydata()) == [0.1]
    # every run's rows are kept: in the dashboard's history, and in the JSONL file beside it
    assert [h["step"] for h in board.history] == [1, 2, 3, 4] * 2
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] * 2 and [r["eval/accuracy"] for r in rows if "eval/accuracy" in r] == [0.9, 0.1]


def test_a_re_run_one_step_fit_starts_a_new_display(board_of, prompts):
    board = board_of(total=1, keys=("loss", "only_a"))
    fit(_state(), _Recipe(extra={"only_a": 1.0}), _reward, prompts, steps=1, batch_size=4, sinks=[board])
    assert board._text.value == "<code>loss: 0.1 | only_a: 1</code>"
    fit(_state(seed=1), _Recipe(), _reward, prompts, steps=1, batch_size=4, sinks=[board])
    assert board._text.value == "<code>loss: 0.1</code>"
    assert [ax.get_title() for ax in board.plot().axes] == ["loss"]


def test_a_resumed_run_and_two_rows_of_one_step_stay_one_run(board_of):
    board = board_of(total=6, keys=("loss", "eval/accuracy"))
    for step in range(1, 5):
        board.on_step(step, {"loss": step / 10})
    board.on_end(4)  # stopped at step 4, resumed from its step-2 checkpoint: fit rewinds to 2
    board.rewind(2)
    board.on_step(3, {"loss": 0.35})
    board.on_step(3, {"eval/accuracy": 0.5})  # a hand-written loop logging its evaluation apart
    assert board._text.value == "<code>loss: 0.35 | eval/accuracy: 0.5</code>"
    fig = board.plot()
    assert [list(ax.lines[0].get_xdata()) for ax in fig.axes] == [[1, 2, 3], [3]]


# ----------------------------------------------------------------- 3: many metrics
@pytest.mark.parametrize("n, lines", [(30, 8), (5, 2), (3, 1)])
def test_many_metrics_are_a_grid_of_panels_within_a_bounded_figure(n, lines):
    keys = [f"m{i}" for i in range(n)]
    board = Dashboard(total=3, keys=keys)
    for step in (1, 2, 3):
        board.on_step(step, {k: float(step * i) for i, k in enumerate(keys)})
    fig = board.plot()
    width, height = fig.get_size_inches()
    assert width <= Dashboard.max_figsize[0] and height <= Dashboard.max_figsize[1], (width, height)
    assert [ax.get_title() for ax in fig.axes] == keys  # the grid's empty places are removed
    lefts = sorted({round(ax.get_position().x0, 3) for ax in fig.axes})
    bottoms = {round(ax.get_position().y0, 3) for ax in fig.axes}
    assert len(lefts) == min(n, Dashboard.columns) and len(bottoms) == lines


# ----------------------------------------------------------------- 4: inf and NaN leave a mark
def test_non_finite_values_are_marked_at_the_panels_edge_and_counted_in_its_title():
    board = Dashboard(total=5, keys=("loss", "b"))
    inf, nan = float("inf"), float("nan")
    for step, (loss, b) in enumerate([(1.0, nan), (inf, 2.0), (3.0, -inf), (2.5, 2.5)], 1):
        board.on_step(step, {"loss": loss, "b": b})
    fig = board.plot()
    loss_ax, b_ax = fig.axes
    assert list(loss_ax.lines[0].get_xdata()) == [1, 3, 4]  # the line: the finite points
    assert loss_ax.get_title() == "loss\nnot finite: 1 inf (red marks)"
    assert b_ax.get_title() == "b\nnot finite: 1 -inf, 1 nan (red marks)"

    def marks(ax):  # (step, height in the panel: 0 bottom, 1 top) of the red marks
        return sorted((float(x), float(y)) for line in ax.lines[1:] for x, y in zip(line.get_xdata(), line.get_ydata()))

    assert marks(loss_ax) == [(2.0, 1.0)]
    assert marks(b_ax) == [(1.0, 1.0), (3.0, 0.0)]
    assert all(line.get_color() == "red" for line in loss_ax.lines[1:] + b_ax.lines[1:])
    assert b_ax.get_ylim()[0] > 1.5  # the marks' heights are of the panel (its edge), not data: the scale is the data's
    # a metric that is only non-finite still has its panel and marks
    only = Dashboard(total=2, keys="diverged")
    only.on_step(1, {"diverged": nan})
    only.on_step(2, {"diverged": inf})
    (ax,) = only.plot().axes
    assert marks(ax) == [(1.0, 1.0), (2.0, 1.0)] and "1 inf, 1 nan" in ax.get_title()


def test_the_sft_warmup_tells_its_sinks_it_ended_at_its_last_step():
    task = rk.tasks.arithmetic(digits=1, n_train=20, n_test=2)
    model = rk.models.tiny(task.tokenizer, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                           num_key_value_heads=1, num_hidden_layers=1)

    class Ends:
        def __init__(self):
            self.steps, self.ends = [], []

        def on_step(self, step, metrics):
            self.steps.append(step)

        def on_end(self, step):
            self.ends.append(step)

    sink = Ends()
    rk.sft.warmup(model, task.tokenizer, task.sft_examples, steps=3, batch_size=2, sinks=[sink])
    assert sink.steps == [1, 2, 3] and sink.ends == [3]

    class Stop(Ends):
        def on_step(self, step, metrics):
            super().on_step(step, metrics)
            if step == 2:
                raise KeyboardInterrupt

    stopped = Stop()
    with pytest.raises(KeyboardInterrupt):
        rk.sft.warmup(model, task.tokenizer, task.sft_examples, steps=5, batch_size=2, sinks=[stopped])
    assert stopped.ends == [2]  # the step it stopped at, for the dashboard to draw
