"""Weights & Biases sink; ``wandb`` is imported only when this sink is built.

Without a ``WANDB_API_KEY`` (or ``wandb login``) it runs offline and writes a local run you can
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
        mode = init_kwargs.pop("mode", None) or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=project, config=config or {}, mode=mode, **init_kwargs)

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        # commit now: by default wandb holds a step's values until the next step's arrive, and a
        # run that dies before then (or before close) would lose its last step
        # (the step is wandb's step: a metric named "step" would be a chart of its own)
        self.run.log(dict(_metric_items(metrics)), step=step, commit=True)

    def close(self) -> None:
        self.run.finish()
