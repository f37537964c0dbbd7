"""RLOO (Ahmadian et al. 2024) and REINFORCE++ (Hu 2025): critic-free baselines.

RLOO's baseline for a sample is the mean reward of the *other* samples of its prompt;
REINFORCE++ whitens discounted returns over the whole batch (``reinforce++_baseline``
subtracts the group mean first).

The ``"reinforce++"`` recipe (``rk.recipes.get("reinforce++")``, :func:`reinforce_pp`) runs the
``reinforce++_baseline`` estimator, not the plain ``"reinforce++"`` one that
``rk.advantage(batch, "reinforce++")`` names: for the plain one, ``CriticFree(estimator="reinforce++")``.
"""
from __future__ import annotations

from dataclasses import dataclass

from rlkit.recipes.base import Recipe, reward_metrics
from rlkit.transforms.advantage import advantage
from rlkit.transforms.rollout import rollout_metrics
from rlkit.transforms.update import update


@dataclass(frozen=True)
class CriticFree(Recipe):
    estimator: str = "rloo"

    def step(self, state, prompts, reward):
        batch = self.score(state, self.device_passes(state, self.sample(state, prompts)), reward)
        batch = advantage(batch, self.estimator)
        state, metrics = update(state, batch, **self.update_kwargs())
        return state, {**rollout_metrics(batch), **reward_metrics(batch), **metrics, **self.sample_metrics(state, batch)}


def rloo(**kw) -> CriticFree:
    if "estimator" in kw:
        raise TypeError("rloo sets estimator='rloo' itself; for another, use rk.recipes.CriticFree(estimator=...)")
    return CriticFree(estimator="rloo", **kw)


def reinforce_pp(**kw) -> CriticFree:
    """The ``"reinforce++"`` recipe: REINFORCE++ with the group-mean baseline, i.e. the
    ``"reinforce++_baseline"`` estimator (not ``rk.advantage``'s plain ``"reinforce++"``, which
    whitens the batch's returns without a baseline; ``CriticFree(estimator="reinforce++")`` runs that)."""
    if "estimator" in kw:
        raise TypeError("reinforce_pp sets estimator='reinforce++_baseline' itself; for another, use rk.recipes.CriticFree(estimator=...)")
    return CriticFree(estimator="reinforce++_baseline", **kw)
