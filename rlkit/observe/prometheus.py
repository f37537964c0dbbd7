"""Prometheus sink (opt-in): exposes every metric as a gauge on ``/metrics``.

Uses ``prometheus-client`` (``pip install 'rlkit[metrics]'``), imported only when built.

``PrometheusSink(port=9400)`` serves ``http://127.0.0.1:9400/metrics`` from a background thread;
``port=0`` takes a free port (``sink.port`` says which). ``close()`` stops the server and frees
the port (``rk.fit`` leaves its sinks open, so that one sink can watch several calls), so that a
notebook cell that builds the sink again does not fail with "address already in use"; on a
shared ``registry=`` (``prometheus_client.REGISTRY``), the new sink takes over the gauges an
earlier one registered there.

Metric names are ``{prefix}_{key}`` with every character outside ``[a-zA-Z0-9_]`` replaced by
``_`` (``reward/mean`` -> ``rlkit_reward_mean``); numbers of any kind (numpy scalars, 0-d tensors)
are exported as floats, non-numeric values (text, the ``samples`` table of a recipe's ``log_samples``) are
skipped. ``{prefix}_step`` is the step count given
to ``on_step``; a metric named ``step`` is not exported (the step count
has that name). Two keys that give one name (``reward/mean``, ``reward_mean``) would overwrite each
other's gauge: the first keeps the name, and the later one is skipped with a warning that names
both (rename one to export it).
"""
from __future__ import annotations

import re
import warnings

from rlkit._checks import int_at_least
from rlkit.observe.sinks import _metric_items, as_number

_STEP = object()  # the owner of the {prefix}_step name: the step count, which no metric may overwrite


class PrometheusSink:
    def __init__(self, port: int = 9400, addr: str = "127.0.0.1", prefix: str = "rlkit", registry=None, start_server: bool = True):
        int_at_least(port, "PrometheusSink: port", 0, " (0: a free one)")
        if port > 65535:
            raise ValueError(f"PrometheusSink: port must be at most 65535 (0: a free one), got {port!r}")
        try:
            import prometheus_client as pc
        except ImportError as exc:
            raise ImportError("PrometheusSink needs prometheus-client: pip install 'rlkit[metrics]'") from exc
        self._pc = pc
        self.registry = registry or pc.CollectorRegistry()
        self.prefix = prefix
        self._gauges: dict[str, object] = {}
        self._owners: dict[str, object] = {self._name("step"): _STEP}  # exported name -> the key that has it
        self._skipped: set[str] = set()  # keys already warned about
        self._server = self._thread = None
        self.port: int | None = None
        if start_server:
            try:
                self._server, self._thread = pc.start_http_server(port, addr=addr, registry=self.registry)
            except OSError as exc:
                raise OSError(
                    f"PrometheusSink: cannot serve metrics on {addr}:{port} ({exc}); pass another port, or port=0 "
                    "for a free one (sink.port then says which), or close() the sink that holds it"
                ) from exc
            self.port = self._server.server_address[1]

    def _name(self, key: str) -> str:
        # the prefix too: prometheus-client would otherwise rewrite it only on output, after the
        # collision check below
        return re.sub(r"[^a-zA-Z0-9_]", "_", f"{self.prefix}_{key}")

    def _gauge(self, name: str, help_key: str):
        if name not in self._gauges:
            try:
                self._gauges[name] = self._pc.Gauge(name, f"rlkit metric {help_key}", registry=self.registry)
            except ValueError as exc:
                # the registry has this name already: an earlier sink on a shared registry (a notebook
                # cell run again with registry=prometheus_client.REGISTRY). Its gauge goes on; a
                # collector of another kind under that name is the caller's, and stays
                existing = getattr(self.registry, "_names_to_collectors", {}).get(name)
                if not isinstance(existing, self._pc.Gauge):
                    raise ValueError(f"PrometheusSink: the registry already has a collector named {name} that is not "
                                     f"an rlkit gauge; pass another prefix= (now {self.prefix!r})") from exc
                self._gauges[name] = existing
        return self._gauges[name]

    def _metric_gauge(self, key: str):
        """The gauge of metric ``key``, or None (warned about once) when another key has its name."""
        name = self._name(key)
        owner = self._owners.setdefault(name, key)
        if owner == key:
            return self._gauge(name, key)
        if key not in self._skipped:
            self._skipped.add(key)
            other = "the step count" if owner is _STEP else f"metric {owner!r}"
            warnings.warn(f"PrometheusSink: metric {key!r} maps to {name}, which {other} already has; {key!r} is "
                          "not exported (rename one of them)", RuntimeWarning, stacklevel=3)
        return None

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self._gauge(self._name("step"), "step").set(step)
        for k, v in _metric_items(metrics):
            n = as_number(v)
            gauge = None if n is None else self._metric_gauge(k)
            if gauge is not None:
                gauge.set(float(n))

    def close(self) -> None:
        """Stop the HTTP server (if this sink started one) and free its port; the gauges stay readable
        through ``sink.registry``."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None
