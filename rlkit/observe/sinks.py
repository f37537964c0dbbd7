"""Metric sinks. Transforms return metrics; sinks subscribe to them (a pure function never logs).

A sink is any object with ``on_step(step: int, metrics: dict)`` and optionally ``close()`` and
``rewind(step: int)``: ``rk.fit`` calls ``rewind(state.step)`` when it starts from a state past step 0
(a resumed run), and a sink that keeps what it logged drops the rows of later steps, which the run
is about to log again (a run killed after step 3 and resumed from its step-2 checkpoint logged step
3 twice). Only the latest run's rows go: an earlier run logged to the same sink (its steps start
over) keeps all of its rows. A sink may also have ``on_end(step: int)``: ``rk.fit`` calls it once
the run stops (finished, or stopped by an exception, which still leaves ``fit``), with the last
step done: a sink that shows the run only at some steps (the notebook dashboard, every ``every``
steps) draws its last one then, which no ``on_step`` says is the last.

The step is the ``step`` argument: a metric named ``"step"`` is not
logged as a metric, and never replaces it.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import tempfile
from typing import Any, Iterable, Protocol


class Sink(Protocol):
    def on_step(self, step: int, metrics: dict[str, float]) -> None: ...


def as_sinks(sinks: Any, where: str) -> list:
    """``sinks`` as a list: None, one sink (anything with ``on_step``) or an iterable of them; a
    ``TypeError`` names ``where`` and the sink without an ``on_step(step, metrics)`` method."""
    if sinks is None:
        return []
    if hasattr(sinks, "on_step"):  # one sink
        return [sinks]
    if not isinstance(sinks, Iterable) or isinstance(sinks, (str, bytes)):
        raise TypeError(f"{where}: sinks must be a sink (with on_step(step, metrics)) or a list of them, got {sinks!r:.80}")
    sinks = list(sinks)
    for sink in sinks:
        if not callable(getattr(sink, "on_step", None)):
            raise TypeError(f"{where}: every sink needs an on_step(step, metrics) method; {sink!r} has none "
                            "(rk.observe has ConsoleSink, JSONLSink, ListSink, ...)")
    return sinks


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
    digits, None as ``-``, a table (:func:`table_rows`: the ``samples`` metric) as its row count
    (``<2 rows>``: its texts would flood a one-line display), anything else as its text (an odd
    value must not end a run at its display)."""
    n = as_number(value)
    if n is not None:
        return f"{n:.3g}"
    rows = table_rows(value)
    if rows is not None:
        return f"<{len(rows)} row{'s' if len(rows) != 1 else ''}>"
    return "-" if value is None else str(value)


def table_rows(value: Any) -> list[dict] | None:
    """``value`` as the rows of a table, when it is a non-empty list (or tuple) of dicts (the
    ``samples`` metric :func:`samples` builds, or a user's own); else None. Sinks that can show a
    table (the notebook dashboard, wandb, the console's samples table) take such a metric as one;
    the others keep it as JSON (:class:`JSONLSink`, :class:`ListSink`) or skip it (Prometheus)."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(row, dict) for row in value):
        return list(value)
    return None


def table_columns(rows: Iterable[dict]) -> list[str]:
    """The keys of ``rows``, in order of first appearance: a table's columns (``prompt``,
    ``response``, ``reward``, ``advantage`` for :func:`samples`)."""
    return list(dict.fromkeys(str(k) for row in rows for k in row))


def clip_text(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters, the cut marked with ``…``: for display
    only (the data a sink keeps is never clipped)."""
    return text if len(text) <= max_chars else text[: max(0, max_chars - 1)] + "…"


def samples(batch, k: int = 4, tokenizer=None) -> list[dict[str, Any]]:
    """Up to ``k`` rows of a scored Batch as plain JSON-able dicts, to see what the model writes:
    ``{"prompt": str, "response": str, "reward": float}``, plus ``"advantage"`` (the row's mean
    advantage over its response tokens, None for an empty response) where the batch has
    ``advantages``. TRL's ``log_completions`` / ``num_completions_to_print`` show the same; a
    recipe's ``log_samples=k`` puts this list in each step's metrics as ``"samples"``.

    The rows come from different prompts: the first sample of each of the first ``k`` groups
    (``batch["group"]``, in order of first appearance), then the second sample of each, and so on,
    so that a batch of fewer than ``k`` prompts still gives ``k`` rows. The choice depends only on
    the batch (no random draw): a rerun shows the same rows.

    The texts are the batch's ``prompt_text`` / ``response_text`` columns, else the rows' ids decoded
    with ``tokenizer`` and ``skip_special_tokens=True`` (what ``rk.score`` gave the rewards); only
    the ``k`` rows shown are decoded. Nothing is clipped: sinks clip long texts for display."""
    import torch

    from rlkit._checks import int_at_least
    from rlkit.batch import BatchError, column, row_tokens, validate

    int_at_least(k, "rk.observe.samples: k", 0, " (rows to show)")
    try:
        validate(batch, require=("response_ids", "response_mask", "rewards"))
    except BatchError as e:
        raise BatchError(f"rk.observe.samples: {e}") from None
    b = batch.batch_size[0]
    groups = batch["group"].tolist() if "group" in batch.keys() else list(range(b))
    first_seen: dict[Any, int] = {}
    taken: dict[Any, int] = {}
    order = []  # (sample's index within its group, its group's order, row)
    for row, g in enumerate(groups):
        first_seen.setdefault(g, len(first_seen))
        taken[g] = taken.get(g, 0) + 1
        order.append((taken[g] - 1, first_seen[g], row))
    rows = [row for *_, row in sorted(order)[:k]]
    if not rows:
        return []

    index = torch.tensor(rows, dtype=torch.long, device=batch["response_ids"].device)

    def texts(name: str, ids_field: str, mask_field: str) -> list[str]:
        if name in batch.keys():
            values = column(batch, name)
            return [v if isinstance(v, str) else _json_text(v) for v in (values[i] for i in rows)]
        if tokenizer is None:
            raise BatchError(f"rk.observe.samples: the batch has no {name!r} column and no tokenizer was given to decode "
                             f"{ids_field}; pass tokenizer= (state.tokenizer, or task.tokenizer), or set the column "
                             f"(rlkit.batch.set_column(batch, {name!r}, texts))")
        from rlkit.models.tokenizers import decode_batch

        return decode_batch(tokenizer, row_tokens(batch[ids_field][index], batch[mask_field][index]))

    prompts = texts("prompt_text", "prompt_ids", "prompt_mask")
    responses = texts("response_text", "response_ids", "response_mask")
    rewards = batch["rewards"][index].float().tolist()
    out = [{"prompt": p, "response": r, "reward": _json_number(w)} for p, r, w in zip(prompts, responses, rewards)]
    if "advantages" in batch.keys():
        mask = batch["response_mask"][index].float()
        means = ((batch["advantages"][index].float() * mask).sum(-1) / mask.sum(-1)).tolist()  # NaN (None) for an empty response
        for sample, mean in zip(out, means):
            sample["advantage"] = _json_number(mean)
    return out


def _json_text(value: Any) -> str:
    """A text column's non-string value (a chat conversation) as its JSON, else ``str``."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _json_number(n: int | float) -> int | float | None:
    return n if not isinstance(n, float) or math.isfinite(n) else None  # NaN / inf are not JSON: null


def _json_ready(value: Any) -> Any:
    """``value`` with every number a JSON number and every non-finite one ``null``, at any depth
    (lists, tuples, dicts, arrays): ``json.dumps`` writes NaN and Infinity inside them otherwise,
    which strict JSON readers (jq, JavaScript's JSON.parse) refuse."""
    if value is None or isinstance(value, (str, bool)):
        return value
    n = as_number(value)
    if n is not None:
        return _json_number(n)
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return _json_ready(tolist())
    return str(value)


def _metric_items(metrics: dict[str, Any]):
    """The metrics a sink logs next to its own step: all but one named ``"step"``."""
    return ((k, v) for k, v in metrics.items() if k != "step")


def step_row(step: Any, metrics: dict[str, Any]) -> dict[str, Any]:
    """A logged row: ``{"step": step, **metrics}`` where the step wins over a metric named
    ``"step"`` (as every sink keeps it; a metric of that name used to overwrite a history's step)."""
    return {"step": step, **dict(_metric_items(metrics))}


def _step_of(row: Any) -> float | None:
    """The step of a logged row (a dict), or None when it has no numeric step."""
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def _row_step(line: str) -> float | None:
    """The step of a JSONL row, or None when the line is not a row with a numeric step."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return _step_of(row)


def _rewound(rows: list, step: int, step_of=_step_of) -> list:
    """``rows`` without this run's rows of steps after ``step`` (a row whose ``step_of`` is None is
    kept). This run's rows are the trailing block whose steps never go down: an earlier run logged
    to the same sink (its steps restart below) keeps all of its rows. Every sink that keeps what it
    logged rewinds by this rule, so a metrics file and an in-memory history agree."""
    steps = [step_of(row) for row in rows]
    start, previous = 0, None
    for i, s_i in enumerate(steps):
        if s_i is not None:
            if previous is not None and s_i < previous:
                start = i
            previous = s_i
    return rows[:start] + [row for row, s_i in zip(rows[start:], steps[start:]) if s_i is None or s_i <= step]


class JSONLSink:
    """Appends one JSON object per step to a file (flushed each line: nothing lost on a crash).

    Each row is ``{"step": <int>, <metric>: <value>, ...}``. Numbers of any kind (Python, numpy
    scalars, 0-d tensors) are written as JSON numbers, and non-finite ones (NaN, inf) as ``null``,
    inside lists and dicts too (the file is strict JSON lines). Appending to a file whose last line
    a crash cut short drops that line first. :meth:`rewind` (called by ``rk.fit`` on a resumed run)
    drops this run's rows of steps after the one it resumes from, so that the file has each step
    once, in order; an earlier run's rows in the same file (its steps start over) are kept."""

    def __init__(self, path: str | os.PathLike, mode: str = "a"):
        if mode not in ("a", "w"):
            raise ValueError(f"JSONLSink mode must be 'a' (append) or 'w' (overwrite), got {mode!r}")
        if os.path.isdir(path):
            raise ValueError(f"JSONLSink path {os.fspath(path)!r} is a folder; give a file path such as "
                             f"{os.path.join(os.fspath(path), 'metrics.jsonl')!r}")
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        self.path = os.fspath(path)
        if mode == "a":
            _drop_torn_tail(self.path)  # else the first new row would be glued onto it, and unreadable
        self._f = open(self.path, mode, encoding="utf-8")

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if self._f.closed:
            raise ValueError(f"JSONLSink({self.path!r}) was closed; make a new one (mode='a' appends) to log more steps")
        row = {"step": _json_ready(step)}  # a numpy or tensor step (a loop over np.arange) as the int it holds
        for k, v in _metric_items(metrics):
            row[k] = _json_ready(v)
        self._f.write(json.dumps(row, allow_nan=False) + "\n")
        self._f.flush()

    def rewind(self, step: int) -> None:
        """Keep only this run's rows up to ``step`` (and lines that are not rows with a step, and an
        earlier run's rows: see the class); drop a last line cut short by a crash. The file is rewritten atomically, and only when a row goes."""
        if self._f.closed:
            raise ValueError(f"JSONLSink({self.path!r}) was closed; make a new one (mode='a' appends) to log more steps")
        self._f.flush()
        with open(self.path, encoding="utf-8") as f:
            lines = f.read().splitlines(keepends=True)
        torn = bool(lines) and not lines[-1].endswith("\n")  # a write a kill cut short: no row
        if torn:
            lines.pop()
        kept = _rewound(lines, step, _row_step)
        if len(kept) == len(lines) and not torn:
            return
        directory = os.path.dirname(self.path) or "."
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(self.path) + ".", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())
            self._f.close()
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        finally:
            if self._f.closed:
                self._f = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "JSONLSink":  # `with rk.observe.JSONLSink(path) as sink:` closes the file after
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drop_torn_tail(path: str) -> None:
    """Cut a last line that a crash left without its newline (a row half written: no row)."""
    try:
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            # back from the end, 1 MiB at a time, to the last newline: a torn row of samples with long
            # responses can be longer than one read (only the last 1 MiB was searched, and a longer torn
            # row stayed, glued to the next row written)
            end = size
            while end > 0:
                start = max(0, end - (1 << 20))
                f.seek(start)
                cut = f.read(end - start).rfind(b"\n")
                if cut >= 0:
                    f.truncate(start + cut + 1)
                    return
                end = start
            f.truncate(0)  # no newline at all: the file is one torn row
    except FileNotFoundError:
        return


class ListSink:
    """Keeps every step's metrics in memory (``sink.history``: ``{"step": step, **metrics}``)."""

    def __init__(self):
        self.history: list[dict[str, Any]] = []

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        # a numpy or tensor step (a loop over np.arange) as the int it holds, as JSONLSink keeps it:
        # kept as it came, rewind took it for a row without a step and dropped nothing
        self.history.append(step_row(_json_ready(step), metrics))

    def rewind(self, step: int) -> None:
        """Forget this run's rows of steps after ``step`` (the resumed run logs them again); an
        earlier run's rows (its steps start over) are kept, as :meth:`JSONLSink.rewind` keeps them."""
        self.history[:] = _rewound(self.history, step)


class CallbackSink:
    def __init__(self, fn):
        self.fn = fn

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.fn(step, metrics)


def broadcast(sinks: Iterable[Any], step: int, metrics: dict[str, float]) -> None:
    """``sink.on_step(step, metrics)`` on every sink, then the first exception one raised (Ctrl-C
    in a slow sink, a plot's redraw, used to leave the sinks after it without the step: a hole in
    the run's JSONL log once it went on from ``exc.state``). The exception gets a note naming the
    sink and the step (a sink's own error, a ``ConnectionError`` say, named neither)."""
    first: BaseException | None = None
    for sink in sinks:
        try:
            sink.on_step(step, metrics)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other sinks
            if first is None:
                first = exc
                if isinstance(exc, Exception) and hasattr(exc, "add_note"):
                    exc.add_note(f"raised by the sink {sink!r:.80} on step {step} (the other sinks got the step)")
    if first is not None:
        raise first


def rewind_all(sinks: Iterable[Any], step: int) -> None:
    """``sink.rewind(step)`` on the sinks that have it (see the module docstring)."""
    for sink in sinks:
        rewind = getattr(sink, "rewind", None)
        if callable(rewind):
            rewind(step)


def end_all(sinks: Iterable[Any], step: int) -> None:
    """``sink.on_end(step)`` on the sinks that have it (see the module docstring), then the first
    exception one raised, as :func:`broadcast` does: a failing sink does not keep the run's end from
    the others."""
    first: BaseException | None = None
    for sink in sinks:
        on_end = getattr(sink, "on_end", None)
        if not callable(on_end):
            continue
        try:
            on_end(step)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other sinks
            if first is None:
                first = exc
    if first is not None:
        raise first


def end_after_error(exc: BaseException, sinks: Iterable[Any], step: int, who: str) -> None:
    """:func:`end_all` for a run that ``exc`` stopped (the dashboard draws the step it stopped at):
    a sink failing there is a note on ``exc``, which stays the error the caller sees."""
    try:
        end_all(sinks, step)
    except BaseException as e:  # noqa: BLE001 - never mask the run's own exception
        if hasattr(exc, "add_note"):
            exc.add_note(f"{who}: a sink's on_end raised {type(e).__name__}: {e} (ignored: the run had already stopped)")


def close_all(sinks: Iterable[Any]) -> None:
    for sink in sinks:
        close = getattr(sink, "close", None)
        if close is not None:
            close()
