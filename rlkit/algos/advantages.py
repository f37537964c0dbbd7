"""Advantage estimators: ``(token_rewards, response_mask, ...) -> (advantages, returns)``.

Every estimator is registered in :data:`ADVANTAGE_ESTIMATORS` and is called with **keyword
arguments only**. The caller inspects the signature and passes just the inputs it names, out of:

==================  ======  ==============================================================
input               shape   meaning
==================  ======  ==============================================================
token_rewards       (b t)   per-token reward; the sequence reward sits on the last valid token
                            (verl's ``token_level_rewards``)
response_mask       (b t)   True on generated tokens
group               (b)     long; equal id = responses to the same prompt (verl's ``index``).
                            Ids are arbitrary integers, rows of a group need not be contiguous.
values              (b t)   critic values (GAE)
reward_baselines    (b)     reward of the greedy response (ReMax)
==================  ======  ==============================================================

plus hyper-parameters with verl's defaults. Each returns ``(advantages (b t), returns (b t))``,
both exactly zero outside ``response_mask``.

Numbers match verl's ``verl/trainer/ppo/core_algos.py`` (the registered loop versions,
including the edge cases: a group of one has mean 0 and std 1; ``torch.std`` is unbiased).
Deliberate differences, all invisible on well-formed inputs (reward on the last valid token,
right padding):

* rewards are summed over ``response_mask`` only (verl sums the whole row), so padding can never
  change an advantage;
* outputs are zeroed outside the mask (verl leaves GAE's whitened advantages and returns there);
* group statistics are computed in float64 and cast back (verl uses the input dtype): a group
  of identical rewards then gives exactly 0, where float32 rounding of the mean can leave
  ``O(1e-8) / 1e-6`` noise.

Group estimators are vectorised with ``torch.unique(return_inverse=True)`` and ``index_add``;
no Python loop runs over groups or rows.
"""
from __future__ import annotations

import torch

from rlkit._checks import is_real, unit_interval
from rlkit.algos.registry import Registry
from rlkit.algos.stats import masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "gae",
    "grpo",
    "drgrpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
]

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


# --------------------------------------------------------------------------------------------
# input checks and shared helpers
# --------------------------------------------------------------------------------------------


def _check_tokens(token_rewards: torch.Tensor, response_mask: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Validate shapes/dtypes; ``others`` maps field name -> tensor (None = not required here)."""
    if not isinstance(token_rewards, torch.Tensor) or token_rewards.dim() != 2:
        shape = tuple(token_rewards.shape) if isinstance(token_rewards, torch.Tensor) else type(token_rewards).__name__
        raise ValueError(f"token_rewards must be a (b t) tensor, got {shape}")
    if not token_rewards.is_floating_point():
        raise ValueError(f"token_rewards must have a float dtype, got {token_rewards.dtype}")
    if not isinstance(response_mask, torch.Tensor) or response_mask.shape != token_rewards.shape:
        shape = tuple(response_mask.shape) if isinstance(response_mask, torch.Tensor) else type(response_mask).__name__
        raise ValueError(
            f"response_mask has shape {shape} but token_rewards has shape {tuple(token_rewards.shape)}; "
            "both must be (b t) with the same b and t"
        )
    b, t = token_rewards.shape
    mask = response_mask.bool()
    # inf too: one infinite reward made its group's (or, whitened, the batch's) advantages NaN
    bad = ~torch.isfinite(token_rewards) & mask
    if bad.any():
        rows = bad.any(dim=-1).nonzero().flatten().tolist()
        raise ValueError(f"token_rewards contains NaN or inf at valid tokens of rows {rows[:8]}; fix the reward function")
    for name, value in others.items():
        if value is None:
            continue
        want = (b, t) if name == "values" else (b,)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            pretty = "(b t)" if len(want) == 2 else "(b)"
            raise ValueError(f"{name} has shape {shape}, expected {pretty} = {want} to match token_rewards")
        if name == "group":
            if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
                raise ValueError(f"group must be an integer tensor (one prompt id per row), got dtype {value.dtype}")
        elif (~torch.isfinite(value)).any() if value.dim() == 1 else (~torch.isfinite(value) & mask).any():
            raise ValueError(f"{name} contains NaN or inf; fix the model or data that produced it")


def _positive_finite(value: object, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite real number > 0."""
    if not is_real(value) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _whiten_or_zero(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``masked_whiten(x)`` over the batch's valid tokens, exactly 0 elsewhere. With fewer than two
    valid tokens there is no variance to divide by (masked_var refuses it): the whitened value of
    one token, ``x - mean``, is 0, and a batch without a valid token has nothing to train; both
    give zeros, as :func:`gae` does."""
    if int(mask.sum()) < 2:
        return torch.zeros_like(x)
    return torch.where(mask, masked_whiten(x, mask), 0.0)


def _require(name: str, value: object, estimator: str, how: str) -> None:
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {name!r} but it was not given; {how}")


def _sequence_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(b t) -> (b): the scalar outcome reward of each row, summed over valid tokens."""
    return torch.where(response_mask.bool(), token_rewards, 0.0).sum(dim=-1)


def _broadcast(scalar: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(b) -> (b t): the row's scalar on valid tokens, exactly 0 elsewhere."""
    return torch.where(response_mask.bool(), scalar.to(dtype)[:, None], 0.0)


class _Groups:
    """Group bookkeeping for a ``group (b)`` tensor of arbitrary integer ids.

    ``inverse (b)`` maps each row to a dense group slot ``0..G-1``; ``count (G)`` is the group size.
    """

    def __init__(self, group: torch.Tensor, device: torch.device):
        _, self.inverse = torch.unique(group.to(device), return_inverse=True)
        self.size = int(self.inverse.max()) + 1 if self.inverse.numel() else 0
        self.count = torch.bincount(self.inverse, minlength=self.size).to(torch.float64)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """(b) -> (G) per-group sum (float64)."""
        out = torch.zeros(self.size, dtype=torch.float64, device=x.device)
        return out.index_add_(0, self.inverse, x.to(torch.float64))

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """(b) -> (G) per-group mean; a group of one gets mean 0 (verl)."""
        mean = self.sum(x) / self.count
        return torch.where(self.count > 1, mean, 0.0)

    def std(self, x: torch.Tensor) -> torch.Tensor:
        """(b) -> (G) unbiased per-group std (torch.std); a group of one gets std 1 (verl)."""
        mean = self.sum(x) / self.count
        sq = (x.to(torch.float64) - mean[self.inverse]) ** 2
        var = self.sum(sq) / (self.count - 1).clamp(min=1)
        return torch.where(self.count > 1, var.sqrt(), 1.0)


# --------------------------------------------------------------------------------------------
# critic-based
# --------------------------------------------------------------------------------------------


@ADVANTAGE_ESTIMATORS.register("gae")
@torch.no_grad()
def gae(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al., 2016, arXiv:1506.02438), as verl's
    ``compute_gae_advantage_return``.

    Shapes: ``token_rewards, response_mask, values (b t)`` -> ``advantages, returns (b t)``.

    Formula, backwards over ``t`` with ``V_next = 0, A_next = 0`` past the end::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
        (V_next, A_next) <- (V_t, A_t)  only on valid tokens (masked tokens are skipped, so
                                        observation tokens inside a response carry values through)
        returns    = A + V
        advantages = masked_whiten(A, response_mask)     (whitened over the whole batch)

    Defaults ``gamma = lam = 1.0`` are verl's ``AlgoConfig`` defaults. ``values`` is required.
    """
    _require("values", values, "gae", "run the critic first (batch field 'values')")
    _check_tokens(token_rewards, response_mask, values=values)
    # gamma=2 made returns blow up, lam=nan every advantage NaN: both were accepted
    unit_interval(gamma, "gae: gamma")
    unit_interval(lam, "gae: lam")
    mask = response_mask.bool()
    rewards = torch.where(mask, token_rewards, 0.0)
    vals = torch.where(mask, values, 0.0).to(token_rewards.dtype)
    b, t = rewards.shape
    next_value = torch.zeros(b, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    adv = torch.zeros_like(rewards)
    # the recursion is sequential in time; it is vectorised over the batch
    for i in reversed(range(t)):
        delta = rewards[:, i] + gamma * next_value - vals[:, i]
        candidate = delta + gamma * lam * next_adv
        next_value = torch.where(mask[:, i], vals[:, i], next_value)
        next_adv = torch.where(mask[:, i], candidate, next_adv)
        adv[:, i] = next_adv
    returns = torch.where(mask, adv + vals, 0.0)
    # fewer than two valid tokens: zeros (a batch of one single-token response crashed PPO)
    return _whiten_or_zero(adv, mask), returns


# --------------------------------------------------------------------------------------------
# group (outcome) estimators
# --------------------------------------------------------------------------------------------


def _grpo(token_rewards, response_mask, group, epsilon, norm_by_std, name):
    _require("group", group, name, "give each row its prompt id (batch field 'group')")
    _check_tokens(token_rewards, response_mask, group=group)
    # epsilon=0 divided a group of equal rewards by std 0: NaN advantages
    _positive_finite(epsilon, f"{name}: epsilon")
    scores = _sequence_scores(token_rewards, response_mask)
    groups = _Groups(group, token_rewards.device)
    centred = scores.to(torch.float64) - groups.mean(scores)[groups.inverse]
    if norm_by_std:
        centred = centred / (groups.std(scores)[groups.inverse] + epsilon)
    adv = _broadcast(centred, response_mask, token_rewards.dtype)
    return adv, adv.clone()


@ADVANTAGE_ESTIMATORS.register("grpo")
@torch.no_grad()
def grpo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Relative Policy Optimization advantage (Shao et al., 2024, DeepSeekMath,
    arXiv:2402.03300), as verl's ``compute_grpo_outcome_advantage``.

    Shapes: ``token_rewards, response_mask (b t)``, ``group (b)`` -> ``advantages = returns (b t)``.

    Formula, with ``s_i = sum_t r_{i,t}`` and ``g`` the group of row ``i``::

        A_i = (s_i - mean_g) / (std_g + epsilon)     if norm_by_std
        A_i =  s_i - mean_g                          otherwise (Dr. GRPO, arXiv:2503.20783)

    ``std_g`` is the unbiased (n - 1) standard deviation; a group of one row uses mean 0 and
    std 1, so its advantage is ``s_i / (1 + epsilon)``. ``A_i`` is broadcast over valid tokens.
    ``epsilon`` must be a finite number > 0 (with 0 a group of equal rewards gives 0 / 0).
    """
    return _grpo(token_rewards, response_mask, group, epsilon, norm_by_std, "grpo")


@ADVANTAGE_ESTIMATORS.register("drgrpo")
@torch.no_grad()
def drgrpo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    norm_by_std: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO advantage (Liu et al., 2025, "Understanding R1-Zero-Like Training",
    arXiv:2503.20783): :func:`grpo` without the std normalisation, ``A_i = s_i - mean_g``.

    Identical to ``grpo(..., norm_by_std=False)``; verl selects it with
    ``norm_adv_by_std_in_grpo=False``. Pair it with the ``"seq-mean-token-sum-norm"`` aggregation
    for the paper's length-unbiased loss.
    """
    return _grpo(token_rewards, response_mask, group, epsilon, norm_by_std, "drgrpo")


@ADVANTAGE_ESTIMATORS.register("rloo")
@torch.no_grad()
def rloo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out advantage (Ahmadian et al., 2024, arXiv:2402.14740; Kool et al.,
    2019), as verl's ``compute_rloo_outcome_advantage``.

    Shapes: ``token_rewards, response_mask (b t)``, ``group (b)`` -> ``advantages = returns (b t)``.

    Formula, for a group of ``n > 1`` rows with mean ``m``::

        A_i = s_i - mean_{j != i} s_j = n / (n - 1) * s_i - n / (n - 1) * m

    A group of one keeps its raw score ``A_i = s_i`` (verl's registered ``"rloo"``; note that
    verl's ``"rloo_vectorized"`` gives 0 there instead).
    """
    _require("group", group, "rloo", "give each row its prompt id (batch field 'group')")
    _check_tokens(token_rewards, response_mask, group=group)
    scores = _sequence_scores(token_rewards, response_mask)
    groups = _Groups(group, token_rewards.device)
    n = groups.count[groups.inverse]
    s = scores.to(torch.float64)
    mean = (groups.sum(scores) / groups.count)[groups.inverse]
    factor = n / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, s * factor - mean * factor, s)
    out = _broadcast(adv, response_mask, token_rewards.dtype)
    return out, out.clone()


@ADVANTAGE_ESTIMATORS.register("opo")
@torch.no_grad()
def opo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-Policy RL with Optimal reward baseline (Hao et al., 2025, arXiv:2505.23585), as verl's
    ``compute_opo_outcome_advantage``.

    Shapes: ``token_rewards, response_mask (b t)``, ``group (b)`` -> ``advantages = returns (b t)``.

    Formula, with ``l_i = sum_t mask_{i,t}`` the response length::

        b_g = sum_{j in g} l_j * s_j / sum_{j in g} l_j     (length-weighted mean; 0 for a group of one)
        A_i = s_i - b_g

    No std normalisation. A group whose rows are all empty gets baseline 0 (verl: 0/0 = NaN).
    """
    _require("group", group, "opo", "give each row its prompt id (batch field 'group')")
    _check_tokens(token_rewards, response_mask, group=group)
    scores = _sequence_scores(token_rewards, response_mask)
    lengths = response_mask.bool().sum(dim=-1).to(torch.float64)
    groups = _Groups(group, token_rewards.device)
    weighted = groups.sum(lengths * scores.to(torch.float64))
    total = groups.sum(lengths)
    baseline = torch.where((groups.count > 1) & (total > 0), weighted / total.clamp(min=1e-300), 0.0)
    adv = scores.to(torch.float64) - baseline[groups.inverse]
    out = _broadcast(adv, response_mask, token_rewards.dtype)
    return out, out.clone()


@ADVANTAGE_ESTIMATORS.register("gpg")
@torch.no_grad()
def gpg(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group: torch.Tensor | None = None,
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient advantage (Chu et al., 2025, arXiv:2504.02546), as verl's
    ``compute_gpg_outcome_advantage``.

    Shapes: ``token_rewards, response_mask (b t)``, ``group (b)`` -> ``advantages = returns (b t)``.

    Formula::

        alpha = b / max(#{i : s_i != 0}, 1)        (batch-level correction)
        A_i   = alpha * (s_i - mean_g) / f_norm     (mean_g = 0 for a group of one)

    verl computes ``alpha`` from the count of non-zero *rewards* (the paper's ``B / (B - M)``
    counts rows of groups with non-zero reward spread); we follow verl's code. verl also
    accepts an ``alpha`` argument that it overwrites; it is not exposed here. ``f_norm`` must be
    a finite number > 0 (0 gave inf and NaN advantages, a negative one reversed their sign).
    """
    _require("group", group, "gpg", "give each row its prompt id (batch field 'group')")
    _check_tokens(token_rewards, response_mask, group=group)
    _positive_finite(f_norm, "gpg: f_norm")
    scores = _sequence_scores(token_rewards, response_mask)
    b = scores.shape[0]
    alpha = b / torch.count_nonzero(scores).clamp(min=1).to(torch.float64)
    groups = _Groups(group, token_rewards.device)
    adv = alpha * (scores.to(torch.float64) - groups.mean(scores)[groups.inverse]) / f_norm
    out = _broadcast(adv, response_mask, token_rewards.dtype)
    return out, out.clone()


# --------------------------------------------------------------------------------------------
# batch-normalised / baseline estimators
# --------------------------------------------------------------------------------------------


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """verl's REINFORCE++ return: ``G_t = r_t + gamma * G_{t+1}``, reset to 0 after each masked
    token (so a masked token ends the episode for everything before it)."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for i in reversed(range(rewards.shape[1])):
        running = rewards[:, i] + gamma * running
        returns[:, i] = running
        running = torch.where(mask[:, i], running, 0.0)
    return returns


@ADVANTAGE_ESTIMATORS.register("reinforce++", "reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025, arXiv:2501.03262), as verl's
    ``compute_reinforce_plus_plus_outcome_advantage``.

    Shapes: ``token_rewards, response_mask (b t)`` -> ``advantages, returns (b t)``.

    Formula: discounted reward-to-go ``G_t = r_t + gamma * G_{t+1}`` (reset after each masked
    token), then ``A = masked_whiten(G, response_mask)`` over the whole batch (global batch
    normalisation). The reset is verl's: a mask with holes (a multi-turn response whose tool or
    user turns are masked out) ends the return at each hole, so a turn before one gets none of
    an outcome reward placed on the last token (mask ``[1,1,0,1]`` with reward 1 at the end gives
    returns ``[0,0,0,1]``); :func:`gae` and :func:`remax` carry the reward across holes.
    ``gamma`` in ``[0, 1]``; ``1.0`` is verl's default. A batch with fewer than two valid tokens has no variance to whiten by: its advantages are 0 (as :func:`gae`'s), where
    verl's ``masked_var`` raises.
    """
    _check_tokens(token_rewards, response_mask)
    # gamma=2 made the returns grow with the length, gamma=nan every advantage NaN (gae refused both)
    unit_interval(gamma, "reinforce++: gamma")
    mask = response_mask.bool()
    rewards = torch.where(mask, token_rewards, 0.0)
    returns = torch.where(mask, _discounted_returns(rewards, mask, gamma), 0.0)
    return _whiten_or_zero(returns, mask), returns


@ADVANTAGE_ESTIMATORS.register("reinforce++_baseline", "reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline (Hu, 2025, arXiv:2501.03262), as verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``.

    Shapes: ``token_rewards, response_mask (b t)``, ``group (b)`` -> ``advantages = returns (b t)``.

    Formula: ``a_i = s_i - mean_g`` (mean 0 for a group of one), broadcast over valid tokens,
    then ``A = masked_whiten(a, response_mask)`` over all valid tokens of the batch (so longer
    responses weigh more in the batch statistics, as in verl). Fewer than two valid tokens in the
    batch: advantages 0, as :func:`reinforce_plus_plus`.
    """
    _require("group", group, "reinforce++_baseline", "give each row its prompt id (batch field 'group')")
    _check_tokens(token_rewards, response_mask, group=group)
    mask = response_mask.bool()
    scores = _sequence_scores(token_rewards, response_mask)
    groups = _Groups(group, token_rewards.device)
    centred = scores.to(torch.float64) - groups.mean(scores)[groups.inverse]
    tiled = _broadcast(centred, mask, token_rewards.dtype)
    adv = _whiten_or_zero(tiled, mask)
    return adv, adv.clone()


@ADVANTAGE_ESTIMATORS.register("remax")
@torch.no_grad()
def remax(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al., 2023, arXiv:2310.10505), as verl's ``compute_remax_outcome_advantage``.

    Shapes: ``token_rewards, response_mask (b t)``, ``reward_baselines (b)`` (the reward of the
    greedy response to the same prompt) -> ``advantages, returns (b t)``.

    Formula: ``G_t = sum_{t' >= t} mask_{t'} r_{t'}`` (undiscounted reward-to-go) and
    ``A_t = G_t - baseline`` on valid tokens. ``returns`` is also zeroed outside the mask
    (verl leaves the reward-to-go there when the mask has holes).
    """
    _require("reward_baselines", reward_baselines, "remax", "score a greedy response per prompt (batch field 'reward_baselines')")
    _check_tokens(token_rewards, response_mask, reward_baselines=reward_baselines)
    mask = response_mask.bool()
    rewards = torch.where(mask, token_rewards, 0.0)
    to_go = rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    returns = torch.where(mask, to_go, 0.0)
    advantages = torch.where(mask, to_go - reward_baselines.to(to_go.dtype)[:, None], 0.0)
    return advantages, returns
