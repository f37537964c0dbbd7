"""Loss aggregation, policy losses, the clipped value loss and token entropy.

Matches verl's ``verl/trainer/ppo/core_algos.py`` (``agg_loss``, ``compute_policy_loss_*``,
``compute_value_loss``) and ``verl.utils.torch_functional.entropy_from_logits``.

Micro-batching. Every aggregation takes optional *global* normalisers (``num_tokens``,
``num_seqs``, ``horizon``). Give each micro-batch the normaliser of the whole mini-batch and
the micro-batch losses **sum** to exactly the mini-batch loss (verl's ``global_batch_info``,
without its ``dp_size`` factor: scaling for data parallelism is the caller's business).
"""
from __future__ import annotations

from typing import Callable

import math

import torch

from rlkit._checks import is_real, positive_finite_or_none
from rlkit.algos.registry import Registry
from rlkit.algos.stats import masked_mean, masked_sum

__all__ = [
    "AGGREGATIONS",
    "aggregate",
    "POLICY_LOSSES",
    "ppo_clip",
    "gspo",
    "cispo",
    "gpg",
    "gmpo",
    "clip_cov",
    "kl_cov",
    "value_loss",
    "entropy_from_logits",
]

Number = float | int | torch.Tensor

#: verl clamps log-ratios to this range before ``exp`` (ppo_clip, cispo)
LOG_RATIO_CLAMP = 20.0
#: verl clamps GSPO's sequence log-ratio from above at this value
GSPO_LOG_RATIO_MAX = 10.0

# --------------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------------

AGGREGATIONS: Registry = Registry("loss aggregation")


def _default_count(count: torch.Tensor) -> torch.Tensor:
    # an all-padding batch then gives 0 instead of verl's 0/0 = NaN
    return torch.where(count > 0, count, torch.ones_like(count))


def _check_normaliser(name: str, value: Number | None) -> None:
    if isinstance(value, (int, float)) and not value > 0:
        raise ValueError(f"{name} must be > 0 (the count over the whole mini-batch), got {value!r}")


@AGGREGATIONS.register("token-mean")
def token_mean(loss_mat, mask, *, num_tokens=None, num_seqs=None, horizon=None):
    """``sum_{i,t} mask * loss / num_tokens``; ``num_tokens`` defaults to ``sum(mask)``.

    DAPO's token-level loss (Yu et al., 2025, arXiv:2503.14476); verl's default.
    """
    if num_tokens is None:
        num_tokens = _default_count(mask.sum().to(loss_mat.dtype))
    return masked_sum(loss_mat, mask) / num_tokens


def _nonempty_rows(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (mask.sum(dim=-1) > 0).to(dtype).sum()


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat, mask, *, num_tokens=None, num_seqs=None, horizon=None):
    """``sum_i (sum_t mask * loss) / num_seqs``; ``num_seqs`` defaults to the number of rows with
    at least one valid token (verl excludes fully masked rows from the count)."""
    per_row = masked_sum(loss_mat, mask, dim=-1)
    if num_seqs is None:
        num_seqs = _default_count(_nonempty_rows(mask, loss_mat.dtype))
    return per_row.sum() / num_seqs


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat, mask, *, num_tokens=None, num_seqs=None, horizon=None):
    """``sum_i [(sum_t mask * loss) / (sum_t mask + 1e-8)] / num_seqs``; ``num_seqs`` defaults to
    the number of rows with at least one valid token (as verl). The original GRPO loss
    (Shao et al., 2024, arXiv:2402.03300)."""
    per_row = masked_sum(loss_mat, mask, dim=-1) / (mask.sum(dim=-1) + 1e-8)
    if num_seqs is None:
        num_seqs = _default_count(_nonempty_rows(mask, loss_mat.dtype))
    return per_row.sum() / num_seqs


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss_mat, mask, *, num_tokens=None, num_seqs=None, horizon=None):
    """``sum_{i,t} mask * loss / horizon``; ``horizon`` defaults to ``mask.shape[-1]``.

    Dr. GRPO's constant normaliser (Liu et al., 2025, arXiv:2503.20783). As verl's code and docs
    ("turns off seq-dim averaging"), there is **no** division by the number of sequences, so
    ``num_seqs`` is ignored. ``horizon`` is verl's ``loss_scale_factor``: set it to a constant
    (e.g. the max response length) so the scale does not change with each batch's padding; the
    default (this batch's width) differs between micro-batches of different width.
    """
    if horizon is None:
        horizon = mask.shape[-1]
    return masked_sum(loss_mat, mask) / horizon


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str | Callable = "token-mean",
    *,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``loss_mat (b t)`` to a scalar, as verl's ``agg_loss``.

    ``mode`` is a name in :data:`AGGREGATIONS` (``"token-mean"``, ``"seq-mean-token-sum"``,
    ``"seq-mean-token-mean"``, ``"seq-mean-token-sum-norm"``) or a callable with the same
    signature. ``num_tokens`` / ``num_seqs`` / ``horizon`` are global normalisers (see the module
    docstring); each defaults to this batch's own count. Positions with ``mask == 0`` never
    contribute, whatever their value.
    """
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat has shape {tuple(loss_mat.shape)} and mask {tuple(mask.shape)}; both must be (b t) and equal"
        )
    _check_normaliser("num_tokens", num_tokens)
    _check_normaliser("num_seqs", num_seqs)
    _check_normaliser("horizon", horizon)
    fn = AGGREGATIONS.get(mode)
    return fn(loss_mat, mask, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)


# --------------------------------------------------------------------------------------------
# policy losses
# --------------------------------------------------------------------------------------------

POLICY_LOSSES: Registry = Registry("policy loss")


def _check_policy_inputs(logprobs, old_logprobs, advantages, response_mask) -> None:
    for name, value in (("old_logprobs", old_logprobs), ("advantages", advantages), ("response_mask", response_mask)):
        if not isinstance(value, torch.Tensor) or value.shape != logprobs.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name} has shape {shape} but logprobs has shape {tuple(logprobs.shape)}; all must be (b t)")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (b t), got shape {tuple(logprobs.shape)}")


def _clip_bounds(clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None,
                 loss: str) -> tuple[float, float]:
    """``(eps_low, eps_high)``, each a finite number >= 0: a negative one inverted the clip range
    (``1 + eps_high < 1``: every token clipped) and NaN disabled it silently. A low bound above 1
    is allowed (CISPO's default sets none: ``1 - eps_low < 0`` never binds)."""
    for name, value in (("clip_ratio", clip_ratio), ("clip_ratio_low", clip_ratio_low), ("clip_ratio_high", clip_ratio_high)):
        if value is None and name != "clip_ratio":
            continue
        if not is_real(value) or not 0 <= value < math.inf:
            where = ("the log-ratio is clipped to [-clip_ratio_low, clip_ratio_high]" if loss == "gmpo"
                     else "the ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]")
            raise ValueError(f"{loss}: {name} must be a finite number >= 0 ({where}, both defaulting to clip_ratio), got {value!r}")
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high


def _check_token_fraction(value, loss: str, name: str, meaning: str) -> None:
    """Raise ``ValueError`` naming ``loss`` and ``name`` unless ``value`` is a number in ``(0, 1]``:
    ``k = int(value * #valid tokens)`` is a count of tokens, and a ratio above 1 asked for more
    tokens than there are (``kl_cov``'s top-k failed with "selected index k out of range")."""
    if not is_real(value) or not 0 < value <= 1:
        raise ValueError(f"{loss}: {name} must be a number in (0, 1] ({meaning}; at least one token per call), "
                         f"got {value!r}; e.g. loss_kw={{{name!r}: 0.0002}}")


def _zero(ref: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=ref.dtype, device=ref.device)


def _frac(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(condition.to(torch.float32), mask).detach()


@POLICY_LOSSES.register("ppo_clip", "vanilla")
def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    agg: str | Callable = "token-mean",
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al., 2017, arXiv:1707.06347) with DAPO's decoupled
    clip-higher (Yu et al., 2025, arXiv:2503.14476) and dual-clip for negative advantages
    (Ye et al., 2020, arXiv:1912.09729), as verl's ``compute_policy_loss_vanilla``.

    Shapes: ``logprobs, old_logprobs, advantages, response_mask (b t)`` -> scalar loss.

    Formula, with ``d = clamp(logp - logp_old, -20, 20)`` and ``r = exp(d)``::

        L1 = -A * r
        L2 = -A * clamp(r, 1 - eps_low, 1 + eps_high)
        L  = max(L1, L2)                               if A >= 0
        L  = min(max(L1, L2), -A * clip_ratio_c)       if A <  0   (dual clip)

    aggregated with ``agg``. ``eps_low`` / ``eps_high`` default to ``clip_ratio``.

    Metrics: ``clipfrac = mean[L2 > L1]``, ``clipfrac_lower = mean[max(L1, L2) > -A c and A < 0]``,
    ``approx_kl = mean[-d]`` (verl's ``ppo_kl``), all over valid tokens.
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, response_mask)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high, "ppo_clip")
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(loss3, clipped)
    losses = torch.where(advantages < 0, dual, clipped)
    loss = aggregate(losses, response_mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    metrics = {
        "clipfrac": _frac(loss2 > loss1, response_mask),
        "clipfrac_lower": _frac((clipped > loss3) & (advantages < 0), response_mask),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    agg: str | Callable | None = "seq-mean-token-mean",
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization (Zheng et al., 2025, arXiv:2507.18071), as verl's
    ``compute_policy_loss_gspo``.

    Shapes: ``(b t)`` inputs -> scalar loss.

    Formula, with ``d_t = logp_t - logp_old_t`` and ``|y| = max(sum_t mask, 1)``::

        log s_i    = sum_t mask * d_t / |y|                     (sequence-level ratio, length-normalised)
        log s_{it} = sg[log s_i] + logp_t - sg[logp_t]          (value s_i, token-level gradient)
        r          = exp(min(log s_{it}, 10))
        L          = max(-A r, -A clamp(r, 1 - eps_low, 1 + eps_high))

    aggregated with ``agg``. The paper's clip range is small (e.g. ``clip_ratio_low=3e-4,
    clip_ratio_high=4e-4``); the default 0.2 is verl's config default.

    Divergence: verl always aggregates GSPO with ``"seq-mean-token-mean"`` and ignores the mode it
    is given, while its docstring says that mode is *recommended*. We follow the documented
    intent: ``"seq-mean-token-mean"`` is the default (also for ``agg=None``) and an explicit
    ``agg`` is honoured.

    Metrics: ``clipfrac``, ``clipfrac_lower`` (always 0), ``approx_kl`` (unclamped, as verl).
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, response_mask)
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high, "gspo")
    log_ratio = logprobs - old_logprobs
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / lengths
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    losses = torch.maximum(loss1, loss2)
    mode = "seq-mean-token-mean" if agg is None else agg
    loss = aggregate(losses, response_mask, mode, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    metrics = {
        "clipfrac": _frac(loss2 > loss1, response_mask),
        "clipfrac_lower": _zero(loss).detach(),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    agg: str | Callable = "token-mean",
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, 2025, arXiv:2506.13585), as verl's
    ``compute_policy_loss_cispo``.

    Shapes: ``(b t)`` inputs -> scalar loss.

    Formula, with ``r = exp(clamp(logp - logp_old, -20, 20))``::

        L = -sg[clamp(r, 1 - eps_low, 1 + eps_high)] * A * logp

    (the clipped importance weight is a constant; every token keeps a gradient through
    ``logp``). Metrics: ``clipfrac = mean[r != clamp(r)]``, ``clipfrac_lower`` (always 0),
    ``approx_kl``.
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, response_mask)
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high, "cispo")
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
    losses = -clipped_ratio.detach() * advantages * logprobs
    loss = aggregate(losses, response_mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    metrics = {
        "clipfrac": _frac(ratio != clipped_ratio, response_mask),
        "clipfrac_lower": _zero(loss).detach(),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, metrics


@POLICY_LOSSES.register("gpg")
def gpg(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    agg: str | Callable = "token-mean",
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Policy Gradient loss (Chu et al., 2025, arXiv:2504.02546), as verl's
    ``compute_policy_loss_gpg``: plain policy gradient, no ratio, no clip.

    Shapes: ``(b t)`` inputs -> scalar loss. Formula: ``L = -A * logp`` aggregated with ``agg``.

    Metrics (verl returns none): ``clipfrac`` (always 0) and ``approx_kl`` for a uniform view.
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, response_mask)
    losses = -logprobs * advantages
    loss = aggregate(losses, response_mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    metrics = {
        "clipfrac": _zero(loss).detach(),
        "approx_kl": masked_mean(-(logprobs - old_logprobs), response_mask).detach(),
    }
    return loss, metrics


@POLICY_LOSSES.register("gmpo", "geo_mean")
def gmpo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    agg: str | Callable | None = None,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Geometric-Mean Policy Optimization (Zhao et al., 2025, arXiv:2507.20673), as verl's
    ``compute_policy_loss_geo_mean`` (registered there as ``"geo_mean"``).

    Shapes: ``(b t)`` inputs -> scalar loss.

    Formula, with ``d_t = logp_t - logp_old_t`` (not clamped), ``sgn = sign(A)``,
    ``n_i = sum_t mask``::

        d'_t = sgn * min(sgn * d_t, sgn * clamp(d_t, -eps_low, eps_high))   (token clip in log space)
        r_i  = exp(sum_t mask d'_t / (n_i + 1e-8))                          (geometric mean ratio)
        A_i  = sum_t mask A_t / (n_i + 1e-8)                                (sequence advantage)
        L    = sum_i -A_i r_i / num_seqs

    The loss is per sequence, so ``agg`` is ignored for the policy term (as verl; through
    :func:`rlkit.update` it still reduces the KL and entropy terms), but a name must be a
    registered aggregation: a misspelt one was accepted silently. ``num_seqs`` defaults to the
    number of rows with at least one valid token, the count :func:`rlkit.update` passes and every
    ``seq-mean-*`` aggregation uses (an empty row adds 0 to the sum). verl's ``torch.mean`` over
    rows also counts empty rows; the two differ only for a batch with such rows (hand-made: the
    engines emit at least one token per response).

    Metrics: ``clipfrac = mean[d != clamp(d) and A > 0]``,
    ``clipfrac_lower = mean[d != clamp(d) and A < 0]``, ``approx_kl``.
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, response_mask)
    _check_normaliser("num_seqs", num_seqs)
    if isinstance(agg, str):
        AGGREGATIONS.get(agg)  # an unknown name raises, naming the registered ones
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high, "gmpo")
    log_ratio = logprobs - old_logprobs
    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -low, high)
    log_ratio_min = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)
    lengths = response_mask.sum(dim=-1)
    ratio = torch.exp(masked_sum(log_ratio_min, response_mask, dim=-1) / (lengths + 1e-8))
    seq_advantage = masked_sum(advantages, response_mask, dim=-1) / (lengths + 1e-8)
    per_row = -seq_advantage * ratio
    if num_seqs is None:
        num_seqs = _default_count(_nonempty_rows(response_mask, per_row.dtype))
    loss = per_row.sum() / num_seqs
    clipped = log_ratio != log_ratio_clamped
    metrics = {
        "clipfrac": _frac(clipped & (advantages > 0), response_mask),
        "clipfrac_lower": _frac(clipped & (advantages < 0), response_mask),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, metrics


@POLICY_LOSSES.register("clip_cov")
def clip_cov(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    agg: str | Callable = "token-mean",
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al., 2025, "The Entropy Mechanism of RL for Reasoning LMs",
    arXiv:2505.22617), as verl's ``compute_policy_loss_clip_cov``.

    Shapes: ``(b t)`` inputs -> scalar loss.

    Formula, with ``r = exp(logp - logp_old)`` (not clamped), ``L1 = -A r``,
    ``L2 = -A clamp(r, 1 - eps_low, 1 + eps_high)``::

        cov_t = (A_t - mean(A)) * (logp_t - mean(sg[logp]))        (means over valid tokens)
        candidates = valid tokens not already clipped (L2 <= L1) with lb < cov_t < ub
        k = max(int(clip_cov_ratio * #valid tokens), 1)
        drop the gradient of k candidates chosen uniformly at random (row-major order,
        ``torch.randperm(n, generator=generator)``)
        L = max(L1, L2) * (0 on dropped tokens, 1 elsewhere)

    Pass a seeded ``generator`` for reproducible selection; the selection uses the statistics
    of this (micro-)batch, as verl, and drops at least one token per call: micro-batches (and
    data-parallel ranks) each choose their own tokens, so the split changes the gradient
    (:func:`rlkit.update` warns when micro-batching splits a mini-batch). Metrics: ``clipfrac`` =
    fraction of dropped tokens, ``approx_kl``.
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, response_mask)
    _check_token_fraction(clip_cov_ratio, "clip_cov", "clip_cov_ratio", "the fraction of valid tokens whose gradient is dropped")
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high, "clip_cov")
    valid = response_mask.bool()
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    with torch.no_grad():
        clipped_by_ratio = (loss2 > loss1) & valid
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            logprobs.detach() - masked_mean(logprobs.detach(), response_mask)
        )
        candidate = valid & ~clipped_by_ratio & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        positions = torch.nonzero(candidate)
        keep = torch.ones_like(advantages)
        if len(positions) > 0:
            k = max(int(clip_cov_ratio * valid.sum().item()), 1)
            # verl draws from the global RNG; an explicit generator makes the draw reproducible
            device = generator.device if generator is not None else torch.device("cpu")
            perm = torch.randperm(len(positions), generator=generator, device=device)
            chosen = positions[perm[: min(k, len(positions))].to(positions.device)]
            keep[chosen[:, 0], chosen[:, 1]] = 0
    losses = torch.maximum(loss1, loss2) * keep
    loss = aggregate(losses, response_mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    metrics = {
        "clipfrac": _frac(keep == 0, response_mask),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, metrics


@POLICY_LOSSES.register("kl_cov")
def kl_cov(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    agg: str | Callable = "token-mean",
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al., 2025, arXiv:2505.22617), as verl's ``compute_policy_loss_kl_cov``.

    Shapes: ``(b t)`` inputs -> scalar loss.

    Formula, with ``d = logp - logp_old`` and ``r = exp(d)`` (not clamped)::

        cov_t = (A_t - mean(A)) * (sg[logp_t] - mean(sg[logp]))    (plain means over valid tokens)
        k     = max(int(kl_cov_ratio * #valid tokens), 1)
        L_t   = -A_t r_t + ppo_kl_coef * |d_t|    on the k valid tokens of largest cov_t
        L_t   = -A_t r_t                          elsewhere

    There is no ratio clipping. ``ppo_kl_coef = 0.1`` is verl's config default (its code falls
    back to 1.0 only when the config field is missing). The top-k uses this (micro-)batch's
    statistics, as verl, and penalises at least one token per call: micro-batches (and
    data-parallel ranks) each choose their own tokens, so the split changes the gradient
    (:func:`rlkit.update` warns when micro-batching splits a mini-batch).

    Metrics: ``clipfrac`` = fraction of valid tokens that got the KL term, ``approx_kl``
    (``mean[-d]``), ``abs_kl = mean|d|`` (what verl reports as ``ppo_kl`` for this loss).
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, response_mask)
    _check_token_fraction(kl_cov_ratio, "kl_cov", "kl_cov_ratio", "the fraction of valid tokens given the KL term")
    if not is_real(ppo_kl_coef) or not 0 <= ppo_kl_coef < math.inf:
        # a negative coefficient rewarded moving away from the old policy on the chosen tokens; NaN poisoned the loss
        raise ValueError(f"kl_cov: ppo_kl_coef must be a finite number >= 0 (the weight of |logp - logp_old| on the "
                         f"chosen tokens; 0: no penalty), got {ppo_kl_coef!r}; e.g. loss_kw={{'ppo_kl_coef': 0.1}}")
    valid = response_mask.bool()
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    losses = -advantages * ratio
    penalised = torch.zeros_like(valid)
    with torch.no_grad():
        flat_index = torch.nonzero(valid.flatten()).flatten()
        if flat_index.numel() > 0:
            adv = advantages.detach().flatten()[flat_index]
            logp = logprobs.detach().flatten()[flat_index]
            cov = (adv - adv.mean()) * (logp - logp.mean())
            k = max(1, int(flat_index.numel() * kl_cov_ratio))
            top = torch.topk(cov, k, largest=True).indices
            penalised = penalised.flatten().index_fill(0, flat_index[top], True).view_as(valid)
    losses = torch.where(penalised, losses + ppo_kl_coef * log_ratio.abs(), losses)
    loss = aggregate(losses, response_mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    metrics = {
        "clipfrac": _frac(penalised, response_mask),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
        "abs_kl": masked_mean(log_ratio.abs(), response_mask).detach(),
    }
    return loss, metrics


#: losses that choose tokens from the statistics of the rows they are given (at least one per
#: call): rlkit.update warns when micro-batching splits a mini-batch for one of them. A loss of
#: your own that does the same can set ``fn.selects_tokens_per_call = True`` to get the warning.
clip_cov.selects_tokens_per_call = True
kl_cov.selects_tokens_per_call = True


# --------------------------------------------------------------------------------------------
# value loss and entropy
# --------------------------------------------------------------------------------------------


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float | None = 0.5,
    agg: str | Callable = "token-mean",
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    horizon: Number | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value-function loss for PPO (as in OpenAI baselines / TRL), as verl's
    ``compute_value_loss``.

    Shapes: ``values`` (current critic prediction), ``old_values`` (the critic's values at
    rollout time), ``returns``, ``response_mask``: all ``(b t)`` -> scalar loss.

    Formula::

        v_clip = clamp(v, v_old - c, v_old + c)
        L      = 0.5 * agg(max((v - R)^2, (v_clip - R)^2))

    ``cliprange_value = 0.5`` is verl's critic default: a finite number > 0, or None: no
    clipping. Metrics: ``vf_clipfrac = mean[(v_clip - R)^2 > (v - R)^2]`` over valid tokens.
    """
    # -0.5 made v_clip = v_old + 0.5 whatever v (an inverted range), nan made the loss NaN
    positive_finite_or_none(cliprange_value, "value_loss: cliprange_value", "no clipping")
    for name, value in (("old_values", old_values), ("returns", returns), ("response_mask", response_mask)):
        if not isinstance(value, torch.Tensor) or value.shape != values.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name} has shape {shape} but values has shape {tuple(values.shape)}; all must be (b t)")
    if cliprange_value is None:  # no clipping: the plain squared error
        loss = 0.5 * aggregate((values - returns) ** 2, response_mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
        return loss, {"vf_clipfrac": torch.zeros((), device=values.device)}
    clipped_values = torch.maximum(torch.minimum(values, old_values + cliprange_value), old_values - cliprange_value)
    loss1 = (values - returns) ** 2
    loss2 = (clipped_values - returns) ** 2
    losses = torch.maximum(loss1, loss2)
    loss = 0.5 * aggregate(losses, response_mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    return loss, {"vf_clipfrac": _frac(loss2 > loss1, response_mask)}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits (... v)`` -> ``(...)``.

    Formula (verl's stable form): ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``, equal to
    ``-sum p log p``. A ``-inf`` logit (a masked-out token) has probability 0 and contributes 0,
    to the value and the gradient (verl's ``0 * -inf`` made the entropy NaN). No chunking here;
    the models layer chunks over tokens to save memory.
    """
    probs = torch.softmax(logits, dim=-1)
    # zero probability: the term is 0, so 0 * -inf = NaN never forms (nor in the backward)
    finite = torch.where(probs > 0, logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return torch.logsumexp(logits, dim=-1) - (probs * finite).sum(dim=-1)

