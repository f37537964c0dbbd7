"""Algorithms as short compositions of rollout / score / advantage / update.

``rk.recipes.get("grpo")`` returns a frozen config whose ``step(state, prompts, reward)`` runs one
iteration; ``.with_(n=16, kl=("low_var_kl", 1e-3))`` changes knobs.
"""
from rlkit.recipes.base import Recipe, check_fields, reward_metrics
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
    """The recipe ``name`` (one of :data:`RECIPES`: ``rk.recipes.get("grpo")``), built with
    ``kwargs`` as its fields (``get("dapo", n=16)``); an unknown name or field is an error listing
    the valid ones. ``recipe.with_(field=value)`` changes fields of one already built."""
    try:
        factory = RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(RECIPES)}") from None
    check_fields(factory, kwargs, f"rk.recipes.get({name!r})")
    return factory(**kwargs)


def check_not_uncalled(obj, where: str) -> None:
    """Refuse a recipe class (``rk.recipes.GRPO``) or factory (``rk.recipes.drgrpo``) where a recipe
    is expected: one looked like a step function and failed at the first step with "step()
    missing 1 required positional argument" or "takes 0 positional arguments"."""
    if isinstance(obj, type) and issubclass(obj, Recipe):
        builtin = obj.__module__.startswith("rlkit.")
        made = f"rk.recipes.{obj.__name__}(...) or rk.recipes.get(name)" if builtin else f"{obj.__name__}(...)"
        raise TypeError(f"{where}: {obj.__name__} is a recipe class; pass an instance, {made}")
    for name, factory in RECIPES.items():
        if obj is factory:
            raise TypeError(f"{where}: rk.recipes.{factory.__name__} makes a recipe; pass rk.recipes.{factory.__name__}(...) "
                            f"or rk.recipes.get({name!r})")


__all__ = ["Recipe", "GRPO", "DAPO", "PPO", "CriticFree", "drgrpo", "rloo", "reinforce_pp", "RECIPES", "get", "reward_metrics"]
