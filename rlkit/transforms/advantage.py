"""``advantage(batch, estimator, **kw) -> Batch``: fill ``advantages (b t)`` and ``returns (b t)``.

``estimator`` is a registered name (``rlkit.algos.ADVANTAGE_ESTIMATORS``: "grpo", "drgrpo",
"gae", "rloo", "reinforce++", ...) or your own function. The function receives, by keyword,
only the batch fields its signature names — ``token_rewards``, ``response_mask``, ``group``,
``values``, ``reward_baselines`` — plus ``**kw``, and returns ``(advantages, returns)``.

``token_rewards (b t)`` is the batch's own field when present (KL-in-reward, per-token shaping);
otherwise the sequence reward ``rewards (b)`` is placed on the last response token, as verl does
(a row with no response token may only carry reward 0; see :func:`sequence_to_token_rewards`).
Those derived token rewards are not added to the returned batch, so calling ``advantage`` again
after changing ``rewards`` estimates from the new rewards.

The built-in group estimators (:func:`group_builtin`: by name, alias, function or partial) need the
same number ``n >= 2`` of samples per prompt; an estimator of your own that takes ``group`` gets
whatever grouping the batch has.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from rlkit.algos import advantages as _builtin
from rlkit.algos.advantages import ADVANTAGE_ESTIMATORS
from rlkit.batch import Batch, BatchError, group_size, shallow_copy, validate

BATCH_INPUTS = ("token_rewards", "response_mask", "group", "values", "reward_baselines")

#: built-in estimator function -> the name its messages use. These compare the samples of a
#: prompt with each other, so :func:`advantage` asks them for >= 2 samples per prompt and the same
#: number in every group (see there). Keyed by function, not name, so an alias
#: ("reinforce_plus_plus_baseline"), the function object itself (``rk.algos.advantages.grpo``) and
#: a user's own name registered to a built-in all get the checks the canonical name gets.
_GROUP_BUILTINS = {
    _builtin.grpo: "grpo",
    _builtin.drgrpo: "drgrpo",
    _builtin.rloo: "rloo",
    _builtin.opo: "opo",
    _builtin.gpg: "gpg",
    _builtin.reinforce_plus_plus_baseline: "reinforce++_baseline",
}
#: the same estimators as every name registered at import (aliases included) and as the functions;
#: :func:`group_builtin` is the test that follows later registrations and ``functools.partial``
GROUP_ESTIMATORS = frozenset(
    [n for n in ADVANTAGE_ESTIMATORS.names() if ADVANTAGE_ESTIMATORS.get(n) in _GROUP_BUILTINS] + list(_GROUP_BUILTINS)
)


def group_builtin(estimator) -> str | None:
    """The name of the built-in group estimator that ``estimator`` runs (a registered name, as
    registered now; a function; a ``functools.partial`` of either), else None. Resolved at each
    call: a ``functools.partial(grpo, epsilon=1e-4)`` (as tutorials/from_trl.md suggests) had
    skipped the n >= 2 and equal-group checks, and a user's function registered over ``"grpo"``
    was still held to them by name."""
    try:
        fn = ADVANTAGE_ESTIMATORS.get(estimator)
    except (KeyError, ValueError, TypeError):
        return None
    while isinstance(fn, functools.partial):
        fn = ADVANTAGE_ESTIMATORS.get(fn.func) if isinstance(fn.func, str) else fn.func
    try:
        return _GROUP_BUILTINS.get(fn)
    except TypeError:  # an unhashable callable of the user's own
        return None


def sequence_to_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each row's scalar reward on its last response token: (b) -> (b t).

    A row with no response token (only a hand-made batch has one: engines emit >= 1 token) has
    nowhere to put its reward. A nonzero one is refused: dropping it would silently change every
    estimator's statistics (the row would count as reward 0 in its group's mean and std), and
    the row cannot be trained on anyway. A zero reward is allowed: placing it nowhere loses
    nothing, since every estimator reads a row's reward as the sum of its token rewards, which
    is then exactly that 0.
    """
    mask = response_mask.bool()
    lost = ~mask.any(-1) & (rewards != 0)
    if lost.any():
        rows = lost.nonzero().flatten().tolist()
        raise BatchError(
            f"rows {rows[:8]} have a nonzero reward (values {rewards[rows[:8]].tolist()}) but no response token to "
            "put it on, so it would be lost; drop those rows (batch[keep]) or give each response at least one "
            "token (e.g. EOS)"
        )
    last = (mask.long().cumsum(-1) == mask.long().sum(-1, keepdim=True)) & mask
    return torch.where(last, rewards.to(torch.float32)[:, None], torch.zeros((), dtype=torch.float32, device=rewards.device))


def token_rewards_of(batch: Batch) -> torch.Tensor:
    if "token_rewards" in batch.keys():
        return batch["token_rewards"]
    validate(batch, require=("rewards",))
    return sequence_to_token_rewards(batch["rewards"], batch["response_mask"])


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(_describe(v) for v in value[:4])}{', ...' if len(value) > 4 else ''})"
    return f"a {type(value).__name__}"


def _checked_output(result, fn: Callable, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimator's ``(advantages, returns)``, each a tensor of the response mask's shape
    ``(b t)``. One tensor returned used to be unpacked along its rows: "too many values to unpack",
    or for b = 2 rows a complaint about an advantages shape (t,); a ``returns`` of another shape was
    stored unchecked and refused only later, far from the estimator."""
    name = getattr(fn, "__name__", repr(fn))
    contract = f"(advantages, returns): two tensors of the response mask's shape (b t) = {shape}"
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and all(isinstance(x, torch.Tensor) for x in result)):
        hint = " (return the advantages twice, `return adv, adv`, when there is no separate return)" if isinstance(result, torch.Tensor) else ""
        raise TypeError(f"advantage estimator {name!r} returned {_describe(result)}; it must return {contract}{hint}")
    for what, value in zip(("advantages", "returns"), result):
        if tuple(value.shape) != shape:
            raise BatchError(f"advantage estimator {name!r} returned {what} of shape {tuple(value.shape)}; it must return "
                             f"{contract}")
    return result[0], result[1]


def advantage(batch: Batch, estimator: str | Callable = "grpo", **kw) -> Batch:
    """Estimate advantages; returns a new Batch with ``advantages`` and ``returns`` set (the input
    is not modified). A batch of 0 rows is refused first (:func:`rlkit.validate`): a filter kept
    no row, and the group statistics failed on it with an IndexError."""
    validate(batch, require=("response_ids", "response_mask"))
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    params = inspect.signature(fn).parameters
    given = sorted(set(kw) & set(BATCH_INPUTS))
    if given:
        # they were passed twice (Python's "got multiple values for keyword argument 'group'"), or,
        # for an estimator's **kw, silently instead of the batch's
        where = {"token_rewards": "token_rewards (else rewards, put on each response's last token)"}
        raise TypeError(
            f"advantage: {given} are read from the batch ({', '.join(where.get(n, n) for n in given)}), not passed as "
            f"options; set them on the batch first, batch.set({given[0]!r}, tensor) (a tensor of the batch's rows), then "
            f"rk.advantage(batch, {estimator if isinstance(estimator, str) else getattr(fn, '__name__', 'estimator')!r})"
        )
    available = {
        "token_rewards": lambda: token_rewards_of(batch),
        "response_mask": lambda: batch["response_mask"],
        "group": lambda: batch["group"],
        "values": lambda: batch["values"],
        "reward_baselines": lambda: batch["reward_baselines"],
    }
    inputs = {}
    for name in BATCH_INPUTS:
        if name in params:
            if name not in ("token_rewards", "response_mask") and name not in batch.keys():
                if params[name].default is inspect.Parameter.empty:
                    validate(batch, require=(name,))
                continue
            inputs[name] = available[name]()
    builtin = group_builtin(fn)
    if builtin is not None:
        # Only the built-in group estimators are held to equal groups of n >= 2. They compute
        # verl's per-prompt statistics, which give a group of one a meaningless advantage (its raw
        # reward for rloo, s / (1 + eps) for grpo); ragged groups most often mean rows lost or
        # mislabelled on the way, and would train silently on such groups. A user's estimator
        # that takes ``group`` owns its statistics and gets any grouping (ids are arbitrary and
        # groups need not be equal: the tutorial's median baseline handles that).
        shown = estimator if isinstance(estimator, str) else builtin
        validate(batch, require=("group",))
        try:
            size = group_size(batch)
        except BatchError as e:
            raise BatchError(f"estimator {shown!r}: {e}") from None
        if size < 2:
            raise BatchError(
                f"estimator {shown!r} compares samples of the same prompt but every group has "
                f"1 sample; sample n >= 2 responses per prompt (rollout(..., n=8))"
            )
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in BATCH_INPUTS
               and n not in kw and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        # a required parameter that is neither a batch field nor an option given: Python's bare
        # "missing 1 required positional argument: 'mask'" named neither the fields nor the fix
        name = getattr(fn, "__name__", fn)
        raise TypeError(f"advantage estimator {name!r} requires {missing}, which is no batch field it can receive "
                        f"({', '.join(BATCH_INPUTS)}: passed by name) nor an option given to rk.advantage; rename "
                        f"the parameter to a batch field (e.g. response_mask for a mask), give it a default, or pass "
                        f"it: rk.advantage(batch, {name!r}, {missing[0]}=...)")
    unknown = set(kw) - set(params) if not any(p.kind is p.VAR_KEYWORD for p in params.values()) else set()
    if unknown:
        hyper = [n for n in params if n not in BATCH_INPUTS]
        raise TypeError(f"advantage estimator {getattr(fn, '__name__', fn)!r} has no option(s) {sorted(unknown)}; its options: {hyper}")
    advantages, returns = _checked_output(fn(**inputs, **kw), fn, tuple(batch["response_mask"].shape))
    out = shallow_copy(batch)
    out.set("advantages", advantages.to(torch.float32))
    out.set("returns", returns.to(torch.float32))
    # token rewards derived from ``rewards`` are not stored: stored, they were preferred at the
    # next call, and rewards changed in between (re-scored, reshaped) were silently ignored
    return out
