"""KL penalties between the policy and the frozen reference, and KL coefficient controllers.

Estimators of ``KL(pi || pi_ref)`` from sampled tokens (Schulman, "Approximating KL
Divergence", 2020, http://joschu.net/blog/kl-approx.html), as verl's ``kl_penalty``. With
``d = logp - logp_ref`` per token:

=======================  ==================================================  ===========================
name                     value                                               note
=======================  ==================================================  ===========================
``k1`` / ``kl``          ``d``                                               unbiased, high variance
``abs``                  ``|d|``
``k2`` / ``mse``         ``0.5 d^2``                                         its gradient is the
                                                                             unbiased KL gradient
``k3`` / ``low_var_kl``  ``clamp(exp(-d') + d' - 1, -10, 10)``,              unbiased, low variance
                         ``d' = clamp(d, -20, 20)``
``<name>+``              value of ``<name>``, gradient of ``k2``             straight-through
=======================  ==================================================  ===========================

The ``+`` variants: verl's docs (``kl_loss_type``: "appending '+' ... would apply straight
through to employ k2 for unbiased gradient estimation, regardless of the kl value estimation")
state the intent; verl's current code passes the suffixed name to ``kl_penalty_forward``,
which raises ``NotImplementedError``. We implement the documented intent:
``k2_d - sg[k2_d] + sg[base_d]``. ``k2+`` / ``mse+`` equal ``k2`` exactly.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Callable

import torch

from rlkit.algos.registry import Registry
from rlkit.algos.stats import masked_mean

__all__ = [
    "KL_PENALTIES",
    "kl_penalty",
    "straight_through",
    "apply_kl_to_rewards",
    "FixedKLController",
    "AdaptiveKLController",
]

KL_PENALTIES: Registry = Registry("KL penalty")


@KL_PENALTIES.register("k1", "kl")
def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k1 = logp - logp_ref`` per token (b t)."""
    return logprobs - ref_logprobs


@KL_PENALTIES.register("abs")
def abs_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``|logp - logp_ref|`` per token (b t)."""
    return (logprobs - ref_logprobs).abs()


@KL_PENALTIES.register("k2", "mse", "k2+", "mse+")
def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k2 = 0.5 (logp - logp_ref)^2`` per token (b t); its own straight-through variant."""
    return 0.5 * (logprobs - ref_logprobs).square()


@KL_PENALTIES.register("k3", "low_var_kl")
def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(x) - x - 1`` with ``x = clamp(logp_ref - logp, -20, 20)``, clamped to
    ``[-10, 10]`` (verl's ``low_var_kl``), per token (b t)."""
    x = torch.clamp(ref_logprobs - logprobs, min=-20, max=20)
    return torch.clamp(torch.exp(x) - x - 1, min=-10, max=10)


def straight_through(base: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    """Wrap a KL estimator: forward value of ``base``, gradient of ``k2`` (``d = logp - logp_ref``).

    Formula: ``k2(d) - sg[k2(d)] + sg[base(d)]``.
    """

    def fn(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
        backward = k2(logprobs, ref_logprobs)
        return backward - backward.detach() + base(logprobs, ref_logprobs).detach()

    fn.__name__ = fn.__qualname__ = f"{base.__name__}_straight_through"
    fn.__doc__ = f"Value of ``{base.__name__}``, gradient of ``k2`` (straight-through)."
    return fn


k1_st = KL_PENALTIES.register("k1+", "kl+")(straight_through(k1))
abs_st = KL_PENALTIES.register("abs+")(straight_through(abs_kl))
k3_st = KL_PENALTIES.register("k3+", "low_var_kl+")(straight_through(k3))


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mode: str | Callable = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate ``(b t)`` between the policy and the reference (see module table).

    ``mode`` is a name in :data:`KL_PENALTIES` or a callable ``(logprobs, ref_logprobs) -> (b t)``.
    The default ``"low_var_kl"`` (k3) is verl's ``kl_loss_type`` default. verl's ``"full"``
    (needs whole-vocabulary logits) is not implemented there either and is not registered.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs has shape {tuple(ref_logprobs.shape)} but logprobs has shape {tuple(logprobs.shape)}; "
            "both must be (b t)"
        )
    fn = check_kl_fn(mode)
    out = fn(logprobs, ref_logprobs)
    if not isinstance(out, torch.Tensor) or out.shape != logprobs.shape:
        # a (b,) or scalar estimate failed later as "loss_mat has shape (16,) and mask (16, 5)",
        # naming neither the KL function nor its contract
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"KL penalty {_name(mode, fn)!r} returned {got}; a KL penalty returns a per-token estimate of "
                         f"the inputs' shape {tuple(logprobs.shape)} (b t), e.g. logprobs - ref_logprobs")
    return out


def _name(mode, fn) -> str:
    return mode if isinstance(mode, str) else getattr(fn, "__name__", type(fn).__name__)


def check_kl_fn(mode: str | Callable) -> Callable:
    """The KL penalty ``mode`` names, checked to take ``(logprobs, ref_logprobs)`` by position: a
    user's function with another signature was accepted by a recipe and failed after the first
    rollout with Python's bare "missing 1 required positional argument"."""
    fn = KL_PENALTIES.get(mode)
    try:
        params = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return fn
    try:
        params.bind(None, None)
    except TypeError:
        raise TypeError(f"KL penalty {_name(mode, fn)!r} has the signature {params}; update calls it as "
                        "fn(logprobs, ref_logprobs) -> (b t), both (b t) tensors by position (give any other "
                        "parameter a default)") from None
    return fn


@torch.no_grad()
def apply_kl_to_rewards(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    mode: str | Callable = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-in-reward shaping (Ziegler et al., 2019, arXiv:1909.08593; Ouyang et al., 2022), as
    verl's ``apply_kl_penalty``.

    Shapes: ``token_rewards, logprobs, ref_logprobs, response_mask (b t)`` ->
    ``(token_rewards' (b t), metrics)``. ``logprobs`` are the behaviour/old log-probs.

    Formula::

        kld    = kl_penalty(logprobs, ref_logprobs, mode) on valid tokens, 0 elsewhere
        r'     = r - kl_coef * kld
        kl     = mean_i masked_mean(kld_i, mask_i)        (per-row mean, then mean over rows)

    ``mode = "kl"`` (k1) is verl's ``algorithm.kl_penalty`` default. Metrics: ``"kl"`` (feed it
    to ``controller.update(kl, n_steps=b)``) and ``"kl_coef"``. Pure: the controller is not
    updated here.
    """
    for name, value in (("logprobs", logprobs), ("ref_logprobs", ref_logprobs), ("response_mask", response_mask)):
        if value.shape != token_rewards.shape:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)} but token_rewards has shape {tuple(token_rewards.shape)}; "
                "all must be (b t)"
            )
    _check_coef(kl_coef, "kl_coef")
    mask = response_mask.bool()
    kld = torch.where(mask, kl_penalty(logprobs, ref_logprobs, mode), 0.0)
    shaped = token_rewards - kl_coef * kld
    current_kl = masked_mean(kld, mask, dim=-1).mean()
    metrics = {"kl": current_kl, "kl_coef": torch.tensor(float(kl_coef), device=token_rewards.device)}
    return shaped, metrics


def _as_float(x: float | torch.Tensor) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _check_coef(value: object, name: str) -> None:
    """A KL coefficient is a finite number >= 0: a negative one rewards moving away from the
    reference, and NaN turned every reward NaN, which surfaced steps later as a broken reward
    function (``rlkit.update`` refuses the same values for its ``kl=``)."""
    try:
        number = _as_float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {number}; 0 turns the KL penalty off")


@dataclasses.dataclass(frozen=True)
class FixedKLController:
    """A constant KL coefficient. ``update`` returns an equal controller."""

    kl_coef: float

    def __post_init__(self) -> None:
        _check_coef(self.kl_coef, "kl_coef")

    @property
    def value(self) -> float:
        return self.kl_coef

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> "FixedKLController":
        return self


@dataclasses.dataclass(frozen=True)
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al., 2019, arXiv:1909.08593), as verl's.

    Formula: ``e = clip(kl / target_kl - 1, -0.2, 0.2)``; ``beta' = beta * (1 + e * n_steps / horizon)``.
    ``update`` is pure: it returns a new controller. verl's defaults: ``init_kl_coef = 0.001``,
    ``target_kl = 0.1``, ``horizon = 10000``.
    """

    init_kl_coef: float
    target_kl: float
    horizon: float
    value: float | None = None

    def __post_init__(self) -> None:
        if not self.horizon > 0:
            raise ValueError(f"horizon must be > 0, got {self.horizon}")
        if not self.target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {self.target_kl}")
        _check_coef(self.init_kl_coef, "init_kl_coef")
        if self.value is None:
            object.__setattr__(self, "value", float(self.init_kl_coef))

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> "AdaptiveKLController":
        kl = _as_float(current_kl)
        if not math.isfinite(kl):
            # min/max let NaN through: the coefficient became NaN for this and every later update
            raise ValueError(f"current_kl must be finite, got {kl}: the KL between the policy and the reference "
                             "overflowed or was NaN; check the batch's logprobs and ref_logprobs")
        error = min(max(kl / self.target_kl - 1, -0.2), 0.2)
        return dataclasses.replace(self, value=self.value * (1 + error * n_steps / self.horizon))
