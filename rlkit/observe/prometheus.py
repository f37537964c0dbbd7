"""Prometheus sink (opt-in): exposes every metric as a gauge on ``/metrics``.

Uses ``prometheus-client`` (``pip install 'rlkit[metrics]'``), imported only when built.
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
        if start_server:
            pc.start_http_server(port, addr=addr, registry=self.registry)

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
