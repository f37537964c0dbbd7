"""DAPO (Yu et al. 2025): clip-higher, dynamic sampling, token-level loss, overlong shaping.

- clip-higher: asymmetric ratio clip [1 - 0.2, 1 + 0.28];
- dynamic sampling: groups whose rewards all agree (zero variance, zero GRPO advantage) are
  dropped, judged on the reward functions' rewards before the overlong penalty (the paper's
  ``0 < #correct < G``), and more prompts are sampled until the batch is full (or
  ``max_attempts`` run out: a short batch trains in whole mini-batches of ``mini_batch_size``,
  the rest of its rows dropped and counted in ``dapo/dropped_rows``);
- overlong reward shaping: a linear penalty in the last ``overlong_buffer`` tokens before
  ``max_new_tokens``, added to the rewards of the groups kept (their advantages). Keep the
  buffer within the lengths no good answer reaches: with ``max_new_tokens`` close to the
  longest answer, the default of 4 penalises right answers too.

A step at which no attempt kept a group (every group's rewards agree, ``max_attempts`` times)
has nothing to learn: it takes no optimizer step (an update on its zero advantages still moved
the weights, by Adam's momentum alone) and leaves the learning-rate schedule where it is, as a
skipped non-finite step does; ``state.step`` goes on, ``dapo/skipped_steps`` is 1 and
``dapo/kept_frac`` and ``dapo/trained_rows`` are 0. The verl equivalent raises once its
generation batches run out; here a hard stretch of prompts does not end the run.

The reported ``reward/*`` metrics are the first rollout's rewards before the penalty
(``dapo/overlong_penalty_mean`` is the penalty's mean over that rollout); so are the rows of
``log_samples`` (what the model wrote for this step's prompts, the groups the filter drops too,
without advantages: the first rollout has none).
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any

import torch

from rlkit._checks import int_at_least, is_real
from rlkit.recipes.base import Recipe, group_reward_range, reward_metrics
from rlkit.batch import shallow_copy
from rlkit.state import fold_in
from rlkit.transforms.advantage import advantage
from rlkit.transforms.rollout import concat, rollout_metrics
from rlkit.transforms.update import update


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to ``max_len - buffer``, then linearly to ``-factor``."""
    expected = max_len - buffer
    return (-(lengths.float() - expected) / max(buffer, 1) * factor).clamp(max=0.0)


def keep_informative_groups(batch, rewards: torch.Tensor | None = None):
    """Rows of groups whose rewards are not all equal (the rest carry no GRPO signal).

    ``rewards (b)``: the rewards to compare, by default ``batch["rewards"]``. :class:`DAPO` gives
    the verifier's rewards from before the overlong penalty: the paper keeps the groups with
    ``0 < #correct < G`` (arXiv:2503.14476, eq. 11), so a group whose answers all agree but whose
    lengths differ is dropped, not trained on the length penalty alone."""
    group = batch["group"]
    rewards = batch["rewards"] if rewards is None else rewards
    _, inverse = torch.unique(group, return_inverse=True)
    lo, hi = group_reward_range(inverse, int(inverse.max()) + 1, rewards)
    keep = (hi - lo > 1e-9)[inverse]
    return batch[keep.nonzero().flatten()]


@dataclass(frozen=True)
class DAPO(Recipe):
    loss_kw: dict[str, Any] = field(default_factory=lambda: {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28})
    agg: str | None = "token-mean"  # DAPO's token-level policy-gradient loss
    overlong_buffer: int = 4
    overlong_factor: float = 1.0
    max_attempts: int = 3

    def __post_init__(self):
        if isinstance(self.n, int) and self.n < 2:
            # dynamic sampling keeps groups whose rewards differ; one response always agrees with
            # itself, so every step was skipped after max_attempts rollouts, without a word
            raise ValueError(f"DAPO.n={self.n}: dynamic sampling keeps the prompts whose n responses got different "
                             "rewards, which one response never has, so nothing would train; give n >= 2 (e.g. .with_(n=8))")
        super().__post_init__()
        int_at_least(self.max_attempts, "DAPO.max_attempts", 1, " (rollouts per step to fill the batch)")
        int_at_least(self.overlong_buffer, "DAPO.overlong_buffer", 0)
        if self.overlong_buffer > self.max_new_tokens:
            # the penalty would start before the first token: every response punished
            raise ValueError(f"DAPO.overlong_buffer={self.overlong_buffer} exceeds max_new_tokens={self.max_new_tokens}: the "
                             "penalty ramps over the last overlong_buffer tokens before max_new_tokens; give at most "
                             f"{self.max_new_tokens} (0: no overlong shaping)")
        if not is_real(self.overlong_factor) or not math.isfinite(self.overlong_factor) or self.overlong_factor < 0:
            # -1 made the penalty a bonus for long responses; nan read as a broken reward
            raise ValueError(f"DAPO.overlong_factor must be a finite number >= 0 (the largest penalty), got {self.overlong_factor!r}")

    def compares_groups(self) -> bool:
        return True  # dynamic sampling keeps only groups whose rewards differ, whatever the estimator

    def step(self, state, prompts, reward):
        kept, sampled, attempts = [], 0, 0
        target = len(prompts) * self.n
        mini = self.mini_batch_size
        if mini and target % mini:
            # as update would refuse it for GRPO's batch (a full batch is len(prompts) * n rows)
            raise ValueError(f"DAPO.mini_batch_size={mini} does not divide the batch of {len(prompts)} prompts x "
                             f"n={self.n} = {target} rows; pick a divisor of {target} (or None for one step per batch)")
        while attempts < self.max_attempts and sum(b.batch_size[0] for b in kept) < target:
            seed = fold_in(state.seed, state.step, "dapo", attempts)
            batch = self.score(state, self.sample(state, prompts, seed=seed), reward)
            verifier = batch["rewards"]  # the reward functions' sum, before the overlong penalty
            if attempts == 0:
                # its rollout and reward metrics are reported: the verifier's reward, as the other
                # recipes report theirs (and reward/zero_var_groups is the fraction the filter drops)
                first = shallow_copy(batch)
                penalty_mean = 0.0
            if self.overlong_buffer:
                pen = overlong_penalty(batch["response_mask"].sum(-1), self.max_new_tokens, self.overlong_buffer, self.overlong_factor)
                batch.set("rewards", verifier + pen)  # shapes the advantages of the groups kept
                if attempts == 0:
                    penalty_mean = float(pen.mean())
            sampled += batch.batch_size[0]
            # dynamic sampling on the verifier's reward (the paper's 0 < #correct < G): filtering on the
            # penalised reward kept groups whose answers all agreed but whose lengths differed, and
            # trained them on the length penalty alone
            informative = keep_informative_groups(batch, verifier)
            if informative.batch_size[0]:
                kept.append(informative)
            attempts += 1
        if not kept:
            state, metrics = self._skip(state, first, sampled, attempts, penalty_mean)
            return state, {**metrics, **self.sample_metrics(state, first)}
        batch = concat(kept)[:target]
        # trim to whole groups so every group keeps all n samples
        batch = batch[: (batch.batch_size[0] // self.n) * self.n] if batch.batch_size[0] >= self.n else batch
        batch = advantage(batch, "grpo")
        # a batch short of target (attempts ran out) keeps the optimizer steps' size: whole
        # mini-batches of it (the advantages were taken over whole groups first), or one step when
        # it is smaller than one mini-batch. It used to train a short batch in one step, and in
        # one forward/backward, whatever mini_batch_size and micro_batch_size said
        rows = batch.batch_size[0]
        if mini and rows > mini and rows % mini:
            batch = batch[: rows // mini * mini]
        dp = state._cache.get("dp")
        if dp is not None and batch.batch_size[0] % dp.size:
            # on several data-parallel ranks every rank trains an equal share: 9 rows on 2 ranks were
            # refused by update at a step that depended on the data
            batch = batch[: batch.batch_size[0] // dp.size * dp.size]
        state, metrics = update(state, batch, **{**self.update_kwargs(), "mini_batch_size": mini if mini and mini <= batch.batch_size[0] else None})
        extra = {"dapo/kept_frac": batch.batch_size[0] / max(sampled, 1), "dapo/attempts": float(attempts),
                 "dapo/overlong_penalty_mean": penalty_mean,
                 "dapo/trained_rows": float(batch.batch_size[0]), "dapo/dropped_rows": float(rows - batch.batch_size[0]),
                 "dapo/skipped_steps": 0.0}
        return state, {**rollout_metrics(first), **reward_metrics(first), **metrics, **extra, **self.sample_metrics(state, first)}

    @staticmethod
    def _skip(state, first, sampled: int, attempts: int, penalty_mean: float):
        """The step when no group was informative in any attempt: no update (see the module docs)."""
        new_state = state.replace(step=state.step + 1)
        state.donate("DAPO.step", new_state)  # as update donates: one live handle of the weights
        extra = {"dapo/kept_frac": 0.0, "dapo/attempts": float(attempts), "dapo/overlong_penalty_mean": penalty_mean,
                 "dapo/trained_rows": 0.0, "dapo/dropped_rows": 0.0, "dapo/skipped_steps": 1.0, "dapo/sampled_rows": float(sampled)}
        return new_state, {**rollout_metrics(first), **reward_metrics(first), **extra}
