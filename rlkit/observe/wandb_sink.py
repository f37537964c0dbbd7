"""Weights & Biases sink; ``wandb`` is imported only when this sink is built.

The mode is wandb's own where it is given: ``mode=`` to the sink, or ``WANDB_MODE`` (``disabled``
writes nothing, as in CI). Otherwise it runs online where wandb has a key (``WANDB_API_KEY``, or
the one ``wandb login`` stores in ``~/.netrc``), and offline without one: a local run you can
``wandb sync`` later.

A metric that is a list of dicts (``samples``: a recipe's ``log_samples``, ``rk.observe.samples``)
is logged as a ``wandb.Table`` under its name, columns ``step`` and the rows' keys (``prompt``,
``response``, ``reward``, ``advantage``), as TRL logs its completions; numbers as they are.

wandb keeps one row per step and ignores a step at or below the last it logged: a run resumed in
the same process from an earlier checkpoint (its steps after the checkpoint come again), or a
second fresh ``fit`` on the same sink, would lose those steps in wandb. The sink warns when that
happens, naming the steps; give each such run a new ``WandbSink`` (a new wandb run), as the JSONL
and list sinks need not (they rewind).
"""
from __future__ import annotations

import os
import warnings

from rlkit.observe.sinks import _json_ready, _metric_items, table_columns, table_rows


class WandbSink:
    def __init__(self, project: str = "rlkit", config: dict | None = None, **init_kwargs):
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("WandbSink needs wandb: pip install 'rlkit[wandb]'") from exc
        # WANDB_MODE passed on as given (wandb's settings, once set up in a process, would not read
        # it again); without either, offline only where wandb would have no key to go online with
        mode = init_kwargs.pop("mode", None) or os.environ.get("WANDB_MODE") or (None if _has_key() else "offline")
        self.run = wandb.init(project=project, config=config or {}, **({"mode": mode} if mode else {}), **init_kwargs)
        self._wandb = wandb
        self._last: int | None = None  # the highest step logged: wandb ignores any step at or below it
        self._warned = False

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        # commit now: by default wandb holds a step's values until the next step's arrive, and a
        # run that dies before then (or before close) would lose its last step
        # (the step is wandb's step: a metric named "step" would be a chart of its own)
        step = int(_json_ready(step))
        if self._last is not None and step <= self._last:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"WandbSink: step {step} comes after step {self._last} was logged; wandb keeps one row per step and "
                    f"ignores steps up to {self._last} now, so this run's steps {step}..{self._last} are not in wandb run "
                    f"{getattr(self.run, 'name', None)!r} (the rest are). A resumed run or a new fit needs a new WandbSink "
                    "(a new wandb run); the JSONL and list sinks keep them", RuntimeWarning, stacklevel=2)
            return
        self._last = step
        row = {k: self._table(step, rows) if (rows := table_rows(v)) is not None else v for k, v in _metric_items(metrics)}
        self.run.log(row, step=step, commit=True)

    def _table(self, step: int, rows: list[dict]):
        """``rows`` as a ``wandb.Table`` with a ``step`` column first (each step's table is its own
        version in the run: the step says which one a row came from). Values are JSON-ready (a
        numpy reward as a number), a key a row lacks is None."""
        columns = [c for c in table_columns(rows) if c != "step"]  # a row's own "step" would be a second column of that name
        data = [[step, *(_json_ready(row.get(c)) for c in columns)] for row in rows]
        return self._wandb.Table(columns=["step", *columns], data=data)

    def close(self) -> None:
        self.run.finish()


def _has_key() -> bool:
    """Whether wandb has an API key: ``WANDB_API_KEY``, or ``wandb login``'s entry in ``~/.netrc``
    for its host (``WANDB_BASE_URL``, default api.wandb.ai). Read locally, no request made."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])
