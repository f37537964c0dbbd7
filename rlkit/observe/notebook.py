"""A live notebook dashboard: progress, the latest metrics and their plots (ipywidgets + matplotlib).

    dash = rk.observe.notebook.Dashboard(total=100, keys=("reward/mean", "eval/accuracy"))
    state, history = rk.fit(..., sinks=[dash])

Outside a notebook (no running IPython kernel, or no ipywidgets), it degrades to keeping the
history; ``dash.plot()`` still draws a static figure.
"""
from __future__ import annotations

import html
import sys
from typing import Sequence

from rlkit._checks import int_at_least
from rlkit.observe.sinks import _json_ready, _metric_items, _rewound, as_keys, as_number, format_value


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
    ``-``) and is left out of the plots, so that an odd metric cannot end a run at its dashboard."""

    def __init__(self, total: int, keys: str | Sequence[str] = ("reward/mean", "eval/accuracy", "actor/entropy", "actor/logprob_gap"), every: int = 1):
        int_at_least(total, "Dashboard: total", 0, " (the step count to reach)")
        int_at_least(every, "Dashboard: every", 1, " (steps between redraws)")
        self.total, self.keys, self.every = total, as_keys(keys), every
        self.history: list[dict] = []
        self.latest: dict = {}  # each key's latest value, whatever step logged it
        self._widgets = None
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
            self._widgets = widgets.VBox([self._bar, self._text, self._plot])
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
