"""Prometheus sink (opt-in): exposes every metric as a gauge on ``/metrics``.

Uses ``prometheus-client`` (``pip install 'rlkit[metrics]'``), imported only when built.

``PrometheusSink(port=9400)`` serves ``http://127.0.0.1:9400/metrics`` from a background thread;
``port=0`` takes a free port (``sink.port`` says which). ``close()`` stops the server and frees
the port (``rk.fit`` leaves its sinks open, so that one sink can watch several calls), so that a
notebook cell that builds the sink again does not fail with "address already in use".

Metric names are ``{prefix}_{key}`` with every character outside ``[a-zA-Z0-9_]`` replaced by
``_`` (``reward/mean`` -> ``rlkit_reward_mean``); non-numeric values are skipped.
"""
from __future__ import annotations

import re


class PrometheusSink:
    def __init__(self, port: int = 9400, addr: str = "127.0.0.1", prefix: str = "rlkit", registry=None, start_server: bool = True):
        try:
            import prometheus_client as pc
        except ImportError as exc:
            raise ImportError("PrometheusSink needs prometheus-client: pip install 'rlkit[metrics]'") from exc
        self._pc = pc
        self.registry = registry or pc.CollectorRegistry()
        self.prefix = prefix
        self._gauges: dict[str, object] = {}
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

    def _gauge(self, key: str):
        name = f"{self.prefix}_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
        if name not in self._gauges:
            self._gauges[name] = self._pc.Gauge(name, f"rlkit metric {key}", registry=self.registry)
        return self._gauges[name]

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self._gauge("step").set(step)
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self._gauge(k).set(float(v))

    def close(self) -> None:
        """Stop the HTTP server (if this sink started one) and free its port; the gauges stay readable
        through ``sink.registry``."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None
