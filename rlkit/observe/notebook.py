"""A live notebook dashboard: progress, metric plots and sample responses (ipywidgets + matplotlib).

    dash = rk.observe.notebook.Dashboard(total=100, keys=("reward/mean", "eval/accuracy"))
    state, history = rk.fit(..., sinks=[dash])

Outside a notebook (no ipywidgets), it degrades to keeping the history; ``dash.plot()`` still
draws a static figure.
"""
from __future__ import annotations

from typing import Sequence


class Dashboard:
    def __init__(self, total: int, keys: Sequence[str] = ("reward/mean", "eval/accuracy", "actor/entropy", "actor/logprob_gap"), every: int = 1):
        self.total, self.keys, self.every = total, tuple(keys), every
        self.history: list[dict] = []
        self.samples: list[str] = []
        self._widgets = None
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
        self.history.append({"step": step, **metrics})
        if self._widgets is None or (step % self.every and step < self.total):  # the last step always shows
            return
        self._bar.value = min(step, self.total)
        latest = " | ".join(f"{k}: {metrics[k]:.3g}" for k in self.keys if k in metrics)
        self._text.value = f"<code>{latest}</code>"
        self._plot.clear_output(wait=True)
        with self._plot:
            import matplotlib.pyplot as plt

            fig = self.plot()
            plt.show()
            plt.close(fig)  # Jupyter's inline backend closes it in show(); other backends would keep one per redraw

    def plot(self, keys: Sequence[str] | None = None):
        """A figure with one panel per metric over steps."""
        import matplotlib.pyplot as plt

        keys = [k for k in (keys or self.keys) if any(k in h for h in self.history)]
        fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4 * max(1, len(keys)), 3), squeeze=False)
        for ax, key in zip(axes[0], keys):
            xs = [h["step"] for h in self.history if key in h]
            ys = [h[key] for h in self.history if key in h]
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None)
            ax.set_title(key)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        return fig

    def close(self) -> None:
        pass
