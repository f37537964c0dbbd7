"""A live notebook dashboard: progress, the latest metrics and their plots (ipywidgets + matplotlib).

    dash = rk.observe.notebook.Dashboard(total=100, keys=("reward/mean", "eval/accuracy"))
    state, history = rk.fit(..., sinks=[dash])

Outside a notebook (no running IPython kernel, or no ipywidgets), it degrades to keeping the
history; ``dash.plot()`` still draws a static figure.

A metric that is a table (a list of dicts: the ``samples`` a recipe's ``log_samples=k`` adds,
``rk.observe.samples``) shows under the plots as an HTML table of its latest rows (prompt |
response | reward | advantage), its texts clipped for display at ``sample_chars`` characters (the history
keeps them whole).
"""
from __future__ import annotations

import html
import math
import sys
import warnings
from typing import Sequence

from rlkit._checks import int_at_least
from rlkit.observe.sinks import (_json_ready, _metric_items, _rewound, _step_of, as_keys, as_number, clip_text, format_value,
                                 table_columns, table_rows)


def samples_html(rows: Sequence[dict], max_chars: int = 200, title: str | None = None) -> str:
    """An HTML table of ``rows`` (a list of dicts, such as ``rk.observe.samples`` gives): one column
    per key in order of first appearance (``prompt | response | reward``), numbers to 3 significant
    digits, None and a missing key as ``-``, every text HTML-escaped (a response of ``<b>`` is
    text, not markup) and clipped to ``max_chars`` characters (``…`` marks the cut), its line
    breaks kept. ``title``: a caption (HTML-escaped too). No rows: an empty string."""
    rows = table_rows(list(rows))
    if rows is None:
        return ""
    columns = table_columns(rows)
    cell = "padding:2px 8px;text-align:left;vertical-align:top;white-space:pre-wrap;font-family:monospace"

    def shown(value) -> str:
        if value is None or isinstance(value, str) or as_number(value) is not None:
            text = value if isinstance(value, str) else format_value(value)
        else:  # a list or dict a user put in a row: its JSON
            import json

            text = json.dumps(_json_ready(value), ensure_ascii=False)
        return html.escape(clip_text(text, max_chars))

    head = "".join(f'<th style="{cell}">{html.escape(c)}</th>' for c in columns)
    body = "".join("<tr>" + "".join(f'<td style="{cell}">{shown(row.get(c))}</td>' for c in columns) + "</tr>" for row in rows)
    caption = f"<caption style=\"text-align:left\">{html.escape(title)}</caption>" if title else ""
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _in_kernel() -> bool:
    """Whether this process is a running IPython kernel (Jupyter, VS Code, Colab), where widgets
    show. IPython is not imported for the check: a kernel has imported it already; a plain or
    terminal IPython shell has no ``kernel``."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    try:
        shell = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - an odd IPython: take it as no kernel
        return False
    return shell is not None and getattr(shell, "kernel", None) is not None


class Dashboard:
    """Redraws every ``every`` steps, at the last, ``total``, and when the run ends (``rk.fit`` calls
    :meth:`on_end`: a run whose last step is neither, 32 of a ``total=30, every=5`` dashboard, showed
    step 30); ``keys`` may be one name (``keys="sft/loss"``). A later ``rk.fit`` call that goes past
    ``total`` moves the bar's end on to the next multiple of ``every``, and to the run's real last
    step when it ends. Outside a running notebook kernel it only keeps ``history`` and ``latest``
    (nothing is drawn or printed). A value that is not a number shows as text (None as ``-``) and
    is left out of the plots, so that an odd metric cannot end a run at its dashboard; an infinite
    or NaN one is marked in red at its panel's edge (the line has no point there) and counted in
    the panel's title, so that a diverging loss leaves a mark.

    One dashboard may watch several runs (a cell run again): a step below the last one it got, or
    at it once a run ended, starts a new run, and the display (bar, text, plots, tables) shows the
    latest run only; ``history`` keeps every run's rows (as a ``JSONLSink`` file does) and
    ``latest`` each key's latest value over all of them. A resumed run (``rk.fit`` calls
    :meth:`rewind` first) goes on with the run it resumes.

    A metric that is a list of dicts (``samples``: a recipe's ``log_samples``) shows under the
    plots as a table of its latest rows, redrawn with them (:func:`samples_html`; texts clipped
    to ``sample_chars`` characters for display)."""

    #: panels per row of :meth:`plot`'s figure, and the figure's largest (width, height) in inches:
    #: 30 metrics in one row made a 120-inch figure (12000 x 300 pixels, 4.5 s a redraw)
    columns = 4
    max_figsize = (16.0, 12.0)

    def __init__(self, total: int, keys: str | Sequence[str] = ("reward/mean", "eval/accuracy", "actor/entropy", "actor/logprob_gap"), every: int = 1,
                 *, sample_chars: int = 200):
        int_at_least(total, "Dashboard: total", 0, " (the step count to reach)")
        int_at_least(every, "Dashboard: every", 1, " (steps between redraws)")
        int_at_least(sample_chars, "Dashboard: sample_chars", 1, " (characters of a sample's text shown)")
        self.total, self.keys, self.every, self.sample_chars = total, as_keys(keys), every, sample_chars
        self.history: list[dict] = []
        self.latest: dict = {}  # each key's latest value, whatever step (or run) logged it
        self._planned = total  # the total given: a new run's bar starts from it again
        self._run_start = 0  # the index in history of the shown run's first row
        self._ended = False  # on_end came (and no step since): a step at or below the last one starts a new run
        self._stale = False  # a row the widgets do not show yet
        self._widgets = None
        self._samples = None  # the HTML widget of the tables, in a kernel
        if not _in_kernel():
            # a script or a batch job (ipywidgets may well be installed): a figure drawn every
            # step for nobody (0.2-0.3 s each) and a widget repr printed to stdout
            return
        try:
            import ipywidgets as widgets
            from IPython.display import display
        except ImportError as e:
            # in a kernel without the widgets the cell showed nothing at all, without a word
            warnings.warn(f"Dashboard: {e.name or 'ipywidgets'} is not installed, so nothing is drawn live (the rows are "
                          "kept in .history); pip install 'rlkit[notebook]' and restart the kernel", RuntimeWarning,
                          stacklevel=2)
            return
        try:
            self._bar = widgets.IntProgress(min=0, max=total, description="step")
            self._text = widgets.HTML()
            self._plot = widgets.Output()
            self._samples = widgets.HTML()
            self._widgets = widgets.VBox([self._bar, self._text, self._plot, self._samples])
            display(self._widgets)
        except Exception:  # noqa: BLE001 - not in a notebook: history only
            self._widgets = None

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        row = dict(_metric_items(metrics))
        step = _json_ready(step)  # a numpy or tensor step as the int it holds (see ListSink.on_step)
        if self._starts_run(step):
            # a fresh run on this dashboard (the cell run again): its display starts empty, where it
            # showed the last run's eval/accuracy at the new run's step 2 and joined both runs' lines
            self._run_start, self.total = len(self.history), self._planned
            self._set_bar_max()
        self._ended = False
        self.history.append({"step": step, **row})
        self.latest.update(row)  # as ConsoleSink: a metric logged at some steps (eval/accuracy) stays shown
        self._stale = True
        if step > self.total:
            # one sink watching a later rk.fit call that goes on past total: the bar's end moves with
            # it (it stopped at total, and every step past it redrew the figure); on_end sets the real end
            self.total = step if self.every == 1 else -(-step // self.every) * self.every
            self._set_bar_max()
        if self._widgets is None or (step % self.every and step != self.total):  # the last step always shows
            return
        self._draw()

    def on_end(self, step: int) -> None:
        """The run stopped after ``step`` (``rk.fit`` calls this when it finishes, and when an
        exception stops it): draw what ``every`` skipped since the last redraw, and end the bar at
        ``step`` where a run past ``total`` had moved its end on to a multiple of ``every`` (a
        guess: 35 for a run to 32). The next step at or below the last one starts a new run."""
        step = _json_ready(step)
        self._ended = True
        if isinstance(step, (int, float)) and not isinstance(step, bool) and self.total > self._planned:
            self.total = max(step, self._planned)
            self._set_bar_max()
            self._stale = True
        if self._widgets is not None and self._stale:
            self._draw()

    def _starts_run(self, step) -> bool:
        """Whether ``step`` starts a new run: below the last step this dashboard got (an earlier
        run's steps go on from 1 again), or at it once :meth:`on_end` said that run ended (a re-run
        one-step fit). Two rows of one step (a loop logging its evaluation apart) stay one run."""
        last = _step_of(self.history[-1]) if self.history else None
        if last is None or _step_of({"step": step}) is None:
            return False
        return step < last or (self._ended and step <= last)

    def _run_rows(self) -> list[dict]:
        """The rows the display shows: the latest run's."""
        return self.history[self._run_start:]

    def _set_bar_max(self) -> None:
        if self._widgets is not None:
            self._bar.max = self.total

    def _draw(self) -> None:
        """Redraw the bar, the text line, the plots and the tables from the latest run's rows."""
        rows = self._run_rows()
        step = _step_of(rows[-1]) if rows else 0
        if step is not None:
            self._bar.value = step
        shown = _latest_values(rows)
        latest = " | ".join(f"{k}: {format_value(shown[k])}" for k in self.keys if k in shown)
        self._text.value = f"<code>{html.escape(latest)}</code>"
        self._plot.clear_output(wait=True)
        with self._plot:
            import matplotlib.pyplot as plt

            fig = self.plot()
            plt.show()
            plt.close(fig)  # Jupyter's inline backend closes it in show(); other backends would keep one per redraw
        if self._samples is not None:
            self._samples.value = self.tables_html()
        self._stale = False

    def tables_html(self) -> str:
        """The tables the dashboard shows: each metric of the latest run whose latest value is a
        list of dicts (:func:`samples_html`), captioned with its name and the step that logged it."""
        rows = self._run_rows()
        shown = _latest_values(rows)
        tables = []
        for key, value in shown.items():
            if table_rows(value) is not None:
                step = next((h["step"] for h in reversed(rows) if h.get(key) is value), None)
                tables.append(samples_html(value, self.sample_chars, key if step is None else f"{key} (step {step})"))
        return "".join(tables)

    def rewind(self, step: int) -> None:
        """Forget this run's rows of steps after ``step`` (``rk.fit`` resuming from ``step`` logs them
        again); an earlier run's rows (its steps start over) are kept, as in a ``JSONLSink`` file.
        The steps that follow go on with the run shown (a resumed run is the same run)."""
        kept = _rewound(list(enumerate(self.history)), step, lambda item: _step_of(item[1]))
        self._run_start = sum(1 for i, _ in kept if i < self._run_start)
        self.history[:] = [row for _, row in kept]
        self.latest = _latest_values(self.history)
        self._ended, self._stale = False, True

    def plot(self, keys: Sequence[str] | None = None):
        """A figure with one panel per metric over the latest run's steps (an earlier run's rows
        are in ``history``), up to :attr:`columns` panels a row, within :attr:`max_figsize` inches.
        An infinite or NaN value is a red mark at the panel's top (``inf``, ``nan``: ``^``, ``x``)
        or bottom (``-inf``: ``v``) edge at its step, and its count is in the panel's title."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("Dashboard.plot draws with matplotlib, which is not installed: pip install 'rlkit[notebook]'") from None

        rows = self._run_rows()
        points = {}
        for key in as_keys(keys or self.keys):
            xy = [(h["step"], as_number(h[key])) for h in rows if key in h]
            xy = [(x, y) for x, y in xy if y is not None]
            if xy:
                points[key] = xy
        panels = max(1, len(points))
        columns = min(self.columns, panels)
        lines = -(-panels // columns)
        width, height = min(4.0 * columns, self.max_figsize[0]), min(3.0 * lines, self.max_figsize[1])
        fig, axes = plt.subplots(lines, columns, figsize=(width, height), squeeze=False)
        axes = list(axes.ravel())
        for ax in axes[panels:]:  # the last line's empty places
            ax.remove()
        small = height / lines < 2.5  # many panels: smaller text, so that the plots keep their room
        for ax, (key, xy) in zip(axes, points.items()):
            finite = [(x, y) for x, y in xy if not (isinstance(y, float) and not math.isfinite(y))]
            xs, ys = [x for x, _ in finite], [y for _, y in finite]
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None)
            ax.set_title(key + _mark_non_finite(ax, xy), fontsize="small" if small else None)
            ax.set_xlabel("step", fontsize="small" if small else None)
            if small:
                ax.tick_params(labelsize="small")
                ax.locator_params(nbins=4)  # fewer ticks: a tick is most of a panel's drawing time
            ax.grid(alpha=0.3)
        fig.tight_layout()
        return fig

    def close(self) -> None:
        pass


def _latest_values(rows: Sequence[dict]) -> dict:
    """Each metric's latest value over ``rows`` (a metric logged at some steps only keeps its last)."""
    return {k: v for row in rows for k, v in row.items() if k != "step"}


def _mark_non_finite(ax, xy: list[tuple]) -> str:
    """Mark the non-finite points of ``xy`` on ``ax`` (a line cannot draw them: a diverging loss left
    no mark): red, at the axes' top edge (``inf``: ``^``, ``nan``: ``x``) or bottom edge (``-inf``:
    ``v``), above the step's x. Returns the note for the panel's title (``""`` when all are finite)."""
    edge = ax.get_xaxis_transform()  # x in data, y in axes coordinates (0 bottom, 1 top)
    notes = []
    for name, marker, y, pick in (("inf", "^", 1.0, lambda v: v == math.inf), ("-inf", "v", 0.0, lambda v: v == -math.inf),
                                  ("nan", "x", 1.0, lambda v: v != v)):
        xs = [x for x, v in xy if isinstance(v, float) and pick(v)]
        if xs:
            ax.plot(xs, [y] * len(xs), linestyle="none", marker=marker, color="red", markersize=8, clip_on=False,
                    transform=edge, label=name)
            notes.append(f"{len(xs)} {name}")
    return f"\nnot finite: {', '.join(notes)} (red marks)" if notes else ""
