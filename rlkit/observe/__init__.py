"""Metric sinks: console (rich), JSONL, notebook dashboard, wandb, Prometheus (opt-in).

The sinks that need optional packages live in submodules loaded on first use, so ``import rlkit``
never imports ipywidgets, matplotlib, wandb or prometheus-client: ``rk.observe.notebook.Dashboard``,
``rk.observe.console.ConsoleSink``, ``rk.observe.wandb_sink`` and ``rk.observe.prometheus``.

``rk.observe.samples(batch, k)`` is a few rows of a scored batch as ``{"prompt", "response",
"reward"}`` dicts (plus ``"advantage"`` where the batch has advantages): the ``samples`` metric a recipe's ``log_samples=k`` adds to each step, which
the dashboard, the console (``samples_every``) and wandb show as a table.
"""
import importlib

from rlkit.observe.sinks import CallbackSink, JSONLSink, ListSink, Sink, broadcast, close_all, rewind_all, samples, table_rows

__all__ = ["Sink", "JSONLSink", "ListSink", "CallbackSink", "broadcast", "close_all", "rewind_all", "samples", "table_rows"]

_SUBMODULES = ("console", "notebook", "prometheus", "wandb_sink")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"rlkit.observe.{name}")
    raise AttributeError(f"module 'rlkit.observe' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))  # the lazy submodules too, for Tab completion
