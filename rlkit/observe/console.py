"""Rich console sink: a live progress bar with reward / accuracy, and summary tables."""
from __future__ import annotations

import time
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column, Table
from rich.text import Text

from rlkit._checks import int_at_least
from rlkit.observe.sinks import as_keys, as_number, clip_text, format_value, table_columns, table_rows

#: "kl" is the KL to the reference (present with a KL penalty); approx_kl, the new policy against the
#: old one (about 0 for one update per batch), was shown as "kl" and is "ppo_kl" when asked for
DEFAULT_KEYS = ("reward/mean", "eval/accuracy", "actor/entropy", "actor/kl", "actor/logprob_gap")
SHORT = {"reward/mean": "reward", "eval/accuracy": "acc", "actor/entropy": "ent", "actor/kl": "kl",
         "actor/approx_kl": "ppo_kl", "actor/logprob_gap": "gap"}


class ConsoleSink:
    """Shows a progress bar over ``total`` steps with the latest values of ``keys``.

    The step count and times always show; on a narrow console (or a log file, which rich
    renders 80 columns wide) the values wrap onto further lines, between ``key=value`` pairs,
    instead of squeezing the count and times out.

    ``keys`` may be one name (``keys="sft/loss"``). A value that is not a number still shows (None
    as ``-``, anything else as its text), so that an odd metric cannot end a run at its progress bar.
    ``total=None`` shows an open count (``3/?``). One sink may watch several ``rk.fit`` calls: a
    step past ``total`` moves the bar's end with it (as :class:`rlkit.observe.notebook.Dashboard`
    does), so the bar never reads ``25/10``.

    When the console is not a terminal (stderr redirected to a file, a batch job's log), a live
    bar draws nothing until :meth:`close`, so the log looked silent for hours: there the bar's
    line is printed as a record at the first step, then at most every ``log_every_s`` seconds of
    wall time (0: every step; None: never), and at the step that reaches ``total``: one plain line
    ``RL (grpo) 120/1000 0:12:34 1:30:00 reward=0.41 acc=0.43`` (step/total, elapsed, remaining,
    the values), wrapped between values only where the console is narrower. :meth:`close` prints
    the last step's record when no record shows it already (a run stopped between records), never
    the bar. A terminal (and Jupyter) keeps the live bar alone.

    A metric that is a list of dicts (``samples``: a recipe's ``log_samples``) never shows in the
    bar (``<2 rows>`` if named in ``keys``); with ``samples_every=N`` it is printed as a table
    (:func:`samples_table`, texts clipped to ``sample_chars``) at every step that is a multiple
    of N and at the last (``total``), as TRL prints its completions every logging step. None (the
    default): never."""

    def __init__(self, total: int | None, description: str = "RL", keys: str | Sequence[str] = DEFAULT_KEYS, console: Console | None = None,
                 *, log_every_s: float | None = 30.0, samples_every: int | None = None, sample_chars: int = 120):
        if total is not None:
            int_at_least(total, "ConsoleSink: total", 0, " or None (unknown)")
        if samples_every is not None:
            int_at_least(samples_every, "ConsoleSink: samples_every", 1, " or None (never print the samples)")
        int_at_least(sample_chars, "ConsoleSink: sample_chars", 1, " (characters of a sample's text shown)")
        self.samples_every, self.sample_chars = samples_every, sample_chars
        if log_every_s is not None and (isinstance(log_every_s, bool) or not isinstance(log_every_s, (int, float)) or not log_every_s >= 0):
            raise ValueError(f"ConsoleSink: log_every_s must be a number of seconds >= 0 or None (no periodic records), got {log_every_s!r}")
        self.console = console or Console(stderr=True)
        self.keys = as_keys(keys)
        self.latest: dict[str, Any] = {}
        self.total = total
        self.log_every_s = log_every_s
        fixed = dict(table_column=Column(no_wrap=True))
        self.progress = Progress(
            TextColumn("[bold]{task.description}", **fixed), BarColumn(bar_width=24), MofNCompleteColumn(**fixed),
            TimeElapsedColumn(**fixed), TimeRemainingColumn(**fixed),
            TextColumn("{task.fields[stats]}", table_column=Column(overflow="fold")),
            console=self.console, transient=False,
        )
        self.task = self.progress.add_task(description, total=total, stats="")
        # a file, a pipe or a dumb terminal: rich's live bar shows nothing before it stops
        self._records = not self.console.is_jupyter and (not self.console.is_terminal or self.console.is_dumb_terminal)
        self._step: int | None = None  # the latest step shown
        self._recorded: int | None = None  # the step the latest record showed
        self._recorded_at: float | None = None
        self.progress.start()

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.latest.update({k: v for k, v in metrics.items() if k in self.keys})
        stats = "  ".join(escape(f"{SHORT.get(k, k)}={format_value(self.latest[k])}") for k in self.keys if k in self.latest)
        reached = self.total is not None and step == self.total
        if self.total is not None and step > self.total:
            # a later rk.fit call goes on past total: the bar's end moves with it (it read 25/10)
            self.total = step
            for task in self.progress.tasks:
                if task.id == self.task:
                    task.finished_time = None  # set again below: the elapsed time goes on, not frozen at the old end
            self.progress.update(self.task, total=step)
        self.progress.update(self.task, completed=step, stats=stats)
        self._step = step
        if self._records and self.log_every_s is not None:
            now = time.monotonic()
            if self._recorded_at is None or reached or now - self._recorded_at >= self.log_every_s:
                self._record(now)
        if self.samples_every is not None and (step % self.samples_every == 0 or reached):  # the last step's too
            for key, value in metrics.items():
                rows = table_rows(value)
                if rows is not None:
                    self.console.print(samples_table(rows, f"{key} (step {step})", self.sample_chars))

    def _record(self, now: float) -> None:
        """The bar's line as plain text, no bar: ``RL (grpo) 120/1000 0:12:34 1:30:00 reward=0.41 acc=0.43``
        (description, step/total, elapsed, remaining, values); wrapped between values only when
        longer than the console is wide."""
        task = next(t for t in self.progress.tasks if t.id == self.task)
        total = "?" if task.total is None else f"{int(task.total)}"
        times = " ".join(column.render(task).plain for column in (TimeElapsedColumn(), TimeRemainingColumn()))
        values = [f"{SHORT.get(k, k)}={format_value(self.latest[k])}" for k in self.keys if k in self.latest]
        lines = [f"{task.description} {int(task.completed)}/{total} {times}"]
        for value in values:
            if len(lines[-1]) + 1 + len(value) <= self.console.width:
                lines[-1] += " " + value
            else:
                lines.append(value)
        self.console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
        self._recorded, self._recorded_at = self._step, now

    def close(self) -> None:
        if self._records:
            # a log file gets records only: the last step as one (unless a record shows it already),
            # never the bar itself, which Progress.stop renders with its glyphs over several lines
            # (a run stopped between records, by SIGTERM or Ctrl-C, ended its log with it)
            if self._step is not None and self._recorded != self._step:
                self._record(time.monotonic())
            self.progress.live.transient = True
            self.progress.live.stop()
            return
        self.progress.stop()


def summary_table(title: str, rows: Sequence[tuple[str, str]]) -> Table:
    table = Table(title=title)
    table.add_column("")
    table.add_column("value", justify="right")
    for k, v in rows:
        table.add_row(k, v)
    return table


def samples_table(rows: Sequence[dict], title: str = "samples", max_chars: int = 120) -> Table:
    """A rich table of ``rows`` (``rk.observe.samples``' dicts): one column per key, numbers to 3
    significant digits, texts clipped to ``max_chars`` for display and taken as plain text (a
    response holding ``[bold]`` is not rich markup)."""
    rows = table_rows(list(rows)) or []
    table = Table(title=title, show_lines=True)
    columns = table_columns(rows)
    for name in columns:
        numeric = all(as_number(row.get(name)) is not None or row.get(name) is None for row in rows)
        table.add_column(name, justify="right" if numeric else "left", overflow="fold")
    for row in rows:
        table.add_row(*(Text(clip_text(v if isinstance(v, str) else format_value(v), max_chars)) for v in (row.get(c) for c in columns)))
    return table
