"""Rich console sink: a live progress bar with reward / accuracy, and summary tables."""
from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column, Table

DEFAULT_KEYS = ("reward/mean", "eval/accuracy", "actor/entropy", "actor/approx_kl", "actor/logprob_gap")
SHORT = {"reward/mean": "reward", "eval/accuracy": "acc", "actor/entropy": "ent", "actor/approx_kl": "kl", "actor/logprob_gap": "gap"}


class ConsoleSink:
    """Shows a progress bar over ``total`` steps with the latest values of ``keys``.

    The step count and times always show; on a narrow console (or a log file, which rich
    renders 80 columns wide) the values wrap onto further lines, between ``key=value`` pairs,
    instead of squeezing the count and times out."""

    def __init__(self, total: int, description: str = "RL", keys: Sequence[str] = DEFAULT_KEYS, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.keys = keys
        self.latest: dict[str, float] = {}
        fixed = dict(table_column=Column(no_wrap=True))
        self.progress = Progress(
            TextColumn("[bold]{task.description}", **fixed), BarColumn(bar_width=24), MofNCompleteColumn(**fixed),
            TimeElapsedColumn(**fixed), TimeRemainingColumn(**fixed),
            TextColumn("{task.fields[stats]}", table_column=Column(overflow="fold")),
            console=self.console, transient=False,
        )
        self.task = self.progress.add_task(description, total=total, stats="")
        self.progress.start()

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.latest.update({k: v for k, v in metrics.items() if k in self.keys})
        stats = "  ".join(f"{SHORT.get(k, k)}={self.latest[k]:.3g}" for k in self.keys if k in self.latest)
        self.progress.update(self.task, completed=step, stats=stats)

    def close(self) -> None:
        self.progress.stop()


def summary_table(title: str, rows: Sequence[tuple[str, str]]) -> Table:
    table = Table(title=title)
    table.add_column("")
    table.add_column("value", justify="right")
    for k, v in rows:
        table.add_row(k, v)
    return table
