"""TrainState: everything a run needs to continue, as one immutable value with donation.

``update(state, batch)`` *donates* its input (as JAX's ``donate_argnums``): parameters and
optimizer moments are updated in place for memory, and the old handle refuses further use with
a clear error instead of silently aliasing the new state. Purity is honest, not pretended.

Randomness is explicit and derived: the sampling key of step ``s`` is ``fold_in(seed, s)``, so
``(seed, step)`` is the whole RNG state and a resumed run samples exactly what an uninterrupted
one would.
"""
from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch
from torch import nn

from rlkit.optim import OptimizerSpec


class DonatedStateError(RuntimeError):
    """A TrainState was used after it was donated to ``update``."""


@dataclass
class _Donation:
    donated: bool = False
    by: str = ""


_INTERNAL = {"_donation", "_cache", "replace", "donate", "is_donated", "_check"}


@dataclass(frozen=True, eq=False)
class TrainState:
    """The training state of one run (models, optimizers, schedules, counters, keys).

    Fields:
    - ``actor``: the policy, a causal LM (possibly FSDP-sharded after lowering).
    - ``optimizer`` / ``scheduler``: the actor's AdamW and LR schedule.
    - ``tokenizer``: tokenizer of the actor (token in, token out; used to decode for rewards).
    - ``ref``: frozen reference policy for KL, or None.
    - ``critic`` / ``critic_optimizer`` / ``critic_scheduler``: value model for PPO, or None.
    - ``step``: number of completed ``update`` calls; ``policy_version``: version of the actor's
      weights (bumped by every optimizer step, stamped on every rollout row).
    - ``seed``: root of every random key (see :func:`fold_in`).
    - ``data_position``: how many prompt batches the data loader has consumed (for resume).
    - ``extras``: small picklable values recipes carry between steps (e.g. an adaptive KL
      controller); saved in checkpoints.
    """

    actor: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    tokenizer: Any = None
    ref: nn.Module | None = None
    critic: nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: Any = None
    step: int = 0
    policy_version: int = 0
    seed: int = 0
    data_position: int = 0
    extras: Mapping[str, Any] = field(default_factory=dict)
    optimizer_spec: OptimizerSpec | None = None
    # caches that follow the state through replace() but are not part of its value:
    # the rollout engine (KV-cache buffers), the data-parallel context set by lowering.
    _cache: dict = field(default_factory=dict, repr=False)
    _donation: _Donation = field(default_factory=_Donation, repr=False)

    def __getattribute__(self, name: str):
        if not name.startswith("__") and name not in _INTERNAL:
            donation = object.__getattribute__(self, "_donation")
            if donation.donated:
                raise DonatedStateError(
                    f"this TrainState was donated to {donation.by} and can no longer be used "
                    f"(its parameters were updated in place). Use the state that call returned: "
                    f"`state, metrics = rk.update(state, batch)`."
                )
        return object.__getattribute__(self, name)

    def _check(self) -> None:
        self.step  # noqa: B018 - raises if donated

    @property
    def is_donated(self) -> bool:
        return object.__getattribute__(self, "_donation").donated

    def replace(self, **changes) -> "TrainState":
        """A new state with ``changes`` (Flax-style); caches follow, donation does not."""
        self._check()
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"TrainState has no field(s) {sorted(unknown)}; fields: {[f.name for f in fields(self) if not f.name.startswith('_')]}")
        values = {f.name: object.__getattribute__(self, f.name) for f in fields(self) if f.name != "_donation"}
        values.update(changes)
        return TrainState(**values)

    def donate(self, by: str) -> None:
        """Mark this handle as consumed by ``by`` (called by ``update``)."""
        donation = object.__getattribute__(self, "_donation")
        donation.donated = True
        donation.by = by

    # convenience -----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.actor.parameters()).device

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def rng(self, *path: int | str, device: torch.device | str | None = None) -> torch.Generator:
        """A fresh generator keyed by ``(seed, step, *path)``: deterministic and resumable."""
        return generator(fold_in(self.seed, self.step, *path), device=device or self.device)


def fold_in(seed: int, *path: int | str) -> int:
    """Derive a 63-bit key from a root seed and a path (JAX's ``fold_in``, by hashing)."""
    h = hashlib.blake2b(repr((int(seed),) + tuple(path)).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def _checked_device(device: torch.device | str) -> torch.device:
    """``device`` as a torch.device, or an error saying what this machine has (torch's own are an
    AssertionError, "Torch not compiled with CUDA enabled", or a list of every device type)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but this torch ({torch.__version__}) sees no CUDA GPU; "
                             "use device='cpu', or install a CUDA build of torch on a machine with a GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}, but only {torch.cuda.device_count()} CUDA GPU(s) are visible "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}); check CUDA_VISIBLE_DEVICES")
    return dev


def generator(key: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(key))
    return g


def init(
    model: nn.Module,
    optimizer: OptimizerSpec | None = None,
    *,
    tokenizer: Any = None,
    ref: nn.Module | str | None = None,
    critic: nn.Module | None = None,
    critic_optimizer: OptimizerSpec | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    compile: bool | str = "auto",
) -> TrainState:
    """Make the initial TrainState.

    - ``model``: the actor (a Hugging Face causal LM). ``tokenizer`` defaults to
      ``model.rlkit_tokenizer`` when the model was built by :func:`rlkit.models.tiny`.
    - ``ref="copy"`` freezes a deep copy of the actor as the KL reference.
    - ``critic``: a value model (``rlkit.models.critic(model)``) for PPO; trained with
      ``critic_optimizer`` (defaults to the actor's spec).
    - ``compile``: ``torch.compile`` the decoder blocks of actor, reference and critic in place
      (:mod:`rlkit.models.compile`); ``"auto"`` (default) does it on CUDA when Triton is
      importable and the model has at least 20M parameters
      (``rlkit.models.compile.AUTO_MIN_PARAMS``: below that, compiling pays back slowly or
      never), never on CPU. A compiler failure falls back to eager mode with a warning.
    """
    from rlkit.optim import adamw

    spec = optimizer or adamw()
    if not isinstance(spec, OptimizerSpec):
        raise TypeError(f"optimizer must be an rlkit OptimizerSpec (e.g. rk.optim.adamw(lr=1e-5)), got {type(spec).__name__}")
    if device is not None:
        model = model.to(_checked_device(device))
    if tokenizer is None:
        tokenizer = getattr(model, "rlkit_tokenizer", None)
    if isinstance(ref, str):
        if ref != "copy":
            raise ValueError(f"ref must be a model, None or 'copy', got {ref!r}")
        ref = copy.deepcopy(model)
    if ref is not None:
        ref = ref.to(next(model.parameters()).device).eval().requires_grad_(False)
    opt, sched = spec.build(model.parameters())
    c_opt = c_sched = None
    if critic is not None:
        critic = critic.to(next(model.parameters()).device)
        c_opt, c_sched = (critic_optimizer or spec).build(critic.parameters())
    from rlkit.models.compile import maybe_compile

    for module in (model, ref, critic):
        maybe_compile(module, compile)
    torch.manual_seed(fold_in(seed, "init"))
    return TrainState(
        actor=model,
        optimizer=opt,
        scheduler=sched,
        tokenizer=tokenizer,
        ref=ref,
        critic=critic,
        critic_optimizer=c_opt,
        critic_scheduler=c_sched,
        seed=seed,
        optimizer_spec=spec,
    )
