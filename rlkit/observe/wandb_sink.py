"""Weights & Biases sink; ``wandb`` is imported only when this sink is built.

The mode is wandb's own where it is given: ``mode=`` to the sink, or ``WANDB_MODE`` (``disabled``
writes nothing, as in CI). Otherwise it runs online where wandb has a key (``WANDB_API_KEY``, or
the one ``wandb login`` stores in ``~/.netrc``), and offline without one: a local run you can
``wandb sync`` later.
"""
from __future__ import annotations

import os

from rlkit.observe.sinks import _metric_items


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

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        # commit now: by default wandb holds a step's values until the next step's arrive, and a
        # run that dies before then (or before close) would lose its last step
        # (the step is wandb's step: a metric named "step" would be a chart of its own)
        self.run.log(dict(_metric_items(metrics)), step=step, commit=True)

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
