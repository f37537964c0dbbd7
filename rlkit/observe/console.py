"""Rich console sink: a live progress bar with reward / accuracy, and summary tables."""
from __future__ import annotations

from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column, Table

from rlkit._checks import int_at_least
from rlkit.observe.sinks import as_keys, format_value

DEFAULT_KEYS = ("reward/mean", "eval/accuracy", "actor/entropy", "actor/approx_kl", "actor/logprob_gap")
SHORT = {"reward/mean": "reward", "eval/accuracy": "acc", "actor/entropy": "ent", "actor/approx_kl": "kl", "actor/logprob_gap": "gap"}


class ConsoleSink:
    """Shows a progress bar over ``total`` steps with the latest values of ``keys``.

    The step count and times always show; on a narrow console (or a log file, which rich
    renders 80 columns wide) the values wrap onto further lines, between ``key=value`` pairs,
    instead of squeezing the count and times out.

    ``keys`` may be one name (``keys="sft/loss"``). A value that is not a number still shows (None
    as ``-``, anything else as its text), so that an odd metric cannot end a run at its progress bar.
    ``total=None`` shows an open count (``3/?``)."""

    def __init__(self, total: int | None, description: str = "RL", keys: str | Sequence[str] = DEFAULT_KEYS, console: Console | None = None):
        if total is not None:
            int_at_least(total, "ConsoleSink: total", 0, " or None (unknown)")
        self.console = console or Console(stderr=True)
        self.keys = as_keys(keys)
        self.latest: dict[str, Any] = {}
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
        stats = "  ".join(escape(f"{SHORT.get(k, k)}={format_value(self.latest[k])}") for k in self.keys if k in self.latest)
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
