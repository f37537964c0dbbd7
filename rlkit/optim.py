"""Optimizer specs: a frozen description that builds (optimizer, LR schedule) for parameters.

``rk.optim.adamw(lr=3e-4, warmup_steps=10, total_steps=200, schedule="cosine")`` is a value you
can print, compare and store in a config; ``spec.build(model)`` makes the torch objects, which
live in the TrainState so a checkpoint saves them.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, asdict
from typing import Iterable

import torch

from rlkit._checks import is_int, is_real

SCHEDULES = ("constant", "cosine", "linear")

#: ``no_decay`` patterns for the usual exclusion (biases and normalisation weights, as transformers'
#: Trainer, and therefore TRL, leave out of weight decay): ``rk.optim.adamw(no_decay=rk.optim.NORMS_AND_BIASES)``
NORMS_AND_BIASES = ("*bias", "*norm*.weight", "*ln_*.weight")


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW settings and the LR schedule (:meth:`lr_factor`). Checked on construction:
    ``lr`` a finite number > 0; ``eps`` a finite number > 0; ``weight_decay`` a finite number >= 0; ``betas`` two
    numbers in [0, 1); ``warmup_steps`` an int >= 0; ``total_steps`` None or an int >= 1, required
    by the decaying schedules ("cosine", "linear"), which also need ``warmup_steps <=
    total_steps``; ``min_lr_ratio`` in [0, 1]; ``fused`` a bool or None (rlkit picks).

    ``warmup_steps`` and ``total_steps`` count optimizer steps: an update takes one per mini-batch
    and epoch, so a recipe with ``mini_batch_size`` or ``epochs`` takes several per ``rk.fit`` step
    (``rk.fit`` warns when a decaying schedule would end before its run does).

    ``no_decay``: shell-style patterns (``fnmatch``) over parameter names as
    ``model.named_parameters()`` gives them; the parameters they match get no weight decay (a second
    parameter group with ``weight_decay=0``). Empty (the default, as verl): every parameter decays.
    :data:`NORMS_AND_BIASES` is the usual choice. Patterns that together match no parameter are
    an error (a typo would otherwise decay what it meant to exclude); one of several may match
    nothing (a model without biases, say).

    ``master_weights``: step float32 copies of the bf16/fp16 parameters (:class:`MasterWeightAdamW`;
    the copies and the moments are float32 and live in the optimizer's state, so checkpoints keep
    them) and write the result back rounded to the parameter's dtype. In bf16 a parameter of
    magnitude 0.02 moves only by steps of at least 6e-5, so at lr 1e-6 plain AdamW on bf16
    weights changes about 2% of them (``rk.state.movable_fraction``); with master weights the small
    steps accumulate. None (default): on when a trained parameter is bf16/fp16 and the parameters
    are plain tensors (FSDP's mixed precision keeps float32 shards itself: give it a float32
    model); True: required (an error for FSDP-sharded parameters); False: off, as TRL and plain
    AdamW (half the optimizer memory)."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_steps: int = 0
    total_steps: int | None = None
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    fused: bool | None = None
    no_decay: tuple[str, ...] = ()
    master_weights: bool | None = None

    def __post_init__(self):
        # types first: a YAML "1e-3" is a string, and a fractional warmup (0.1 * steps) made the
        # warmup factor (step + 1) / warmup_steps overshoot 1 (lr x 1.33 at warmup_steps=1.5)
        for name in ("lr", "eps", "weight_decay", "min_lr_ratio"):
            value = getattr(self, name)
            if not is_real(value):
                raise ValueError(f"optimizer {name} must be a number, got {type(value).__name__} {value!r}"
                                 + (" (convert it with float(...))" if isinstance(value, str) else ""))
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"optimizer lr must be a positive finite number, got {self.lr!r}")
        if not 0 < self.eps < math.inf:
            # AdamW divides by sqrt(v) + eps: a gradient element that is exactly zero (the embedding
            # row of a token not in the batch) made 0/0, a NaN weight that surfaced steps later
            raise ValueError(f"optimizer eps must be a finite number > 0 (AdamW's denominator term; 0 makes 0/0 = NaN "
                             f"weights wherever a gradient is exactly zero), got {self.eps!r}; the usual value is 1e-8")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"optimizer weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if (not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2
                or not all(is_real(b) and 0 <= b < 1 for b in self.betas)):
            raise ValueError(f"optimizer betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown LR schedule {self.schedule!r}; valid: {', '.join(SCHEDULES)}")
        if not is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0 (a count of optimizer steps; round a fraction of "
                             f"total_steps with int(...)), got {type(self.warmup_steps).__name__} {self.warmup_steps!r}")
        if self.total_steps is not None and (not is_int(self.total_steps) or self.total_steps < 1):
            raise ValueError(f"total_steps must be an int >= 1 or None (no schedule length), got "
                             f"{type(self.total_steps).__name__} {self.total_steps!r}")
        if self.schedule != "constant":
            if self.total_steps is None:
                raise ValueError(f"schedule={self.schedule!r} needs total_steps (the step count the schedule decays over)")
            if self.warmup_steps > self.total_steps:
                raise ValueError(
                    f"warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}: schedule={self.schedule!r} "
                    f"would never decay; use warmup_steps=min(warmup_steps, total_steps) or fewer warmup steps"
                )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.fused is not None and not isinstance(self.fused, bool):
            raise ValueError(f"fused must be True, False or None (rlkit picks), got {self.fused!r}")
        no_decay = self.no_decay
        if isinstance(no_decay, str) or not isinstance(no_decay, (tuple, list)) or not all(isinstance(p, str) and p for p in no_decay):
            raise ValueError(f"no_decay must be a tuple of name patterns such as ('*bias', '*norm*.weight'), got {no_decay!r}"
                             + (f" (one pattern: no_decay=({no_decay!r},))" if isinstance(no_decay, str) else ""))
        object.__setattr__(self, "no_decay", tuple(no_decay))  # a list from a config file: hashable, comparable
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if self.master_weights is not None and not isinstance(self.master_weights, bool):
            raise ValueError(f"master_weights must be True, False or None (on for bf16/fp16 parameters), got {self.master_weights!r}")

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

    def build(self, params: torch.nn.Module | Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]]):
        """``(optimizer, scheduler)`` for a model (or its ``named_parameters()``, or, without
        ``no_decay``, its ``parameters()``); parameters that do not require grad are left out."""
        named = _named(params, bool(self.no_decay))
        named = [(name, p) for name, p in named if p.requires_grad]
        params = [p for _, p in named]
        kwargs = dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        if self.fused is not None:
            kwargs["fused"] = self.fused
        elif params and all(p.is_cuda and p.is_floating_point() for p in params):
            # one kernel per parameter group instead of foreach's several (same arithmetic)
            kwargs["fused"] = True
        elif params and all(p.device.type == "cpu" and p.is_floating_point() for p in params):
            # torch's CPU default is a Python loop over parameters; the fused CPU kernel makes one
            # pass over each parameter and its moments: 1.27 against 3.30 ms per step for foreach
            # on parameters shaped like benchmarks/grpo_step.py's CPU preset (twelfth session,
            # benchmarks/HISTORY.md). It equals the loop up to float rounding (tests/test_state.py).
            # FSDP2's CPU shards (DTensor) too: the loop computes a float16 shard's step in float16,
            # where eps=1e-8 is 0 (the first step was inf/NaN), the fused kernel in float32 as it does
            # for one process's float16 weights; and the shards then step as one process's weights do
            kwargs["fused"] = True
        optimizer_class = MasterWeightAdamW if self._wants_master(params) else torch.optim.AdamW
        optimizer = optimizer_class(self._groups(named), **kwargs)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor)
        return optimizer, scheduler

    def _wants_master(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether :meth:`build` steps float32 master copies (see ``master_weights``)."""
        if self.master_weights is False or not any(p.dtype in LOW_PRECISION for p in params):
            return False
        sharded = any(type(p.data) is not torch.Tensor for p in params)  # FSDP2's DTensor
        if sharded:
            if self.master_weights:
                raise ValueError(
                    "optimizer master_weights=True, but the parameters are FSDP-sharded (DTensor): FSDP's mixed precision "
                    "keeps float32 shards and computes in bf16 itself. Give Pipeline.lower a float32 model (with "
                    "mixed_precision=True, the default on GPUs) and leave master_weights at None"
                )
            return False
        return True

    def _groups(self, named: list[tuple[str, torch.nn.Parameter]]) -> list:
        """The parameters as AdamW groups: all in one, or the decayed ones and those ``no_decay``
        matches (``weight_decay=0``), each group only if it has parameters."""
        if not self.no_decay:
            return [p for _, p in named]
        excluded = {name for name, _ in named if any(fnmatch.fnmatchcase(name, pat) for pat in self.no_decay)}
        if not excluded and named:
            sample = ", ".join(name for name, _ in named[:4])
            raise ValueError(f"optimizer no_decay={self.no_decay} matches no trained parameter (names look like: {sample}, ...); "
                             f"fix the patterns (fnmatch-style, e.g. '*bias', '*norm*.weight') or drop no_decay")
        decayed = [p for name, p in named if name not in excluded]
        plain = [p for name, p in named if name in excluded]
        return ([{"params": decayed}] if decayed else []) + ([{"params": plain, "weight_decay": 0.0}] if plain else [])

    def to_dict(self) -> dict:
        return asdict(self)


#: parameter dtypes whose updates :class:`MasterWeightAdamW` accumulates in float32
LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW that steps a float32 master copy of every bf16/fp16 parameter.

    Each step casts the parameter's gradient to float32, runs AdamW (torch's own, fused or not) on
    the master copy, whose moments are float32 too, and writes the master rounded to the
    parameter's dtype back into the parameter's own storage, so the model, compiled graphs and
    engines that hold its tensors see the new weights in place. The master copy is the state's
    ``"master"`` entry: ``state_dict()`` and rlkit's checkpoints save it, and
    :meth:`load_state_dict` keeps it and the moments in float32 (torch casts floating state to the
    parameter's dtype). float32 parameters are stepped as plain AdamW does. A parameter's first
    step takes its master from the parameter itself, and every step first re-takes it from the
    parameter wherever the two differ (the weights were changed outside the optimizer: loaded,
    warmed up by SFT, rolled back), so such a change is kept, not overwritten by a stale copy.

    On the GPU benchmark's 0.5B-parameter model the master copy and float32 moments add 4 GB to
    plain AdamW's 2 GB of bf16 moments; the extra work per step is a few element-wise passes."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        swapped = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.dtype not in LOW_PRECISION:
                    continue
                master = self.state[p].get("master")
                if master is None:
                    # stored after the step: AdamW initialises a parameter's state only while it is empty
                    master = p.detach().to(torch.float32, copy=True)
                else:
                    # weights changed outside the optimizer since its last step (load_state_dict, an SFT
                    # warm-up, a rollback, a master of another run): where the parameter no longer equals
                    # its master rounded, the parameter is the truth. Element-wise, without a host sync
                    low_now = p.detach()
                    master.copy_(torch.where(master.to(p.dtype) == low_now, master, low_now.to(torch.float32)))
                low, grad = p.data, p.grad
                p.grad = None  # a gradient must match its parameter's dtype while it is assigned
                p.data = master
                p.grad = grad.to(torch.float32)
                swapped.append((p, low, grad))
        try:
            super().step()
        finally:
            for p, low, grad in swapped:
                master = p.data
                self.state[p]["master"] = master
                p.grad = None
                low.copy_(master)  # rounded to the parameter's dtype, in its own storage
                p.data = low
                p.grad = grad
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the master copies and moments of bf16/fp16 parameters stay float32 (torch
        casts every floating state tensor to its parameter's dtype, which would round the master
        copy to the very precision it exists to avoid)."""
        super().load_state_dict(state_dict)
        by_id = {}
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            by_id.update(zip(saved_group["params"], group["params"]))
        for param_id, values in state_dict["state"].items():
            p = by_id.get(param_id)
            if p is None or p.dtype not in LOW_PRECISION:
                continue
            state = self.state[p]
            for key, value in values.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    state[key] = value.to(device=p.device, dtype=torch.float32)


def _named(params, need_names: bool) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` pairs from a module, named pairs or bare parameters (named by
    position, which ``no_decay`` cannot match: refused when it is set)."""
    if isinstance(params, torch.nn.Module):
        return list(params.named_parameters())
    items = list(params)
    if all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in items):
        return items
    if need_names:
        raise ValueError("the optimizer spec has no_decay patterns, which match parameter names, but build() got bare "
                         "parameters; pass the model (spec.build(model)) or model.named_parameters()")
    return [(str(i), p) for i, p in enumerate(items)]


def adamw(lr: float = 1e-6, **kwargs) -> OptimizerSpec:
    """AdamW with optional linear warmup and cosine/linear decay (verl's actor defaults: lr 1e-6, wd 0.01,
    every parameter decayed; ``no_decay=rk.optim.NORMS_AND_BIASES`` leaves biases and norm weights
    out, as transformers' Trainer does). Keywords: the fields of :class:`OptimizerSpec`."""
    return OptimizerSpec(lr=lr, **kwargs)
