"""Algorithms as short compositions of rollout / score / advantage / update.

``rk.recipes.get("grpo")`` returns a frozen config whose ``step(state, prompts, reward)`` runs one
iteration; ``.with_(n=16, kl=("low_var_kl", 1e-3))`` changes knobs.
"""
from rlkit.recipes.base import Recipe, reward_metrics
from rlkit.recipes.dapo import DAPO
from rlkit.recipes.grpo import GRPO, drgrpo
from rlkit.recipes.ppo import PPO
from rlkit.recipes.rloo import CriticFree, reinforce_pp, rloo

RECIPES = {
    "grpo": GRPO,
    "drgrpo": drgrpo,
    "dapo": DAPO,
    "rloo": rloo,
    "reinforce++": reinforce_pp,
    "ppo": PPO,
}


def get(name: str, **kwargs) -> Recipe:
    try:
        factory = RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(RECIPES)}") from None
    return factory(**kwargs)


__all__ = ["Recipe", "GRPO", "DAPO", "PPO", "CriticFree", "drgrpo", "rloo", "reinforce_pp", "RECIPES", "get", "reward_metrics"]
