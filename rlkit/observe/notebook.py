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
import sys
from typing import Sequence

from rlkit._checks import int_at_least
from rlkit.observe.sinks import (_json_ready, _metric_items, _rewound, as_keys, as_number, clip_text, format_value, table_columns,
                                 table_rows)


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
    """Redraws every ``every`` steps (and at the last, ``total``; a later ``rk.fit`` call that goes
    past ``total`` moves it to the next multiple of ``every``); ``keys`` may be one name
    (``keys="sft/loss"``). Outside a running notebook kernel it only keeps ``history`` and
    ``latest`` (nothing is drawn or printed). A value that is not a number shows as text (None as
    ``-``) and is left out of the plots, so that an odd metric cannot end a run at its dashboard.

    A metric that is a list of dicts (``samples``: a recipe's ``log_samples``) shows under the
    plots as a table of its latest rows, redrawn with them (:func:`samples_html`; texts clipped
    to ``sample_chars`` characters for display)."""

    def __init__(self, total: int, keys: str | Sequence[str] = ("reward/mean", "eval/accuracy", "actor/entropy", "actor/logprob_gap"), every: int = 1,
                 *, sample_chars: int = 200):
        int_at_least(total, "Dashboard: total", 0, " (the step count to reach)")
        int_at_least(every, "Dashboard: every", 1, " (steps between redraws)")
        int_at_least(sample_chars, "Dashboard: sample_chars", 1, " (characters of a sample's text shown)")
        self.total, self.keys, self.every, self.sample_chars = total, as_keys(keys), every, sample_chars
        self.history: list[dict] = []
        self.latest: dict = {}  # each key's latest value, whatever step logged it
        self._widgets = None
        self._samples = None  # the HTML widget of the tables, in a kernel
        if not _in_kernel():
            # a script or a batch job (ipywidgets may well be installed): a figure drawn every
            # step for nobody (0.2-0.3 s each) and a widget repr printed to stdout
            return
        try:
            import ipywidgets as widgets
            from IPython.display import display

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
        self.history.append({"step": step, **row})
        self.latest.update(row)  # as ConsoleSink: a metric logged at some steps (eval/accuracy) stays shown
        if step > self.total:
            # one sink watching a later rk.fit call that goes on past total: the bar's end moves with
            # it (it stopped at total, and every step past it redrew the figure)
            self.total = step if self.every == 1 else -(-step // self.every) * self.every
            if self._widgets is not None:
                self._bar.max = self.total
        if self._widgets is None or (step % self.every and step != self.total):  # the last step always shows
            return
        self._bar.value = step
        latest = " | ".join(f"{k}: {format_value(self.latest[k])}" for k in self.keys if k in self.latest)
        self._text.value = f"<code>{html.escape(latest)}</code>"
        self._plot.clear_output(wait=True)
        with self._plot:
            import matplotlib.pyplot as plt

            fig = self.plot()
            plt.show()
            plt.close(fig)  # Jupyter's inline backend closes it in show(); other backends would keep one per redraw
        if self._samples is not None:
            self._samples.value = self.tables_html()

    def tables_html(self) -> str:
        """The tables the dashboard shows: each metric whose latest value is a list of dicts
        (:func:`samples_html`), captioned with its name and the step that logged it."""
        tables = []
        for key, value in self.latest.items():
            if table_rows(value) is not None:
                step = next((h["step"] for h in reversed(self.history) if h.get(key) is value), None)
                tables.append(samples_html(value, self.sample_chars, key if step is None else f"{key} (step {step})"))
        return "".join(tables)

    def rewind(self, step: int) -> None:
        """Forget this run's rows of steps after ``step`` (``rk.fit`` resuming from ``step`` logs them
        again); an earlier run's rows (its steps start over) are kept, as in a ``JSONLSink`` file."""
        self.history[:] = _rewound(self.history, step)
        self.latest = {k: v for row in self.history for k, v in row.items() if k != "step"}

    def plot(self, keys: Sequence[str] | None = None):
        """A figure with one panel per metric over steps."""
        import matplotlib.pyplot as plt

        points = {}
        for key in as_keys(keys or self.keys):
            xy = [(h["step"], as_number(h[key])) for h in self.history if key in h]
            xy = [(x, y) for x, y in xy if y is not None]
            if xy:
                points[key] = xy
        fig, axes = plt.subplots(1, max(1, len(points)), figsize=(4 * max(1, len(points)), 3), squeeze=False)
        for ax, (key, xy) in zip(axes[0], points.items()):
            xs, ys = [x for x, _ in xy], [y for _, y in xy]
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None)
            ax.set_title(key)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        return fig

    def close(self) -> None:
        pass
