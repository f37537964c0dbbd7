"""Metric sinks. Transforms return metrics; sinks subscribe to them (a pure function never logs).

A sink is any object with ``on_step(step: int, metrics: dict)`` and optionally ``close()``.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Protocol


class Sink(Protocol):
    def on_step(self, step: int, metrics: dict[str, float]) -> None: ...


class JSONLSink:
    """Appends one JSON object per step to a file (flushed each line: nothing lost on a crash)."""

    def __init__(self, path: str | os.PathLike, mode: str = "a"):
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        self.path = os.fspath(path)
        self._f = open(self.path, mode, encoding="utf-8")

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class ListSink:
    """Keeps every step's metrics in memory (``sink.history``)."""

    def __init__(self):
        self.history: list[dict[str, Any]] = []

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.history.append({"step": step, **metrics})


class CallbackSink:
    def __init__(self, fn):
        self.fn = fn

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.fn(step, metrics)


def broadcast(sinks: Iterable[Any], step: int, metrics: dict[str, float]) -> None:
    for sink in sinks:
        sink.on_step(step, metrics)


def close_all(sinks: Iterable[Any]) -> None:
    for sink in sinks:
        close = getattr(sink, "close", None)
        if close is not None:
            close()
