"""Pure RL algorithm math over tensors: statistics, advantage estimators, losses, KL.

Imports only torch, einops and the standard library. Every algorithm family is a
:class:`~rlkit.algos.registry.Registry` of small functions; a user's own function with the
same signature is accepted wherever a name is.
"""
from rlkit.algos.registry import Registry
from rlkit.algos.stats import masked_mean, masked_sum, masked_var, masked_whiten
from rlkit.algos.advantages import ADVANTAGE_ESTIMATORS
from rlkit.algos.losses import AGGREGATIONS, POLICY_LOSSES, aggregate, entropy_from_logits, value_loss
from rlkit.algos.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    kl_penalty,
    straight_through,
)

__all__ = [
    "Registry",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "aggregate",
    "POLICY_LOSSES",
    "value_loss",
    "entropy_from_logits",
    "KL_PENALTIES",
    "kl_penalty",
    "straight_through",
    "apply_kl_to_rewards",
    "FixedKLController",
    "AdaptiveKLController",
]
