"""Masked statistics over padded ``(b t)`` tensors.

These match verl's ``verl.utils.torch_functional`` helpers (``masked_sum``, ``masked_mean``,
``masked_var``, ``masked_whiten``) number for number, including the ``1e-8`` guards, so every
estimator and loss built on them reproduces verl's values.

Masks may be ``bool`` or floating point. A floating mask acts as a weight (verl multiplies by
it); positions where the mask is zero are *selected away* with ``torch.where`` before any
arithmetic, so a NaN or inf sitting in padding never reaches a result.
"""
from __future__ import annotations

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten"]

#: verl's guard against an empty mask in the mean's denominator
MEAN_EPS = 1e-8
#: verl's guard inside ``rsqrt(var + eps)`` when whitening
WHITEN_EPS = 1e-8


def _check_same_shape(x: torch.Tensor, mask: torch.Tensor, fn: str) -> None:
    if x.shape != mask.shape:
        raise ValueError(
            f"{fn}: mask has shape {tuple(mask.shape)} but x has shape {tuple(x.shape)}; "
            "pass a mask with exactly the shape of the values (e.g. response_mask (b t))"
        )


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is non-zero, weighted by ``mask``.

    Shapes: ``x`` and ``mask`` have the same shape (e.g. ``(b t)``); the result is ``x`` reduced
    over ``dim`` (all dimensions when ``None``).

    Formula: ``sum_i [mask_i != 0] * x_i * mask_i``. Entries with ``mask == 0`` are replaced by 0
    before multiplying, so NaN/inf in padding does not leak (as verl's ``masked_sum``).
    """
    _check_same_shape(x, mask, "masked_sum")
    selected = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    weighted = selected if mask.dtype == torch.bool else selected * mask
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions selected by ``mask``.

    Shapes: as :func:`masked_sum`.

    Formula (verl): ``masked_sum(x, mask, dim) / (sum(mask, dim) + 1e-8)``. An empty mask gives
    ``0`` (not NaN) thanks to the ``1e-8``.
    """
    total = masked_sum(x, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    # the count takes the values' dtype, so the 1e-8 guard means the same for bool and float masks
    return total / (count.to(total.dtype) + MEAN_EPS)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all positions selected by ``mask`` (a scalar).

    Formula (verl): ``v = masked_mean((x - mu)^2, mask)`` with ``mu = masked_mean(x, mask)``;
    when ``unbiased`` the Bessel factor ``n / (n - 1)`` with ``n = sum(mask)`` is applied.

    Raises ``ValueError`` when ``unbiased`` and the mask selects fewer than two positions (the
    Bessel factor is undefined there), as verl does.
    """
    mu = masked_mean(x, mask)
    var = masked_mean((x - mu) ** 2, mask)
    if unbiased:
        n = mask.sum().to(var.dtype)
        if n == 0:
            raise ValueError(
                "masked_var: the mask selects no position (response_mask is all False); "
                "an unbiased variance needs at least two valid tokens"
            )
        if n == 1:
            raise ValueError(
                "masked_var: the mask selects a single position; the unbiased variance divides by "
                "n - 1 = 0. Use a batch with at least two valid tokens (or unbiased=False)"
            )
        var = var * (n / (n - 1))
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit variance over the positions in ``mask``.

    Shapes: ``x`` and ``mask`` of the same shape; output has that shape. Positions outside the
    mask are transformed by the same affine map (they are *not* zeroed; callers mask them).

    Formula (verl): ``(x - mu) * rsqrt(var + 1e-8)`` with ``mu = masked_mean(x, mask)`` and
    ``var = masked_var(x, mask, unbiased=True)``; if ``shift_mean`` is False, ``mu`` is added back.
    """
    mu = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mu) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mu
    return whitened
