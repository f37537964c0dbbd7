"""Metric sinks. Transforms return metrics; sinks subscribe to them (a pure function never logs).

A sink is any object with ``on_step(step: int, metrics: dict)`` and optionally ``close()``.
"""
from __future__ import annotations

import json
import math
import numbers
import os
from typing import Any, Iterable, Protocol


class Sink(Protocol):
    def on_step(self, step: int, metrics: dict[str, float]) -> None: ...


def as_number(value: Any) -> int | float | None:
    """``value`` as a plain Python number (bool, int or float), or None when it is not one number.

    Metrics come from user code too (an ``eval_fn`` inside ``rk.fit``), so a numpy scalar
    (``np.float32``, ``np.int64``) or a 0-d tensor must count as the number it holds: neither
    ``json`` nor a Prometheus gauge nor a ``:.3g`` format takes every one of them as it is."""
    if isinstance(value, (bool, int, float)):
        return value
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):  # numpy scalar, 0-d array or tensor
        value = value.item()
        return value if isinstance(value, (bool, int, float)) else None
    if isinstance(value, numbers.Real):  # fractions.Fraction and other registered reals
        return float(value)
    return None


def as_keys(keys: str | Iterable[str]) -> tuple[str, ...]:
    """``keys`` as a tuple of metric names; a single string is one name, not its characters."""
    return (keys,) if isinstance(keys, str) else tuple(keys)


def format_value(value: Any) -> str:
    """A metric value for a progress bar or dashboard: a number (of any kind) to 3 significant
    digits, None as ``-``, anything else as its text (an odd value must not end a run at its display)."""
    n = as_number(value)
    if n is not None:
        return f"{n:.3g}"
    return "-" if value is None else str(value)


def _json_number(n: int | float) -> int | float | None:
    return n if not isinstance(n, float) or math.isfinite(n) else None  # NaN / inf are not JSON: null


def _json_default(value: Any) -> Any:
    """What ``json`` writes for a value it cannot take: the number a numpy scalar or 0-d tensor holds,
    an array's nested list, else its ``str`` (one odd metric must not end a run at its log line)."""
    n = as_number(value)
    if n is not None:
        return _json_number(n)
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    return str(value)


class JSONLSink:
    """Appends one JSON object per step to a file (flushed each line: nothing lost on a crash).

    Numbers of any kind (Python, numpy scalars, 0-d tensors) are written as JSON numbers, and
    non-finite ones (NaN, inf) as ``null``."""

    def __init__(self, path: str | os.PathLike, mode: str = "a"):
        if mode not in ("a", "w"):
            raise ValueError(f"JSONLSink mode must be 'a' (append) or 'w' (overwrite), got {mode!r}")
        if os.path.isdir(path):
            raise ValueError(f"JSONLSink path {os.fspath(path)!r} is a folder; give a file path such as "
                             f"{os.path.join(os.fspath(path), 'metrics.jsonl')!r}")
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        self.path = os.fspath(path)
        self._f = open(self.path, mode, encoding="utf-8")

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if self._f.closed:
            raise ValueError(f"JSONLSink({self.path!r}) was closed; make a new one (mode='a' appends) to log more steps")
        row = {"step": step}
        for k, v in metrics.items():
            n = as_number(v)
            row[k] = v if n is None else _json_number(n)
        self._f.write(json.dumps(row, default=_json_default) + "\n")
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
