"""PPO with a learned critic and GAE (Schulman et al. 2017; Ouyang et al. 2022).

    batch = score(rollout(state, prompts, n), reward)
    batch = compute_values(state, batch)                 # critic values (b t)
    batch = advantage(batch, "gae", gamma=1, lam=0.95)    # advantages + returns
    state, metrics = update(state, batch)                # actor + clipped value loss
"""
from __future__ import annotations

from dataclasses import dataclass

from rlkit._checks import positive_finite_or_none, unit_interval
from rlkit.recipes.base import Recipe, reward_metrics
from rlkit.transforms.advantage import advantage
from rlkit.transforms.forward import compute_values
from rlkit.transforms.rollout import rollout_metrics
from rlkit.transforms.update import update


@dataclass(frozen=True)
class PPO(Recipe):
    n: int = 4
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float | None = 0.5  # None: no clipping of the value loss

    def __post_init__(self):
        super().__post_init__()
        # checked when the recipe is built, as the other knobs are: gamma=2, lam=nan or
        # value_clip=-1 were accepted and trained on nonsense (value_clip=None failed at the update)
        unit_interval(self.gamma, "PPO.gamma")
        unit_interval(self.lam, "PPO.lam")
        positive_finite_or_none(self.value_clip, "PPO.value_clip", "no value clipping")

    def needs_critic(self) -> bool:
        return True

    def step(self, state, prompts, reward):
        if state.critic is None:
            raise ValueError("the PPO recipe needs a critic: rk.init(model, critic=rk.models.critic(model))")
        batch = self.score(state, self.sample(state, prompts), reward)
        batch = compute_values(state, batch, micro_batch_size=self.micro_batch_size)
        batch = advantage(batch, "gae", gamma=self.gamma, lam=self.lam)
        state, metrics = update(state, batch, value_clip=self.value_clip, **self.update_kwargs())
        return state, {**rollout_metrics(batch), **reward_metrics(batch), **metrics, **self.sample_metrics(state, batch)}
