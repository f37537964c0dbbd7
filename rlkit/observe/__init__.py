"""Metric sinks: console (rich), JSONL, notebook dashboard, wandb, Prometheus (opt-in)."""
from rlkit.observe.sinks import CallbackSink, JSONLSink, ListSink, Sink, broadcast, close_all

__all__ = ["Sink", "JSONLSink", "ListSink", "CallbackSink", "broadcast", "close_all"]
