"""GRPO (Shao et al. 2024, DeepSeekMath) and Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training").

    batch = rollout(state, prompts, n)      # n samples per prompt
    batch = score(batch, reward)
    batch = advantage(batch, "grpo")        # (r - mean_group) / (std_group + eps)
    state, metrics = update(state, batch, loss="ppo_clip", kl=("low_var_kl", beta))
"""
from __future__ import annotations

from dataclasses import dataclass

from rlkit.recipes.base import Recipe, reward_metrics
from rlkit.transforms.advantage import advantage
from rlkit.transforms.rollout import rollout_metrics
from rlkit.transforms.update import update


@dataclass(frozen=True)
class GRPO(Recipe):
    estimator: str = "grpo"

    def step(self, state, prompts, reward):
        batch = self.device_passes(state, self.sample(state, prompts))  # queued: the GPU runs them while score runs
        batch = self.score(state, batch, reward)
        batch = advantage(batch, self.estimator)
        state, metrics = update(state, batch, **self.update_kwargs())
        return state, {**rollout_metrics(batch), **reward_metrics(batch), **metrics, **self.sample_metrics(state, batch)}


def drgrpo(**kw) -> GRPO:
    """Dr. GRPO: no std normalisation, and a constant-length token-sum loss (no length bias).

    The loss sums each mini-batch's token losses and divides by ``max_new_tokens`` (the update's
    ``horizon``, see :meth:`Recipe.update_kwargs`), the same constant at every step whatever the
    batch's longest response."""
    fixed = sorted({"estimator", "agg"} & set(kw))
    if fixed:
        raise TypeError(f"drgrpo sets {fixed} itself (estimator 'drgrpo', agg 'seq-mean-token-sum-norm'); for other values "
                        "use rk.recipes.GRPO(...) directly")
    return GRPO(estimator="drgrpo", agg="seq-mean-token-sum-norm", **kw)
