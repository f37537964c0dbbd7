"""``advantage(batch, estimator, **kw) -> Batch``: fill ``advantages (b t)`` and ``returns (b t)``.

``estimator`` is a registered name (``rlkit.algos.ADVANTAGE_ESTIMATORS``: "grpo", "drgrpo",
"gae", "rloo", "reinforce++", ...) or your own function. The function receives, by keyword,
only the batch fields its signature names — ``token_rewards``, ``response_mask``, ``group``,
``values``, ``reward_baselines`` — plus ``**kw``, and returns ``(advantages, returns)``.

``token_rewards (b t)`` is the batch's own field when present (KL-in-reward, per-token shaping);
otherwise the sequence reward ``rewards (b)`` is placed on the last response token, as verl does.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

from rlkit.algos.advantages import ADVANTAGE_ESTIMATORS
from rlkit.batch import Batch, BatchError, group_size, shallow_copy, validate

BATCH_INPUTS = ("token_rewards", "response_mask", "group", "values", "reward_baselines")
#: estimators that compare samples of the same prompt and so need >= 2 samples per prompt
GROUP_ESTIMATORS = {"grpo", "drgrpo", "rloo", "opo", "gpg", "reinforce++_baseline"}


def sequence_to_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each row's scalar reward on its last response token: (b) -> (b t)."""
    mask = response_mask.bool()
    last = (mask.long().cumsum(-1) == mask.long().sum(-1, keepdim=True)) & mask
    return torch.where(last, rewards.to(torch.float32)[:, None], torch.zeros((), dtype=torch.float32, device=rewards.device))


def token_rewards_of(batch: Batch) -> torch.Tensor:
    if "token_rewards" in batch.keys():
        return batch["token_rewards"]
    validate(batch, require=("rewards",))
    return sequence_to_token_rewards(batch["rewards"], batch["response_mask"])


def advantage(batch: Batch, estimator: str | Callable = "grpo", **kw) -> Batch:
    """Estimate advantages; returns a new Batch (the input is not modified)."""
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    validate(batch, require=("response_ids", "response_mask"))
    params = inspect.signature(fn).parameters
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
    if (isinstance(estimator, str) and estimator in GROUP_ESTIMATORS) or "group" in inputs:
        size = group_size(batch)
        if isinstance(estimator, str) and estimator in GROUP_ESTIMATORS and size < 2:
            raise BatchError(
                f"estimator {estimator!r} compares samples of the same prompt but every group has "
                f"1 sample; sample n >= 2 responses per prompt (rollout(..., n=8))"
            )
    unknown = set(kw) - set(params) if not any(p.kind is p.VAR_KEYWORD for p in params.values()) else set()
    if unknown:
        hyper = [n for n in params if n not in BATCH_INPUTS]
        raise TypeError(f"advantage estimator {getattr(fn, '__name__', fn)!r} has no option(s) {sorted(unknown)}; its options: {hyper}")
    advantages, returns = fn(**inputs, **kw)
    if advantages.shape != batch["response_mask"].shape:
        raise BatchError(f"estimator returned advantages of shape {tuple(advantages.shape)}, expected (b t) = {tuple(batch['response_mask'].shape)}")
    out = shallow_copy(batch)
    out.set("advantages", advantages.to(torch.float32))
    out.set("returns", returns.to(torch.float32))
    if "token_rewards" not in batch.keys() and "rewards" in batch.keys():
        out.set("token_rewards", inputs.get("token_rewards", token_rewards_of(batch)))
    return out
