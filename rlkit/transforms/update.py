"""``update(state, batch, ...) -> (state', metrics)``: one policy (and critic) update.

The loss of a mini-batch is::

    L = policy_loss(logprobs, old_logprobs, advantages)          # registry: rlkit.algos.POLICY_LOSSES
        + kl_coef * agg(kl_penalty(logprobs, ref_logprobs))       # rlkit.algos.KL_PENALTIES
        - entropy_coef * agg(entropy)

The batch is split into ``mini_batch_size`` rows per optimizer step (default: the whole batch,
one step) and each mini-batch into ``micro_batch_size`` rows per forward/backward (gradient
accumulation; the last micro-batch may be shorter). Every aggregation uses the *mini-batch's* token and sequence counts as
normalisers, so micro-batching never changes the gradient (tested), with one exception: Clip-Cov
and KL-Cov choose the tokens they drop or penalise from the statistics of each micro-batch, as
verl does, so for them the split matters (update warns). Under data parallelism the
counts are summed over the data-parallel group, so N processes compute the same update as one.
FSDP2 reduce-scatters the gradients after every micro-batch's backward, or only after the last
of each mini-batch when the plan was lowered with ``grad_reduce="step"``
(:meth:`rlkit.Pipeline.lower`).

``update`` donates its input state: parameters and optimizer moments change in place and the old
handle (and every handle ``replace`` made of it, which share its models) raises
:class:`rlkit.state.DonatedStateError` if used again. An exception (Ctrl-C included) after the
first optimizer step donates it too, saying so: its weights are then neither the old ones nor
those of a finished update. An exception before that step leaves it unchanged and usable: every
argument is checked before any work. An exception raised once the update is complete, while it
reports (the log-prob gap ``RuntimeWarning`` under ``warnings.simplefilter("error")`` or pytest's
``filterwarnings = error``, Ctrl-C), donates the input to the finished update's new state, which
the exception carries as ``exc.state`` (its metrics as ``exc.metrics`` when they were complete).

float16 parameters are trained with dynamic loss scaling (:class:`LossScale`, as
``torch.amp.GradScaler`` does it, but explicit: the scale lives in ``state.extras``): float16's
smallest number is about 6e-8, and the gradients of a policy loss (an advantage divided by the
mini-batch's token count, through every layer) fall below it. bfloat16 and float32 parameters have
float32's range and train unscaled, exactly as without this.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import numbers
import re
import warnings
from typing import Any, Callable, Mapping

import torch

from rlkit._checks import check_switch, check_token_ids, int_at_least, is_int, is_real, positive_finite_or_none
from rlkit.algos.kl import check_kl_fn, kl_penalty
from rlkit.algos.losses import POLICY_LOSSES, aggregate, value_loss
from rlkit.batch import Batch, BatchError, validate
from rlkit.state import TrainState
from rlkit.transforms.forward import check_batch_context, module_device, rows_view
from rlkit.transforms.rollout import FILTERED

LossSpec = str | Callable | tuple


class NonFiniteError(FloatingPointError):
    """Too many consecutive updates had a non-finite loss or gradient."""


#: dynamic loss scaling of float16 parameters: the first scale (torch.amp.GradScaler's), the
#: bounds it moves between, and how many consecutive finite optimizer steps double it
LOSS_SCALE_INIT = 2.0**16
LOSS_SCALE_MIN = 1.0
LOSS_SCALE_MAX = 2.0**24
LOSS_SCALE_GROWTH_INTERVAL = 2000


@dataclasses.dataclass(frozen=True)
class LossScale:
    """The dynamic loss scale of one trained role (``"actor"``, ``"critic"``) whose parameters
    include float16 ones, and the finite optimizer steps taken at it since it last changed.

    :func:`update` multiplies each micro-batch's loss by ``scale`` before backward, so gradients
    that float16 flushes to zero (below 2**-24, about 6e-8) or rounds coarsely (subnormals, below
    6e-5) are computed ``scale`` times larger, and divides the gradients by it again before
    clipping and the optimizer step (:func:`_unscaled_gradients`). A gradient that overflowed
    (inf/nan from a finite loss) skips the step and halves the scale (:meth:`overflowed`, not below
    ``LOSS_SCALE_MIN``); ``growth_interval`` finite steps in a row double it (:meth:`stepped`, not
    above ``LOSS_SCALE_MAX``), so it settles just below where gradients overflow. Both numbers live in
    ``state.extras`` (``"loss_scale/<role>"``, ``"loss_scale/<role>_good_steps"``): a checkpoint
    keeps them and a resumed run goes on with the scale it had, not 2**16 again."""

    scale: float = LOSS_SCALE_INIT
    good_steps: int = 0

    def stepped(self, growth_interval: int) -> LossScale:
        """After a finite optimizer step: doubled once ``growth_interval`` of them ran in a row."""
        if self.good_steps + 1 >= growth_interval:
            return LossScale(min(self.scale * 2.0, LOSS_SCALE_MAX), 0)
        return LossScale(self.scale, self.good_steps + 1)

    def overflowed(self) -> LossScale:
        """After a step skipped because the scaled gradients overflowed: halved."""
        return LossScale(max(self.scale / 2.0, LOSS_SCALE_MIN), 0)

    def skipped(self) -> LossScale:
        """After a step skipped for a non-finite loss: the scale was not the cause; the run of
        finite steps starts again."""
        return LossScale(self.scale, 0)

    def extras(self, role: str) -> dict[str, float | int]:
        """The ``state.extras`` entries that hold it."""
        return {f"loss_scale/{role}": self.scale, f"loss_scale/{role}_good_steps": self.good_steps}


def _loss_scale(state: TrainState, role: str, model: torch.nn.Module) -> LossScale | None:
    """``role``'s loss scale (from ``state.extras``; a fresh :class:`LossScale` at first) when
    ``model`` trains and holds float16 parameters, trained or frozen, else None: bfloat16 and
    float32 train unscaled. Frozen ones count: float32 adapters on a frozen float16 base (PEFT's
    default layout) get their gradients through float16 activations, which underflow alike."""
    params = list(model.parameters())
    if not any(p.requires_grad for p in params) or not any(p.dtype == torch.float16 for p in params):
        return None
    key = f"loss_scale/{role}"
    scale = state.extras.get(key, LOSS_SCALE_INIT)
    good = state.extras.get(f"{key}_good_steps", 0)
    reset = (f"or drop both entries to start again from 2**16: state = state.replace(extras={{k: v for k, v in "
             f"state.extras.items() if not k.startswith({key!r})}})")
    if not is_real(scale) or not LOSS_SCALE_MIN <= scale <= LOSS_SCALE_MAX:
        raise ValueError(f"state.extras[{key!r}] (the {role}'s float16 loss scale) must be a number from "
                         f"{LOSS_SCALE_MIN:g} to 2**24 (the most it grows to), got {scale!r}; set a power of two such as "
                         f"{LOSS_SCALE_INIT:g}, {reset}")
    if not is_int(good) or good < 0:
        raise ValueError(f"state.extras[{key + '_good_steps'!r}] (finite steps at the {role}'s loss scale) must be an int "
                         f">= 0, got {good!r}; set 0, {reset}")
    return LossScale(float(scale), int(good))


def _can_widen(p: torch.nn.Parameter) -> bool:
    """Whether :func:`_unscaled_gradients` gives float16 parameter ``p`` a float32 unscaled gradient:
    only torch >= 2.9 has ``grad_dtype``, which lets a parameter hold a gradient of another dtype.
    Before that a float16 parameter's gradient is divided in float16, in place, as an optimizer
    without master copies has it (what a true gradient below float16's range loses, the float32
    path keeps). One function, so that fallback is tested on a torch that has ``grad_dtype``."""
    return p.dtype == torch.float16 and hasattr(p, "grad_dtype")


@contextlib.contextmanager
def _unscaled_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scale: float):
    """Inside: ``model``'s gradients divided by the loss scale ``scale``, the true gradients that
    clipping, the reported norm, the finite check and the optimizer step must see.

    Divided in float16, a scaled float16 gradient would lose again what the scale saved (a true
    gradient of 1e-9 is 0 in float16; torch's GradScaler refuses to unscale float16 gradients for
    this reason). So where the optimizer steps float32 master copies
    (:class:`rlkit.optim.MasterWeightAdamW`, the default for float16 parameters, which casts each
    gradient to float32 itself) a float16 parameter's unscaled gradient is float32, which torch
    allows once the parameter's ``grad_dtype`` is None (set here and left so: autograd still makes
    float16 gradients for float16 parameters, and that optimizer's own float32 swap needs a free
    ``grad_dtype``; a pinned one would refuse it). Every other gradient is divided in place, in its
    own dtype: float32 and bfloat16 have the range, and an optimizer without master copies keeps
    float16 moments, which could not hold smaller values anyway. On exit the float32 gradients left
    are put back in their parameter's dtype."""
    from rlkit.optim import MasterWeightAdamW

    widen = isinstance(optimizer, MasterWeightAdamW)
    widened = []
    try:
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is None:
                    continue
                if widen and _can_widen(p):
                    grad = p.grad.to(torch.float32).div_(scale)
                    p.grad = None
                    p.grad_dtype = None
                    p.grad = grad
                    widened.append(p)
                else:
                    p.grad.div_(scale)
        yield
    finally:
        for p in widened:
            if p.grad is not None and p.grad.dtype != p.dtype:
                p.grad = p.grad.to(p.dtype)


def _loss_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


def _resolve_loss(loss: LossSpec, loss_kw: Mapping[str, Any] | None, agg: Any = None, drop_agg: str = "leave agg=None"):
    """``(fn, kwargs, wants_generator, accepted keywords or None for **kwargs)`` of a policy loss.

    ``agg``: the update's aggregation; a non-None one is refused for a loss that cannot receive it
    (no ``agg`` parameter, no ``**kwargs``): update passes a loss only the keywords it declares, so
    the policy term kept the loss's own aggregation while the KL and entropy terms took ``agg``."""
    kw = dict(loss_kw or {})
    if isinstance(loss, tuple):
        loss, extra = loss
        kw = {**extra, **kw}
    fn = POLICY_LOSSES.get(loss)
    reserved = sorted(set(kw) & {"agg", "num_tokens", "num_seqs", "horizon", "generator"})
    if reserved:
        # update passes these itself: in loss_kw they collided ("got multiple values for keyword")
        raise TypeError(f"loss_kw sets {reserved}, which update passes to the loss itself; give agg= (and horizon=, "
                        "Dr. GRPO's constant) to update or the recipe instead, and leave the counts and the generator to update")
    params = inspect.signature(fn).parameters
    _check_loss_positions(fn, params)
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = set(kw) - set(params)
        if unknown:
            raise TypeError(f"policy loss {getattr(fn, '__name__', loss)!r} has no option(s) {sorted(unknown)}; its options: {[n for n in params if n not in ('logprobs', 'old_logprobs', 'advantages', 'response_mask')]}")
    accepts_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    accepted = None if accepts_all else set(params)
    if agg is not None and accepted is not None and "agg" not in accepted:
        shown = agg if isinstance(agg, str) else _loss_name(agg)
        name = _loss_name(fn)
        raise TypeError(
            f"agg={shown!r} cannot reach the policy loss {name!r}, which has no 'agg' parameter (nor **kwargs): its own "
            f"aggregation would be used while the KL and entropy terms used {shown!r}. Add an 'agg' parameter to {name} "
            "(update passes it by keyword; rk.algos.aggregate(loss_mat, response_mask, agg, num_tokens=..., num_seqs=..., "
            f"horizon=...) applies it), or {drop_agg}"
        )
    return fn, kw, "generator" in params, accepted


#: the four tensors update hands a policy loss, by position, in this order
LOSS_INPUTS = ("logprobs", "old_logprobs", "advantages", "response_mask")


#: keywords update itself passes a policy loss (besides its four tensors)
_LOSS_KEYWORDS = frozenset({"agg", "num_tokens", "num_seqs", "horizon", "generator"})


def _loss_fields(fn: Callable, accepted: set | None, batch, loss_kw: Mapping[str, Any]) -> tuple[str, ...]:
    """The batch's tensor fields a policy loss declares by name, beyond its four tensors and the
    keywords update passes (``ref_logprobs``, ``group``, ``rewards``, a column of your own): each
    micro-batch's rows of them are passed by keyword, as an estimator gets its fields. A loss
    declaring ``ref_logprobs=None`` had silently received its default; ``loss_kw`` of the same name
    wins. A loss taking only ``**kwargs`` receives no fields (it names none)."""
    if accepted is None:
        return ()
    params = inspect.signature(fn).parameters
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:4]
    keys = set(batch.keys())
    return tuple(n for n in params if n not in positional and n not in _LOSS_KEYWORDS and n not in loss_kw
                 and n in keys and isinstance(batch.get(n), torch.Tensor))


def _check_loss_positions(fn: Callable, params) -> None:
    """A policy loss receives its four tensors by position (``logprobs, old_logprobs, advantages,
    response_mask``). A loss naming them in another order (``f(logprobs, advantages, response_mask,
    old_logprobs)``, as estimators get fields by name) trained on the wrong tensors without an error;
    one taking fewer failed with Python's bare "takes 3 positional arguments". Both are refused here,
    naming the order; other names (``mask``, ``adv``) are the user's to choose."""
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_positional = any(p.kind is p.VAR_POSITIONAL for p in params.values())
    name = _loss_name(fn)
    order = ", ".join(LOSS_INPUTS)
    if len(positional) < 4 and not var_positional:
        raise TypeError(f"policy loss {name!r} takes {len(positional)} positional argument(s) "
                        f"({', '.join(p.name for p in positional) or 'none'}); update passes four, in this order: {order}. "
                        "Declare all four (an unused one still needs its place)")
    misplaced = [(i, p.name) for i, p in enumerate(positional[:4]) if p.name in LOSS_INPUTS and LOSS_INPUTS[i] != p.name]
    if misplaced:
        got = ", ".join(p.name for p in positional[:4])
        raise TypeError(f"policy loss {name!r} takes ({got}), but update passes its tensors by position as ({order}): "
                        + "; ".join(f"its {p!r} would receive the {LOSS_INPUTS[i]}" for i, p in misplaced)
                        + f". Reorder {name}'s parameters to ({order})")


#: the global normalisers each built-in aggregation reads (a custom one may read any of them)
AGG_NORMALISERS = {"token-mean": ("num_tokens",), "seq-mean-token-mean": ("num_seqs",),
                   "seq-mean-token-sum": ("num_seqs",), "seq-mean-token-sum-norm": ("horizon",)}
_NORMALISERS = ("num_tokens", "num_seqs", "horizon")


def _loss_agg(fn: Callable, agg: Any) -> Any:
    """The aggregation a loss with an ``agg`` parameter applies: update's, else the parameter's default."""
    if agg is not None:
        return agg
    try:
        default = inspect.signature(fn).parameters["agg"].default
    except (TypeError, ValueError, KeyError):
        return None
    return None if default is inspect.Parameter.empty else default


def _warn_local_normaliser(fn: Callable, accepted: set | None, agg: Any = None, *, parts: int, ranks: int, micro: int,
                           mini: int, horizon_differs: bool = False) -> None:
    """Warn when a policy loss cannot normalise as the update does: it does not declare (nor take
    ``**kwargs`` for) a normaliser its aggregation reads, so ``rk.algos.aggregate`` falls back to
    the rows it is given.

    - ``num_tokens`` / ``num_seqs``: a mean over each micro-batch (or rank's share), summed, is not
      the mini-batch's mean; micro-batching (or data parallelism) changed the gradient silently, by
      up to the number of parts. A loss with no ``agg`` parameter needs either count; one with
      ``agg`` needs the one its aggregation reads (:data:`AGG_NORMALISERS`; all three for a custom
      aggregation): a loss declaring ``agg`` and ``num_tokens`` alone, under ``seq-mean-*`` with 4
      micro-batches, had 4x the built-in loss's gradient.
    - ``horizon`` (Dr. GRPO's constant, ``seq-mean-token-sum-norm``): without it the loss divides
      by the batch's width, while the KL and entropy terms divide by the update's ``horizon``, so
      even one batch was scaled by width/horizon (the ``drgrpo`` recipe's horizon is
      ``max_new_tokens``)."""
    if accepted is None:
        return
    split = parts > 1 or ranks > 1
    if "agg" in accepted:
        mode = _loss_agg(fn, agg)
        needs = AGG_NORMALISERS.get(mode, _NORMALISERS) if isinstance(mode, str) else _NORMALISERS
        missing = [n for n in needs if n not in accepted and (split if n != "horizon" else horizon_differs)]
    else:
        missing = [] if accepted & {"num_tokens", "num_seqs"} or not split else ["num_tokens", "num_seqs"]
    if not missing:
        return
    name = _loss_name(fn)
    why = []
    counts = [n for n in missing if n != "horizon"]
    if counts:
        split_by = []
        if parts > 1:
            split_by.append(f"micro_batch_size={micro} splits each mini-batch into {parts} micro-batches")
        if ranks > 1:
            split_by.append(f"{ranks} data-parallel ranks each hold part of the mini-batch of {mini} rows")
        why.append(f"without {' or '.join(counts)} it can only normalise by the rows it is given; {' and '.join(split_by)}, "
                   "whose losses are summed: a mean over each part is not the mini-batch's mean, and the gradient changes "
                   "with the split")
    if "horizon" in missing:
        why.append("without horizon its seq-mean-token-sum-norm divides by the batch's response width, not the update's "
                   "horizon, which the KL and entropy terms use")
    shown = f" (agg={_loss_agg(fn, agg)!r})" if "agg" in accepted else ""
    declare = ", ".join(f"{n}=None" for n in (_NORMALISERS if "agg" in accepted else ("num_tokens", "num_seqs")))
    passed = ", ".join(f"{n}={n}" for n in (_NORMALISERS if "agg" in accepted else ("num_tokens", "num_seqs")))
    warnings.warn(
        f"rlkit.update: the policy loss {name!r}{shown} does not take {', '.join(missing)}: {'; and '.join(why)}. "
        f"Add {declare} parameters to {name} and pass them on (rk.algos.aggregate(loss_mat, response_mask, agg, {passed}))"
        + (", or train without micro-batches (micro_batch_size=None) on one process" if counts else ""),
        RuntimeWarning, stacklevel=3)


def _warn_per_call_selection(fn: Callable, *, parts: int, micro: int) -> None:
    """Warn when micro-batching splits a mini-batch for a loss that selects tokens from the rows of
    one call (``fn.selects_tokens_per_call``: Clip-Cov, KL-Cov): each micro-batch chooses its own
    top-covariance tokens, at least one each, so the split changes which tokens are dropped or
    penalised, and the gradient (with micro_batch_size=1 a quarter of the tokens instead of 3%).
    Data-parallel ranks split it too, as in verl; that is not warned of, having no remedy."""
    if parts <= 1 or not getattr(fn, "selects_tokens_per_call", False):
        return
    name = _loss_name(fn)
    warnings.warn(
        f"rlkit.update: the policy loss {name!r} chooses the tokens it acts on from the statistics of the rows of each "
        f"call, at least one per call; micro_batch_size={micro} splits each mini-batch into {parts} micro-batches, "
        f"which choose separately, so the gradient changes with micro_batch_size. Leave micro_batch_size=None (or as "
        f"large as the mini-batch) for the mini-batch's own selection",
        RuntimeWarning, stacklevel=3)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-d tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"a {type(value).__name__} of {len(value)} ({inner})"
    return f"a {type(value).__name__}"


_LOSS_CONTRACT = ("(loss, metrics): loss a 0-d tensor (the mini-batch's loss, aggregated over its tokens, e.g. with "
                  "rk.algos.aggregate(loss_mat, response_mask, agg, num_tokens=num_tokens)), metrics a dict of 0-d tensors or "
                  "numbers (`return loss, {}` for none)")


def _checked_loss_output(result: Any, fn: Callable) -> tuple[torch.Tensor, Mapping[str, Any]]:
    """The policy loss's ``(loss, metrics)``, checked (types and shapes only: no device sync). A
    wrong return used to fail in torch, naming neither the loss nor what it must return: a bare
    loss ("iteration over a 0-d tensor"), a per-token one ("grad can be implicitly created only
    for scalar outputs"), a (1,) loss or metric ("stack expects each tensor to be equal size")."""
    name = _loss_name(fn)
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        hint = " (add the metrics: `return loss, {}`)" if isinstance(result, torch.Tensor) else ""
        raise TypeError(f"policy loss {name!r} returned {_describe(result)}; it must return {_LOSS_CONTRACT}{hint}")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"policy loss {name!r} returned a loss that is {_describe(loss)}, not a tensor; it must return "
                        f"{_LOSS_CONTRACT} (a Python number has no gradient: compute the loss from the logprobs tensor)")
    if loss.dim() != 0:
        hint = (" (reduce the per-token loss with rk.algos.aggregate(loss_mat, response_mask, agg, ...))" if loss.dim() >= 2
                else " (.squeeze() a one-element loss, or aggregate it)")
        raise ValueError(f"policy loss {name!r} returned a loss of shape {tuple(loss.shape)}; it must return {_LOSS_CONTRACT}{hint}")
    if not isinstance(metrics, Mapping):
        raise TypeError(f"policy loss {name!r} returned metrics that are {_describe(metrics)}; it must return {_LOSS_CONTRACT}")
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.dim() != 0:
                raise ValueError(f"policy loss {name!r} returned metric {key!r} of shape {tuple(value.shape)}; it must return "
                                 f"{_LOSS_CONTRACT} (reduce it, e.g. with .mean() over the response tokens)")
        elif not isinstance(value, numbers.Real):
            raise TypeError(f"policy loss {name!r} returned metric {key!r} that is {_describe(value)}; it must return {_LOSS_CONTRACT}")
    return loss, metrics


@contextlib.contextmanager
def _quiet_temperature_warning(where: str):
    """Silence ``where``'s explicit-temperature warning inside update, which gave its own."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(where) + r": temperature=", category=RuntimeWarning)
        yield


def _resolve_kl(kl) -> tuple[str | Callable | None, float]:
    if kl is None:
        return None, 0.0
    if isinstance(kl, (int, float)) and not isinstance(kl, bool):
        mode, coef = "low_var_kl", kl
    elif isinstance(kl, tuple) and len(kl) == 2:
        mode, coef = kl
    else:
        raise TypeError(f"kl must be None, a coefficient, or (mode, coef) such as ('low_var_kl', 1e-3); got {kl!r}")
    try:
        coef = float(coef)
    except (TypeError, ValueError):
        raise TypeError(f"kl's coefficient must be a number, got {coef!r}; e.g. kl=('low_var_kl', 1e-3)") from None
    if not math.isfinite(coef) or coef < 0:
        # a negative coefficient would reward moving away from the reference; NaN would poison every loss
        raise ValueError(f"kl's coefficient must be a finite number >= 0, got {coef}; 0 or kl=None turns the penalty off")
    check_kl_fn(mode)  # a misspelt name or a function of another signature, before any pass runs
    return mode, coef


def _finite_coef(value: Any, name: str, meaning: str, default: float, *, minimum: float | None = None) -> float:
    """``value`` as a float: a real number or a one-element tensor (what the recipes take), finite
    and ``>= minimum``; else a ``ValueError`` naming ``name``. A string ("0.01" from a config file)
    failed inside the loss with "only integer tensors of a single element can be converted to an
    index", after the passes before it had run."""
    number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool else value
    if not is_real(number) or not math.isfinite(number) or (minimum is not None and number < minimum):
        need = "a finite number" + ("" if minimum is None else f" >= {minimum:g}")
        example = default
        if isinstance(value, str):
            given = f"the str {value!r}"
            with contextlib.suppress(ValueError):
                parsed = float(value)
                if math.isfinite(parsed) and (minimum is None or parsed >= minimum):
                    example = parsed  # the number the string spells
        else:
            given = repr(value)
        fix = "pass a number" if isinstance(value, str) else "for instance"
        raise ValueError(f"{name} must be {need} ({meaning}), got {given}; {fix}: {name}={example:g}")
    return float(number)


def _dropout_note(model: torch.nn.Module) -> str:
    """For the log-prob gap warnings: the dropout ``model`` applies in train mode, the mode of the
    update's forward (:func:`rlkit.models.build.active_dropout`, the detector of rk.init's warning),
    as a sentence; ``""`` when none. Train-mode dropout makes every pass's log-probs differ, so
    the gap then measures dropout noise, not a stale engine or stale old log-probs."""
    from rlkit.models.build import active_dropout

    modules, fields = active_dropout(model) if model.training else ([], [])
    if not modules and not fields:
        return ""
    where = []
    if modules:
        where.append(f"{len(modules)} dropout module(s), e.g. {modules[0]}")
    if fields:
        where.append(f"attention dropout in its config ({', '.join(fields)})")
    return (f". The actor applies dropout in train mode ({'; '.join(where)}), the mode of the update's forward: each pass's "
            "log-probs differ, so this gap measures dropout noise, not the engine or the old log-probs. "
            "rk.models.disable_dropout(model) before rk.init turns it off")


def _warn_logprob_gaps(metrics: Mapping[str, float], max_logprob_gap: float | None, step: int, temperature: Any,
                       actor: torch.nn.Module) -> None:
    """The two gap warnings of :func:`update`, each only when its metric was measured."""
    if max_logprob_gap is None:
        return
    old_gap, gap = metrics.get("actor/old_logprob_gap"), metrics.get("actor/logprob_gap")
    old_over = old_gap is not None and old_gap > max_logprob_gap
    over = gap is not None and gap > max_logprob_gap
    note = _dropout_note(actor) if old_over or over else ""
    if old_over:
        warnings.warn(
            f"rlkit.update: at step {step} the batch's old_logprobs differ from the current policy's log-probs by "
            f"{old_gap:.3g} per token on average (threshold {max_logprob_gap}) on the first "
            "mini-batch, before any optimizer step, where the ratio should be 1 (on-policy): they were computed at "
            f"another temperature (this update's is {temperature}; rk.compute_old_logprobs(state, batch) without "
            "temperature uses the batch's) or from another policy version. Recompute them with rk.compute_old_logprobs "
            f"right before the update, at its temperature{note}",
            RuntimeWarning, stacklevel=3,
        )
    if over:
        warnings.warn(
            f"rlkit.update: at step {step} the trainer's log-probs differ from the rollout's by "
            f"{gap:.3g} per token on average (threshold {max_logprob_gap}); the rollout "
            f"engine may be stale, sampled at another temperature, or numerically off (this update's temperature is "
            f"{temperature}: check update(temperature=...) matches rollout(temperature=...), or leave it None to use the "
            f"batch's recorded one){note}",
            RuntimeWarning, stacklevel=3,
        )


def _carry_new_state(exc: BaseException, new_state: TrainState, metrics: Mapping[str, float] | None) -> None:
    """Put a finished update's new state (and its metrics, when complete) on an exception raised
    while it reported, the input having been donated to that state: as ``exc.state`` and
    ``exc.metrics``, the names :func:`rlkit.fit` uses for its progress."""
    try:
        exc.state, exc.metrics = new_state, (dict(metrics) if metrics is not None else None)
    except Exception:  # noqa: BLE001 - an exception type without a __dict__: leave it as it is
        return
    if hasattr(exc, "add_note"):
        exc.add_note(
            f"rk.update had finished step {new_state.step - 1} when this was raised: the state passed in was donated to "
            "the new one, which the exception carries as exc.state (its metrics as exc.metrics; in a notebook: "
            "import sys; state = sys.last_value.state)"
        )


def _dp(state: TrainState):
    return state._cache.get("dp")


def _global_sum(x: torch.Tensor, state: TrainState) -> torch.Tensor:
    dp = _dp(state)
    if dp is None:
        return x
    from rlkit.parallel.fsdp import global_sum

    return global_sum(x, dp.mesh)


def _check_sizes(b: int, mini: int | None, micro: int | None) -> tuple[int, int]:
    for name, value in (("mini_batch_size", mini), ("micro_batch_size", micro)):
        if value is not None:
            int_at_least(value, name, 1, " or None (the whole batch)")
    mini = mini or b
    # micro_batch_size bounds the rows of one forward/backward (a memory knob): a mini-batch
    # smaller than it (e.g. this rank's share under data parallelism) runs in one piece
    micro = min(micro, mini) if micro else mini
    if mini <= 0 or micro <= 0:
        raise ValueError(f"mini_batch_size and micro_batch_size must be positive, got {mini} and {micro}")
    if b % mini:
        raise ValueError(f"mini_batch_size={mini} does not divide the batch of {b} rows; pick a divisor of {b} (or None for one step per batch)")
    # micro need not divide mini: every micro-batch's loss is normalised by the mini-batch's counts,
    # so a shorter last micro-batch computes the same gradient (it was refused, and DAPO, whose
    # filtered batches change size, silently ran whole mini-batches in one piece instead)
    return mini, micro


def update(
    state: TrainState,
    batch: Batch,
    *,
    loss: LossSpec = "ppo_clip",
    loss_kw: Mapping[str, Any] | None = None,
    agg: str | None = None,
    horizon: int | None = None,
    kl: tuple | float | None = None,
    entropy_coef: float = 0.0,
    temperature: float | None = None,
    mini_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    epochs: int = 1,
    shuffle: bool = False,
    max_grad_norm: float | None = 1.0,
    value_clip: float | None = 0.5,
    critic_coef: float = 1.0,
    max_nonfinite_steps: int = 3,
    max_logprob_gap: float | None = 0.5,
    old: str = "batch",
    loss_scale_growth_interval: int = LOSS_SCALE_GROWTH_INTERVAL,
) -> tuple[TrainState, dict[str, float]]:
    """One update of the actor (and the critic if the state has one and the batch has ``returns``).

    Args:
        loss: policy loss name (``rlkit.algos.POLICY_LOSSES``), callable, or ``(name, kwargs)``.
        loss_kw: hyperparameters of the loss (``clip_ratio_high=0.28`` for DAPO, ...).
        agg: loss aggregation mode ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
            "seq-mean-token-sum-norm"); None uses the loss's own default (token-mean, except
            GSPO's seq-mean-token-mean), and token-mean for the KL and entropy terms.
        horizon: the constant token-sum normaliser of ``"seq-mean-token-sum-norm"`` (Dr. GRPO;
            verl's ``loss_scale_factor``), e.g. the rollout's ``max_new_tokens``: an int >= the
            batch's response width. None: the batch's response width, which changes the loss
            and gradient scale with each batch's padding (the longest response of the batch).
            The recipes pass their ``max_new_tokens`` when they use that aggregation.
        kl: ``(mode, coef)`` KL-to-reference penalty in the loss, e.g. ``("low_var_kl", 1e-3)``;
            uses ``batch["ref_logprobs"]`` or computes it with ``state.ref``.
        entropy_coef: entropy bonus coefficient, a finite number (0: no entropy bonus).
        temperature: the temperature of the trainer's log-probs (logits are divided by it, as
            verl does). None (the default): the one the batch's log-probs were sampled at, its
            ``temperature`` column (:func:`rlkit.rollout` records it; every row must agree, else a
            ``ValueError`` asks for an explicit one), or 1.0 for a batch without it (``make_batch``).
            An explicit temperature that differs from the recorded one warns (``RuntimeWarning``):
            the ratio is then not 1 on-policy.
        mini_batch_size / micro_batch_size / epochs / shuffle: PPO-style multi-step updates
            (positive ints; None for the sizes: the whole batch).
        max_grad_norm: gradient clipping (None: off), of the actor and the critic each.
        value_clip: PPO's value clipping, ``cliprange_value`` (None: off): the critic's new
            values are clipped to within it of the batch's ``values``.
        critic_coef: the weight of the critic's value loss, a finite number >= 0.
        max_nonfinite_steps: a mini-batch whose loss or gradient is not finite skips its
            optimizer step with a warning (``actor/skipped_steps``, ``critic/skipped_steps``);
            this many in a row (counted across updates, in ``state.extras``, for the actor and
            the critic apart) raise :class:`NonFiniteError`. Under float16 loss scaling (below) a
            non-finite gradient from a finite loss is the scale's overflow, not one of these.
        max_logprob_gap: warn when the mean |train - rollout| log-prob gap exceeds it (a
            stale engine, a wrong temperature, a numerics mismatch, or train-mode dropout in the
            actor, which the warning then names); a finite number > 0, or None: never. The gap is
            measured over the rows whose ``logprobs`` are of the unfiltered policy only (rows
            marked ``logprobs_filtered``, sampled with top-k/top-p, differ by design). When the
            ratio's old log-probs are the batch's ``old_logprobs``, the mean |train - old| gap
            (``actor/old_logprob_gap``) is measured too and warns above the same threshold: on
            the first mini-batch, before any step, they should agree (a recompute at another
            temperature, or from another policy version, does not).
        old: where the old-policy log-probs of the ratio come from. ``"batch"``:
            ``batch["old_logprobs"]`` (from :func:`rlkit.compute_old_logprobs`), else
            the rollout's ``batch["logprobs"]``; except on rows marked ``logprobs_filtered``
            (:func:`rlkit.rollout` with ``top_k > 0`` or ``top_p < 1``), whose rollout log-probs
            are of the filtered distribution ``log softmax(top_p(top_k(logits / T)))`` while the
            update's are of ``log softmax(logits / T)``: without ``old_logprobs``, those rows' old
            log-probs are computed first with the trainer's forward
            (:func:`rlkit.compute_old_logprobs`, with this ``temperature`` and
            ``micro_batch_size``; verl's recompute), so the ratio is 1 before the first optimizer
            step. ``"current"``: this update's own forward,
            detached. That is exact only while the policy has not moved, i.e. for an update of
            one optimizer step (``epochs=1``, one mini-batch); then it equals a separate
            old-policy pass and saves it (TRL's GRPOTrainer does the same for one iteration).
        loss_scale_growth_interval: float16 loss scaling (below): the finite optimizer steps in a
            row after which the scale doubles, a positive int. 2000, torch's GradScaler's: the scale
            only has to grow back after an overflow halved it, a halved scale still keeps
            gradients down to 6e-8 / scale, and each attempt that overshoots skips a whole
            mini-batch of rollouts, dearer in RL than a supervised batch.

    float16 loss scaling: when the actor (the critic, when it trains) holds float16 parameters,
    trained or frozen (float32 adapters on a frozen float16 base too), each micro-batch's loss is multiplied by the role's loss scale ``S``
    (:class:`LossScale`, from ``state.extras["loss_scale/actor"]``, 2**16 at first) before
    backward, and the gradients are divided by ``S`` before clipping and the optimizer step
    (float32 gradients for an optimizer with master weights, the default; see
    :func:`_unscaled_gradients`), so clipping, ``actor/grad_norm`` and the step see the true
    gradients. A mini-batch whose loss is finite but whose gradients are not has overflowed the
    scale: its step is skipped silently, ``S`` halves (the next mini-batch uses the new scale),
    ``actor/loss_scale_overflows`` counts it, and it counts neither in ``actor/skipped_steps`` nor
    towards ``max_nonfinite_steps`` (the streak neither grows nor resets: overflows are how the
    scale finds its level). A non-finite loss is not the scale's doing and takes the path above
    (warning, streak, :class:`NonFiniteError`), leaving ``S`` as it is; so does an overflow at
    ``S = 1``, where nothing is scaled any more. ``loss_scale_growth_interval`` finite steps in a
    row double ``S`` (up to 2**24). Under data parallelism the gradient norm is global and the
    losses' finiteness is agreed by a collective, so every rank skips or steps, and scales, alike.
    The metrics add ``actor/loss_scale`` (the scale after the update, the next one's) and
    ``actor/loss_scale_overflows``, and the same for the critic, only when scaling is on; the
    reported grad norm averages over the steps that did not overflow.

    A policy loss (a callable of your own included) returns ``(loss, metrics)``: ``loss`` a 0-d
    tensor, ``metrics`` a dict of 0-d tensors or numbers (``{}`` for none); anything else is a
    ``TypeError``/``ValueError`` naming the loss. Its metrics are reported as ``actor/<name>``:
    each a token-weighted mean over the micro-batches (and data-parallel ranks) of a mini-batch,
    averaged over mini-batches, except names ending in ``_max`` / ``_min``, which report the
    largest / smallest value over all of them.

    Returns ``(new_state, metrics)`` with loss parts, clip fraction, approx KL (``actor/approx_kl``:
    the new policy against the old, PPO's), entropy (``actor/entropy``) and, with a KL penalty, the
    KL to the reference (``actor/kl``; ``actor/kl_loss`` is the loss term), the last two token means
    whatever ``agg`` (the loss terms use ``agg``: Dr. GRPO's divides a sum by the horizon), grad
    norm, learning rate and the train-vs-rollout log-prob gap (``actor/logprob_gap`` and
    ``actor/logprob_gap_max``, over the first mini-batch's unfiltered rows, before any step;
    absent when the batch has no ``logprobs`` or every row measured is ``logprobs_filtered``),
    and ``actor/old_logprob_gap`` (the same mean against the batch's ``old_logprobs``, when the
    ratio uses them);
    loss parts and ratio metrics average over the mini-batches trained (one without a response
    token is skipped). The step count is ``new_state.step``, not a metric.

    Every argument, and the batch (at least one row, each row within the model's context), is
    checked before any work (a loss's own options when it first runs, still before any optimizer
    step), so a bad one leaves ``state`` unchanged and usable. The gap warnings
    are emitted once the update is complete and ``state`` donated to the new state: raised as
    errors (``warnings.simplefilter("error")``), they carry it as ``exc.state`` (see the module
    docstring), so the step's work is not lost.
    """
    from rlkit.models.logprobs import response_logprobs, to_device, values_for_response

    if not isinstance(state, TrainState):
        raise TypeError(f"update expects a TrainState first (from rk.init), got {type(state).__name__}")
    state._check()
    validate(batch, require=("prompt_ids", "prompt_mask", "response_ids", "response_mask", "advantages"))
    check_token_ids(batch, state.actor, "update")
    # every argument before any work: one refused after the first optimizer step (max_logprob_gap
    # was compared only at the end) donated the state as unfinished and lost the step
    int_at_least(epochs, "epochs", 1, " (passes over the batch)")
    shuffle = check_switch(shuffle, "shuffle", "True: each epoch's mini-batches from a new random order of the rows")
    for size_name, size in (("mini_batch_size", mini_batch_size), ("micro_batch_size", micro_batch_size)):
        if size is not None:
            int_at_least(size, size_name, 1, " or None (the whole batch)")
    entropy_coef = _finite_coef(entropy_coef, "entropy_coef", "0: no entropy bonus", 0.0)
    # a negative weight would train the critic away from the returns
    critic_coef = _finite_coef(critic_coef, "critic_coef", "the value loss's weight", 1.0, minimum=0.0)
    positive_finite_or_none(max_logprob_gap, "max_logprob_gap", "never warn")
    # a YAML string failed at the first skipped step, after the state was donated
    int_at_least(max_nonfinite_steps, "max_nonfinite_steps", 1, " (skipped steps in a row before NonFiniteError)")
    int_at_least(loss_scale_growth_interval, "loss_scale_growth_interval", 1,
                 f" (finite float16 steps in a row before the loss scale doubles; GradScaler's is {LOSS_SCALE_GROWTH_INTERVAL})")
    check_batch_context(state.actor, batch, "rk.update")
    keys = set(batch.keys())
    old_key = "old_logprobs" if "old_logprobs" in keys else "logprobs"
    if old not in ("batch", "current"):
        raise ValueError(f"old must be 'batch' or 'current', got {old!r}")
    if old == "current":
        b0 = batch.batch_size[0]
        if epochs != 1 or (mini_batch_size is not None and mini_batch_size < b0):
            raise ValueError(
                f"old='current' takes the old-policy log-probs from this update's own forward, which is exact only "
                f"for one optimizer step; this update takes {epochs} epoch(s) of mini-batches of {mini_batch_size} "
                f"from {b0} rows. Use epochs=1 and mini_batch_size=None, or old='batch' with compute_old_logprobs"
            )
    elif old_key not in keys:
        raise BatchError("batch has neither 'old_logprobs' nor 'logprobs'; batches from rk.rollout carry logprobs, or call rk.compute_old_logprobs(state, batch)")
    width = batch["response_mask"].shape[-1]
    if horizon is not None:
        int_at_least(horizon, "horizon", 1, " or None (the batch's response width)")
        if horizon < width:
            raise ValueError(
                f"horizon={horizon} is below the batch's response width {width}: Dr. GRPO's constant normaliser must be at "
                f"least the longest possible response; pass the rollout's max_new_tokens (>= {width}), or None for the batch's width"
            )
    positive_finite_or_none(max_grad_norm, "max_grad_norm", "no clipping")
    positive_finite_or_none(value_clip, "value_clip", "no value clipping")  # -1 clipped the critic's targets into nonsense
    loss_fn, loss_kw, wants_generator, loss_accepts = _resolve_loss(loss, loss_kw, agg)
    kl_mode, kl_coef = _resolve_kl(kl)
    from rlkit.transforms.forward import resolve_temperature

    # None: the temperature the batch's log-probs were sampled at (its "temperature" column, 1.0 without one)
    temperature = resolve_temperature(
        batch, temperature, "rlkit.update",
        mismatch="the trainer's log-probs will be at another temperature than the policy that sampled the rows, so "
                 "the ratio will not be 1 on-policy",
    )
    from rlkit.models.logprobs import _check_temperature

    _check_temperature(temperature)  # here, not at the first forward: compute_ref_logprobs may run first
    if kl_coef and "ref_logprobs" not in keys:
        from rlkit.transforms.forward import compute_ref_logprobs

        with _quiet_temperature_warning("rk.compute_ref_logprobs"):  # update warned about its temperature above
            batch = compute_ref_logprobs(state, batch, temperature=temperature, micro_batch_size=micro_batch_size)
    train_critic = state.critic is not None and "returns" in keys
    # float16 roles' loss scales (None: not float16, trained unscaled); read, and checked, before any work
    actor_scale = _loss_scale(state, "actor", state.actor)
    critic_scale = _loss_scale(state, "critic", state.critic) if train_critic else None
    if train_critic and "values" not in keys:
        from rlkit.transforms.forward import compute_values

        batch = compute_values(state, batch, micro_batch_size=micro_batch_size)

    dp = _dp(state)
    shard = None
    if dp is not None and dp.size > 1:
        # data parallel: mini-batches (and their shuffle) are formed over the global batch, as one
        # process forms them, and this rank trains on its contiguous rows of each. Sharding the
        # batch first made mini-batch 0 rows {0, 1, 4, 5} of 8 on 2 ranks, not rows 0-3, and each
        # rank shuffled only its own half: 2 processes did not compute what 1 does
        from rlkit.parallel.placement import shard_rows

        if mini_batch_size and mini_batch_size % dp.size:
            raise ValueError(f"mini_batch_size={mini_batch_size} must be divisible by the {dp.size} data-parallel ranks")
        shard_rows(batch, dp.mesh)  # raises when the rows do not split evenly over the ranks
        shard = functools.partial(shard_rows, mesh=dp.mesh)
    split = state._cache.get("split")
    if split is not None and torch.distributed.get_rank() not in split.actor_ranks:
        # split placement, a generation rank: the actor ranks train; receive their metrics
        payload: list = [None]
        torch.distributed.broadcast_object_list(payload, src=split.actor_ranks[0])
        metrics = payload[0]
        new_state = state.replace(step=state.step + 1, policy_version=state.policy_version + int(metrics.pop("_stepped")))
        state.donate("rlkit.update", new_state)
        return new_state, metrics
    if old == "batch" and old_key == "logprobs" and FILTERED in keys:
        # top-k/top-p rows: their rollout log-probs are of the filtered distribution, not of the
        # policy this update differentiates; the trainer's own old-policy pass replaces them
        with _quiet_temperature_warning("rk.compute_old_logprobs"):  # update warned about its temperature above
            batch = _recompute_filtered(state, batch, temperature, micro_batch_size)
        old_key = "old_logprobs" if "old_logprobs" in batch.keys() else "logprobs"  # no row marked: the rollout's
    # only the tensors the loss reads: slicing and moving text columns (lazy stacks of strings)
    # cost milliseconds per micro-batch
    loss_fields = _loss_fields(loss_fn, loss_accepts, batch, loss_kw)
    used = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "advantages", "old_logprobs", "logprobs",
            "ref_logprobs", "values", "returns", FILTERED, *loss_fields)
    present = set(batch.keys())
    batch = batch.select(*dict.fromkeys(k for k in used if k in present))
    b = batch.batch_size[0]
    horizon = width if horizon is None else int(horizon)
    term_agg = agg or "token-mean"
    agg_kw = {} if agg is None else {"agg": agg}
    mini, micro = _check_sizes(b, mini_batch_size, micro_batch_size)
    actor, optimizer = state.actor, state.optimizer
    actor_module = state._cache.get("actor_module", actor)
    critic_module = state._cache.get("critic_module", state.critic)
    device = module_device(actor)
    actor.train()
    grad_scale = float(dp.size) if dp is not None and dp.mean_reduce else 1.0
    # rows of one mini-batch on this rank (micro_batch_size bounds this rank's forward/backward)
    local_mini = mini // dp.size if shard is not None else mini
    micro = min(micro, local_mini)
    parts = -(-local_mini // micro)  # micro-batches per mini-batch on this rank
    _warn_local_normaliser(loss_fn, loss_accepts, agg, parts=parts, ranks=dp.size if shard is not None else 1, micro=micro,
                           mini=mini, horizon_differs=horizon != width)
    _warn_per_call_selection(loss_fn, parts=parts, micro=micro)

    # metrics stay on the device (float64) until one transfer at the end: a float() per metric
    # per micro-batch would make the host wait for the GPU before every backward
    sums: dict[str, torch.Tensor | float] = {}
    weights: dict[str, float] = {}

    # a loss's metrics named *_max / *_min: the extreme over micro-batches, mini-batches and ranks
    # (a token-weighted mean of per-micro-batch maxima is no maximum: 2.95 reported where it was 3.0)
    extremes: dict[str, str] = {}

    def record(name: str, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0):
        v = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
        sums[name] = sums.get(name, 0.0) + v * weight
        if not isinstance(weight, torch.Tensor):
            weights[name] = weights.get(name, 0.0) + weight

    def record_loss_metric(name: str, value: torch.Tensor | float, weight: torch.Tensor | float):
        kind = _extreme_kind(name)
        if kind is None:
            record(name, value, weight)
            return
        v = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value, dtype=torch.float64, device=device)
        extremes[name] = kind
        sums[name] = v if name not in sums else (torch.maximum if kind == "max" else torch.minimum)(sums[name], v)

    # each trained role's step-or-skip after a mini-batch, its loss scale and what it counts (the
    # streaks go on from the previous update's); from the first optimizer step on, parameters and
    # optimizer moments change in place (``in_place``): an exception after it (Ctrl-C included)
    # leaves the input neither the state before the update nor one after it, and it used to stay
    # usable (rk.fit handed it back as "the state after step N"). It is donated then, with a reason
    # saying so
    critic_streak = int(state.extras.get("critic_nonfinite_streak", 0))  # read (and int()-checked) with a critic or without
    actor_step = _RoleStep(
        actor, optimizer, state.scheduler, actor_scale, int(state.extras.get("nonfinite_streak", 0)), role="actor",
        noun="", advice="lower the learning rate, check rewards/advantages for extreme values, or enable gradient clipping")
    critic_step = _RoleStep(
        state.critic, state.critic_optimizer, state.critic_scheduler, critic_scale, critic_streak, role="critic", noun="critic ",
        advice="check the returns and values for extreme values (value_clip), lower the critic's learning rate "
               "(critic_optimizer) or critic_coef, or enable gradient clipping") if train_critic else None
    roles = [actor_step] + ([critic_step] if train_critic else [])
    gap_abs = gap_max = None
    gap_tokens = 0.0  # this rank's response tokens the gap was measured over
    # the ratio's old log-probs from the batch's old_logprobs (given, not update's own recompute of
    # filtered rows): measured against the trainer's before any step, where they should agree
    measure_old = old == "batch" and "old_logprobs" in keys
    old_abs = None
    old_tokens = 0.0
    minis_trained = 0  # mini-batches that ran forward/backward (an all-empty one is skipped)
    # Pipeline.lower(grad_reduce="step"): FSDP2 reduce-scatters once per optimizer step, in the
    # last micro-batch's backward, instead of in every micro-batch's
    trained = [actor_module] + ([critic_module] if train_critic else [])
    defer_sync = dp is not None and local_mini > micro and state._cache.get("grad_reduce", "micro_batch") == "step"
    if defer_sync:
        from rlkit.parallel.fsdp import discard_unreduced_gradients, set_gradient_sync
    # the state after the update, once it is complete: an exception while it reports (a gap warning
    # raised as an error, Ctrl-C) donates the input to it, on the exception, instead of as unfinished
    new_state = None
    reported = None
    try:
        try:
            for epoch in range(epochs):
                order = torch.randperm(b, generator=state.rng("shuffle", epoch, device="cpu")) if shuffle else None
                for m0 in range(0, b, mini):
                    # unshuffled: a slice (views), not an index (a copy of every field)
                    mini_batch = batch[order[m0 : m0 + mini]] if order is not None else batch[m0 : m0 + mini]
                    if shard is not None:
                        mini_batch = shard(mini_batch)
                    mask_all = mini_batch["response_mask"]
                    # rows without any valid token do not count as sequences (verl's seq-mean-* default);
                    # both counts in one collective (whole numbers: float32 sums them exactly)
                    counts = torch.stack([mask_all.sum(), (mask_all.sum(-1) > 0).sum()]).to(torch.float32)
                    num_tokens, num_seqs = _global_sum(to_device(counts, device), state).unbind()
                    if counts[0] == 0 and (dp is None or dp.size == 1 or float(num_tokens) == 0):
                        # no response token in the mini-batch (rows built with empty responses): nothing
                        # to learn, and token means would divide by zero. Decided on the host copy (no
                        # device sync) unless other ranks may hold tokens; then every rank reads the same sum
                        continue
                    minis_trained += 1
                    optimizer.zero_grad(set_to_none=True)
                    mini_loss = 0.0  # this mini-batch's loss: a non-finite one skips its optimizer step only
                    critic_mini_loss = 0.0  # the critic's, read only under loss scaling (overflow or non-finite loss)
                    # the unscaled path multiplies by exactly what it always did: bfloat16/float32 stay bit-identical
                    actor_mult = actor_step.multiplier(grad_scale)
                    critic_mult = critic_step.multiplier(grad_scale) if train_critic else grad_scale
                    if train_critic:
                        state.critic_optimizer.zero_grad(set_to_none=True)
                    for u0 in range(0, local_mini, micro):
                        with torch.profiler.record_function("rlkit.update.micro_batch"):  # names the range in a profiler trace
                            if defer_sync:
                                for module in trained:
                                    set_gradient_sync(module, u0 + micro >= local_mini)
                            rows = mini_batch[u0 : u0 + micro]
                            # the layout from the masks where the batch lives (the CPU: no device sync), and
                            # every field copied without waiting, so the host runs ahead of the GPU
                            view = rows_view(actor_module, rows, device)
                            mb = {k: to_device(v, device) for k, v in rows.items()}
                            mask = mb["response_mask"]
                            frac = mask.sum().double() / num_tokens.double().clamp(min=1.0)
                            norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
                            logprobs, entropy = response_logprobs(
                                actor_module, mb["prompt_ids"], mb["prompt_mask"], mb["response_ids"], mask,
                                temperature=temperature, with_entropy=True, view=view,
                            )
                            extra = {"generator": state.rng("loss", epoch, m0, u0, device=device)} if wants_generator else {}
                            # a user's loss receives only the normalisers it declares
                            call_kw = {**agg_kw, **norm}
                            if loss_accepts is not None:
                                call_kw = {k: v for k, v in call_kw.items() if k in loss_accepts}
                            old_lp = logprobs.detach() if old == "current" else mb[old_key]
                            pg_loss, pg_metrics = _checked_loss_output(
                                loss_fn(logprobs, old_lp, mb["advantages"], mask, **call_kw, **loss_kw, **extra,
                                        **{k: mb[k] for k in loss_fields}), loss_fn)
                            total = pg_loss
                            record("actor/pg_loss", pg_loss, 1.0)
                            for k, v in pg_metrics.items():
                                record_loss_metric(f"actor/{k}", v, frac)
                            ent = aggregate(entropy, mask, term_agg, **norm)
                            # the metrics are token means whatever the loss's aggregation: Dr. GRPO's
                            # sum over tokens / horizon reported an "entropy" of 7.6 where ln(vocab) is 2.9
                            token_mean = term_agg == "token-mean"
                            record("actor/entropy", ent if token_mean else aggregate(entropy.detach(), mask, "token-mean", num_tokens=num_tokens), 1.0)
                            if entropy_coef:
                                total = total - entropy_coef * ent
                            if kl_coef:
                                kl_mat = kl_penalty(logprobs, mb["ref_logprobs"], kl_mode)
                                kl_loss = aggregate(kl_mat, mask, term_agg, **norm)
                                total = total + kl_coef * kl_loss
                                record("actor/kl_loss", kl_loss, 1.0)
                                record("actor/kl", kl_loss if token_mean else aggregate(kl_mat.detach(), mask, "token-mean", num_tokens=num_tokens), 1.0)
                            if "logprobs" in keys and epoch == 0 and m0 == 0:
                                # the silent bug of every peer: train-vs-rollout numerics; measured before any step
                                # rows sampled with top-k/top-p differ by design: measured over the others only
                                measured, host_measured = mask, rows["response_mask"]
                                if FILTERED in mb:
                                    measured = mask & ~mb[FILTERED].bool()[:, None]
                                    host_measured = host_measured & ~rows[FILTERED].bool()[:, None]
                                diff = (logprobs.detach() - mb["logprobs"]).abs().masked_fill(~measured, 0.0)
                                gap_abs = diff.sum().double() + (0.0 if gap_abs is None else gap_abs)
                                gap_max = diff.max().double() if gap_max is None else torch.maximum(gap_max, diff.max().double())
                                gap_tokens = gap_tokens + host_measured.sum()  # the tokens measured (shuffled or not)
                            if measure_old and epoch == 0 and m0 == 0:
                                # the old log-probs the ratio uses, against the policy before any step: a
                                # recompute at another temperature (or of another policy version) shows here
                                odiff = (logprobs.detach() - mb["old_logprobs"]).abs().masked_fill(~mask, 0.0)
                                old_abs = odiff.sum().double() + (0.0 if old_abs is None else old_abs)
                                old_tokens = old_tokens + rows["response_mask"].sum()
                            mini_loss = mini_loss + total.detach()
                            (total * actor_mult).backward()
                            if train_critic:
                                values = values_for_response(critic_module, mb["prompt_ids"], mb["prompt_mask"], mb["response_ids"], mask,
                                                             view=rows_view(critic_module, rows, device))
                                vf_loss, vf_metrics = value_loss(values, mb["values"], mb["returns"], mask, cliprange_value=value_clip, agg=term_agg, **norm)
                                (critic_coef * vf_loss * critic_mult).backward()
                                if critic_step.scale is not None:
                                    critic_mini_loss = critic_mini_loss + vf_loss.detach()
                                record("critic/vf_loss", vf_loss, 1.0)
                                for k, v in vf_metrics.items():
                                    record_loss_metric(f"critic/{k}", v, frac)
                    # under loss scaling: whether each scaled role's loss is finite on every rank (one
                    # collective), so that all ranks tell an overflow from a non-finite loss alike
                    loss_ok = _losses_finite([mini_loss if actor_step.scale is not None else None,
                                              critic_mini_loss if train_critic and critic_step.scale is not None else None],
                                             state, device)
                    where = dict(record=record, max_grad_norm=max_grad_norm, growth_interval=loss_scale_growth_interval,
                                 max_nonfinite_steps=max_nonfinite_steps, step=state.step, mini_batch=m0 // mini)
                    with torch.profiler.record_function("rlkit.update.optimizer"):
                        # this mini-batch's own loss, not the running metric sum: one bad mini-batch used to
                        # make every later one of the update look non-finite and skip its step
                        actor_step.step_or_skip(loss_ok[0], mini_loss, **where)
                    if train_critic:
                        # unscaled, the critic is judged by its gradient norm alone (its loss is summed only
                        # under loss scaling); a non-finite value loss makes a non-finite gradient anyway
                        critic_step.step_or_skip(loss_ok[1], None, **where)
        finally:
            if defer_sync:
                for module in trained:
                    # after a complete update nothing is left (the last backward reduced it); after a
                    # failure between micro-batches this keeps their gradients out of the next update
                    discard_unreduced_gradients(module)

        new_state = state.replace(
            step=state.step + 1,
            policy_version=state.policy_version + (1 if actor_step.steps else 0),
            extras={**state.extras, "nonfinite_streak": actor_step.streak,
                    **({"critic_nonfinite_streak": critic_step.streak} if train_critic else {}),
                    **{k: v for r in roles if r.scale is not None for k, v in r.scale.extras(r.role).items()}},
        )
        # the mini-batches that recorded metrics: an all-empty one skipped above recorded none, and
        # counting it (epochs * b // mini) diluted every average
        n_steps = max(minis_trained, 1)
        # one device-to-host transfer for every metric
        on_device = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
        gaps = {k: v for k, v in (("gap_abs", gap_abs), ("gap_max", gap_max), ("old_abs", old_abs)) if isinstance(v, torch.Tensor)}
        if on_device or gaps:
            host = torch.stack([sums[k].to(device) for k in on_device] + [x.to(device) for x in gaps.values()]).tolist()
            sums.update(zip(on_device, host[: len(on_device)]))
            read = dict(zip(gaps, host[len(on_device) :]))
            gap_abs, gap_max, old_abs = read.get("gap_abs", gap_abs), read.get("gap_max", gap_max), read.get("old_abs", old_abs)
        # loss parts are already normalised per mini-batch (summed over its micro-batches) and ratio
        # metrics are token-weighted fractions of each mini-batch: both average over optimizer steps
        metrics = {k: sums[k] if k in extremes else sums[k] / (weights[k] if k.endswith("grad_norm") else n_steps) for k in sums}
        # the gap's denominator: the tokens it was summed over (it was the unshuffled first mini-batch's)
        n_tok = float(gap_tokens)
        n_old = float(old_tokens)
        if dp is not None and dp.size > 1:
            metrics, gap_abs, gap_max, n_tok, old_abs, n_old = _reduce_metrics(metrics, gap_abs, gap_max, n_tok, dp, device,
                                                                            old_abs=old_abs, n_old=n_old, extremes=extremes)
        if gap_abs is not None and n_tok > 0:  # none measured: every row was logprobs_filtered
            metrics["actor/logprob_gap"] = gap_abs / n_tok
            metrics["actor/logprob_gap_max"] = gap_max
        if old_abs is not None and n_old > 0:
            metrics["actor/old_logprob_gap"] = old_abs / n_old
        # the rate the (last) optimizer step of this update used; it reported the next step's, and at a
        # schedule's end a rate never applied
        metrics["actor/lr"] = actor_step.lr_used if actor_step.lr_used is not None else state.lr
        for r in roles:
            metrics[f"{r.role}/skipped_steps"] = float(r.skipped)
        # after _reduce_metrics, which sums over ranks: every rank holds the same scale
        for r in roles:
            if r.scale is not None:
                metrics[f"{r.role}/loss_scale"] = r.scale.scale
                metrics[f"{r.role}/loss_scale_overflows"] = float(r.overflows)
        # no "step" metric: the step is the state's (new_state.step), and sinks log it as their own
        # step argument; as a float metric it shadowed that step in the rows and Prometheus refused it
        if split is not None:
            payload = [{**metrics, "_stepped": 1 if actor_step.steps else 0}]
            torch.distributed.broadcast_object_list(payload, src=split.actor_ranks[0])
        reported = metrics
        # after the collectives: a warning raised as an error on every rank leaves none waiting
        _warn_logprob_gaps(metrics, max_logprob_gap, state.step, temperature, actor)
    except BaseException as e:
        if new_state is not None:
            # the update is complete (parameters, moments and schedules are the next step's); only
            # its reporting failed: the new state is consistent and the exception carries it
            state.donate("rlkit.update", new_state)
            _carry_new_state(e, new_state, reported)
        elif any(r.in_place for r in roles):
            state.donate("rlkit.update", None, reason=f"{type(e).__name__} interrupted it mid-update, after {actor_step.steps} "
                         f"optimizer step(s) of {epochs * (b // mini)}")
        raise
    state.donate("rlkit.update", new_state)
    return new_state, metrics


def _recompute_filtered(state: TrainState, batch: Batch, temperature: float, micro_batch_size: int | None) -> Batch:
    """``batch`` with ``old_logprobs``: the trainer's log-probs (:func:`rlkit.compute_old_logprobs`)
    on the rows marked ``logprobs_filtered``, the rollout's ``logprobs`` on the others. One pass
    over the marked rows (over every row under data parallelism, whose pass shards the rows);
    none when no row is marked (``batch`` returned as it is, without ``old_logprobs``)."""
    from rlkit.batch import shallow_copy
    from rlkit.transforms import forward

    flags = batch[FILTERED].bool()
    if not bool(flags.any()):
        return batch
    dp = _dp(state)
    kw = dict(temperature=temperature, micro_batch_size=micro_batch_size)
    if bool(flags.all()) or (dp is not None and dp.size > 1):
        old = forward.compute_old_logprobs(state, batch, **kw)["old_logprobs"]  # stays where it was computed, as there
        if bool(flags.all()):
            out = shallow_copy(batch)
            out.set("old_logprobs", old)
            return out
    else:
        rows = flags.nonzero().flatten()
        part = forward.compute_old_logprobs(state, batch[rows], **kw)["old_logprobs"]
        old = batch["logprobs"].to(part.device, part.dtype).clone()
        old[rows.to(part.device)] = part
    lp = batch["logprobs"].to(old.device, old.dtype)
    out = shallow_copy(batch)
    out.set("old_logprobs", torch.where(flags.to(old.device)[:, None], old, lp))
    return out


def _extreme_kind(name: str) -> str | None:
    """``"max"`` / ``"min"`` for a loss metric named ``*_max`` / ``*_min`` (reduced as such over
    micro-batches, mini-batches and ranks), else None (a token-weighted mean)."""
    return "max" if name.endswith("_max") else "min" if name.endswith("_min") else None


def _reduce_metrics(metrics, gap_abs, gap_max, n_tok, dp, device, *, old_abs=None, n_old=0.0, extremes=None):
    """Sum the per-rank parts of the metrics (losses are normalised by global counts, so their
    per-rank values add up to the global value); grad norms are already global; ``extremes``
    (name -> "max"/"min") are reduced by their kind. Returns ``(metrics, gap_abs, gap_max, n_tok,
    old_abs, n_old)``, the gaps' sums and counts global."""
    extremes = extremes or {}
    keys = sorted(k for k in metrics if not k.endswith("grad_norm"))
    packed = torch.tensor([metrics[k] for k in keys] + [old_abs or 0.0, n_old, gap_abs or 0.0, n_tok, gap_max or 0.0],
                          dtype=torch.float64, device=device)
    # one gather, reduced here (sums, and the max of the gap): a handful of scalars, where an
    # all-reduce for the sums and another for the max cost a collective each
    size = torch.distributed.get_world_size(dp.group)
    everyone = packed.new_empty(size * packed.numel())
    from rlkit.parallel.reshard import all_gather_flat

    all_gather_flat(everyone, packed, dp.group)
    everyone = everyone.view(size, -1)
    sums = everyone[:, :-1].sum(0).tolist()
    out = dict(metrics)
    out.update({k: float(v) for k, v in zip(keys, sums[: len(keys)])})
    for i, k in enumerate(keys):
        if k in extremes:
            out[k] = float(everyone[:, i].max() if extremes[k] == "max" else everyone[:, i].min())
    if gap_abs is not None:
        gap_max = float(everyone[:, -1].max())
        gap_abs = float(sums[-2])
    if old_abs is not None:
        old_abs = float(sums[-4])
    return out, gap_abs, gap_max, float(sums[-1]), old_abs, float(sums[-3])


def _clip(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor | float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm is None:
        norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm  # a 0-d tensor on the device: update reads it with the other metrics


def _maybe_unscaled(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scale: LossScale | None):
    """:func:`_unscaled_gradients` of ``model`` under loss scaling, else nothing."""
    return contextlib.nullcontext() if scale is None else _unscaled_gradients(model, optimizer, scale.scale)


@dataclasses.dataclass
class _RoleStep:
    """One trained role's optimizer step or skip after each mini-batch of :func:`update`, and its
    counts over the update. The actor and the critic follow the same rules (clip, tell a finite
    step from a float16 overflow from a non-finite loss or gradient, then step, or skip and count),
    and differ only in their names, their advice and which loss the unscaled check reads; one copy
    of the rules keeps the two from drifting apart (the critic's non-finite steps were once skipped
    silently, with no streak, while the actor's warned and raised)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    #: the role's float16 loss scale, moved on by every step or skip; None: trained unscaled
    scale: LossScale | None
    #: non-finite steps skipped in a row, carried across updates in ``state.extras``
    streak: int
    role: str  # "actor" or "critic": the metrics' and extras' prefix
    noun: str  # "" or "critic ": where the warning and NonFiniteError name the role
    advice: str  # NonFiniteError's fix for this role
    skipped: int = 0  # steps skipped for a non-finite loss or gradient (``<role>/skipped_steps``)
    overflows: int = 0  # steps skipped because the loss scale overflowed (``<role>/loss_scale_overflows``)
    steps: int = 0  # optimizer steps taken
    lr_used: float | None = None  # the learning rate of the last step (the scheduler moves it on after)
    #: set just before the first optimizer step: from there on parameters and moments change in
    #: place, and an exception (inside the step too) leaves the input state neither old nor new
    in_place: bool = False

    def multiplier(self, grad_scale: float) -> float:
        """What the role's micro-batch losses are multiplied by before backward: unscaled, exactly
        what it always was (``grad_scale``), so bfloat16/float32 updates stay bit-identical."""
        return grad_scale * self.scale.scale if self.scale is not None else grad_scale

    def step_or_skip(self, loss_ok: bool, loss, *, record: Callable, max_grad_norm: float | None, growth_interval: int,
                     max_nonfinite_steps: int, step: int, mini_batch: int) -> None:
        """After a mini-batch's backward: clip the role's (unscaled) gradients, record their norm, and
        step; or skip, either an overflow of the loss scale (halved, silently) or a non-finite loss
        or gradient (warned, counted in the streak; ``max_nonfinite_steps`` of them in a row raise
        :class:`NonFiniteError`). ``loss_ok``: whether the mini-batch's loss is finite on every rank
        (:func:`_losses_finite`), read under loss scaling, where it tells an overflow from a
        non-finite loss. ``loss``: the mini-batch's loss, read unscaled (None: the role is judged by
        its gradient norm alone)."""
        with _maybe_unscaled(self.model, self.optimizer, self.scale):
            norm = _clip(self.model, max_grad_norm)
            if self.scale is None:
                finite = torch.isfinite(torch.as_tensor(norm))
                if loss is not None:
                    finite = finite & torch.isfinite(torch.as_tensor(loss))
                finite, overflow = bool(finite), False
            else:
                finite = loss_ok and bool(torch.isfinite(torch.as_tensor(norm)))
                # at the smallest scale nothing is scaled any more: a non-finite step like any other
                overflow = not finite and loss_ok and self.scale.scale > LOSS_SCALE_MIN
            if not overflow:  # an overflow's norm is inf: it would make the update's average inf
                record(f"{self.role}/grad_norm", norm)
            if finite:
                self.lr_used = self.optimizer.param_groups[0]["lr"]  # the scheduler moves it on below
                self.in_place = True
                self.optimizer.step()
                self.scheduler.step()
                self.streak = 0
                self.steps += 1
                if self.scale is not None:
                    self.scale = self.scale.stepped(growth_interval)
            elif overflow:
                # the scale's business, not the model's: halve it and skip, silently
                self.optimizer.zero_grad(set_to_none=True)
                self.overflows += 1
                self.scale = self.scale.overflowed()
            else:
                self.optimizer.zero_grad(set_to_none=True)
                self.skipped += 1
                self.streak += 1
                if self.scale is not None:
                    self.scale = self.scale.skipped()
                # stacklevel 3: update's caller, as when update warned itself
                warnings.warn(f"rlkit.update: non-finite {self.noun}loss or gradient at step {step} (mini-batch {mini_batch}); "
                              f"{self.noun}optimizer step skipped ({self.streak} in a row)", RuntimeWarning, stacklevel=3)
                if self.streak >= max_nonfinite_steps:
                    raise NonFiniteError(f"{self.streak} consecutive updates had a non-finite {self.noun}loss or gradient "
                                         f"(last at step {step}); {self.advice}")


def _losses_finite(losses: list, state: TrainState, device: torch.device) -> list[bool]:
    """Whether each of ``losses`` (0-d tensors or numbers; None: not asked, answered True) is finite
    on every data-parallel rank. Loss scaling tells an overflow (finite loss, non-finite gradient)
    from a non-finite loss by it; the gradient norm is already global, but a loss is this rank's
    part, and ranks that told them apart differently would scale differently, and one would raise
    NonFiniteError while the others waited in a collective. No work without loss scaling."""
    asked = [i for i, loss in enumerate(losses) if loss is not None]
    answers = [True] * len(losses)
    if not asked:
        return answers
    bad = torch.stack([(~torch.isfinite(torch.as_tensor(losses[i], device=device))).to(torch.float32) for i in asked])
    dp = _dp(state)
    if dp is not None and dp.size > 1:
        bad = _global_sum(bad, state)
    for i, flag in zip(asked, bad.tolist()):
        answers[i] = flag == 0
    return answers
