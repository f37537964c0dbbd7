"""Optimizer specs: a frozen description that builds (optimizer, LR schedule) for parameters.

``rk.optim.adamw(lr=3e-4, warmup_steps=10, total_steps=200, schedule="cosine")`` is a value you
can print, compare and store in a config; ``spec.build(params)`` makes the torch objects, which
live in the TrainState so a checkpoint saves them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, asdict
from typing import Iterable

import torch

SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class OptimizerSpec:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_steps: int = 0
    total_steps: int | None = None
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    fused: bool | None = None

    def __post_init__(self):
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"optimizer lr must be a positive finite number, got {self.lr!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown LR schedule {self.schedule!r}; valid: {', '.join(SCHEDULES)}")
        if self.schedule != "constant" and not self.total_steps:
            raise ValueError(f"schedule={self.schedule!r} needs total_steps (the step count the schedule decays over)")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` (0-based): linear warmup, then decay."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.schedule == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay

    def build(self, params: Iterable[torch.nn.Parameter]):
        params = [p for p in params if p.requires_grad]
        kwargs = dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        if self.fused is not None:
            kwargs["fused"] = self.fused
        elif params and all(p.is_cuda and p.is_floating_point() for p in params):
            # one kernel per parameter group instead of foreach's several (same arithmetic)
            kwargs["fused"] = True
        elif params and all(p.device.type == "cpu" and type(p.data) is torch.Tensor and p.is_floating_point() for p in params):
            # torch's CPU default is a Python loop over parameters; the fused CPU kernel makes one
            # pass over each parameter and its moments: 1.27 against 3.30 ms per step for foreach
            # on parameters shaped like benchmarks/grpo_step.py's CPU preset (twelfth session,
            # benchmarks/HISTORY.md). It equals the loop up to float rounding (tests/test_state.py).
            kwargs["fused"] = True
        optimizer = torch.optim.AdamW(params, **kwargs)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor)
        return optimizer, scheduler

    def to_dict(self) -> dict:
        return asdict(self)


def adamw(lr: float = 1e-6, **kwargs) -> OptimizerSpec:
    """AdamW with optional linear warmup and cosine/linear decay (verl's actor defaults: lr 1e-6, wd 0.01)."""
    return OptimizerSpec(lr=lr, **kwargs)
