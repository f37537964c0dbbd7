"""What every recipe shares: a frozen config with ``step(state, prompts, reward) -> (state, metrics)``."""
from __future__ import annotations

import math

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import torch

from rlkit._checks import int_at_least, is_real, positive_finite_or_none
from rlkit.batch import Batch


def group_reward_range(inverse: torch.Tensor, groups: int, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of the rewards of each of ``groups`` groups; ``inverse[i]``: row ``i``'s group."""
    r = rewards.float()
    lo = torch.full((groups,), float("inf")).scatter_reduce(0, inverse, r, "amin")
    hi = torch.full((groups,), float("-inf")).scatter_reduce(0, inverse, r, "amax")
    return lo, hi


def reward_metrics(batch: Batch) -> dict[str, float]:
    """Mean reward, per-reward means, response length and the fraction of zero-variance groups."""
    rewards = batch["rewards"]
    out = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0}
    for k in batch.keys():
        if isinstance(k, str) and k.startswith("reward/"):
            values = batch[k].float()
            values = values[~torch.isnan(values)]  # NaN: the reward returned None there (did not apply)
            if len(values):
                out[f"{k}_mean"] = float(values.mean())
    group = batch["group"]
    _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    if (counts > 1).any():
        # all rewards of the group equal (GRPO's advantages all zero): compared exactly, as max and
        # min. E[x^2] - E[x]^2 in float32 left identical rewards of 0.7 or 3.3 a variance > 1e-12
        lo, hi = group_reward_range(inverse, len(counts), rewards)
        out["reward/zero_var_groups"] = float((hi == lo).float().mean())
    out["response/len_mean"] = float(batch["response_mask"].sum(-1).float().mean())
    if "truncated" in batch.keys():
        out["response/truncated_frac"] = float(batch["truncated"].float().mean())
    return out


def _check_builtin_loss_options(fn, kw: dict, wants_generator: bool) -> None:
    """rlkit's own policy losses check their options (``kl_cov_ratio`` in (0, 1], ``clip_ratio >= 0``,
    ...) when called, which was after the first rollout: run one on a 1 x 4 batch of zeros here, so
    that a recipe with a bad ``loss_kw`` is refused when built. Only its ``ValueError`` counts (the
    option's message); a loss of the user's is never run here."""
    if getattr(fn, "__module__", None) != "rlkit.algos.losses":
        return
    import torch

    zeros, mask = torch.zeros(1, 4), torch.ones(1, 4)
    extra = {"generator": torch.Generator().manual_seed(0)} if wants_generator else {}
    try:
        fn(zeros, zeros, zeros, mask, **kw, **extra)
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - not an option's error: update's own call reports it
        pass


def _checked_reward_weights(weights: Any, name: str) -> tuple | dict:
    """``weights`` as a tuple (a sequence) or a dict copy (a mapping), each a finite number; a
    ``ValueError`` naming ``<name>.reward_weights`` otherwise. Their count or names are checked
    against the reward when it is known (:meth:`Recipe.score`, ``rk.score``)."""
    if isinstance(weights, Mapping):
        out: tuple | dict = {str(k): v for k, v in weights.items()}
        values = list(out.values())
    elif isinstance(weights, Iterable) and not isinstance(weights, (str, bytes)):
        out = tuple(weights)
        values = list(out)
    else:
        raise ValueError(f"{name}.reward_weights must be a list of numbers (one per reward function), a {{name: weight}} dict, "
                         f"or None (each weight 1), got {weights!r}")
    bad = [v for v in values if not is_real(v) or not math.isfinite(v)]
    if bad or not values:
        raise ValueError(f"{name}.reward_weights must hold finite numbers, one per reward function, got {weights!r}"
                         + (f" ({bad[0]!r} is not one)" if bad else " (empty)") + "; None: each weight 1")
    if isinstance(out, dict):
        return {k: float(v) for k, v in out.items()}
    return tuple(float(v) for v in out)


@dataclass(frozen=True)
class Recipe:
    """Shared sampling and update knobs. Subclasses define :meth:`step` in a few lines."""

    n: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    loss: str | Callable = "ppo_clip"
    loss_kw: dict[str, Any] = field(default_factory=dict)
    agg: str | None = None
    kl: tuple | None = None
    entropy_coef: float = 0.0
    mini_batch_size: int | None = None
    micro_batch_size: int | None = None
    epochs: int = 1
    max_grad_norm: float | None = 1.0
    #: float16 weights: finite optimizer steps before the loss scale doubles (``rk.update``'s keyword)
    loss_scale_growth_interval: int = 2000
    engine: str | None = None
    #: weights of several reward functions (``rk.score``'s ``weights``): a list, one per function
    #: in the reward's order, or a ``{name: weight}`` dict naming them all; None: 1 each
    reward_weights: tuple | dict | None = None
    #: rows of each step's batch shown as the ``"samples"`` metric (``rk.observe.samples``: prompt,
    #: response, reward, advantage, from different prompts), which the dashboard, the console and
    #: wandb show as a table: TRL's ``log_completions`` / ``num_completions_to_print``. 0: none
    log_samples: int = 0

    def __post_init__(self):
        # checked when the recipe is built (rk.recipes.get, with_), not at its first rollout
        from rlkit.engines.base import SamplingParams
        from rlkit.transforms.update import LOSS_SCALE_GROWTH_INTERVAL, _resolve_kl

        name = type(self).__name__
        if isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool) and self.temperature <= 0:
            # greedy: the n samples of a prompt would be one response (no group signal), and the
            # update's log-probs need a temperature > 0; it failed only at the first update. Before
            # SamplingParams' check, whose "(0 = greedy)" then read as an invitation to pass 0
            raise ValueError(f"{name}: temperature must be > 0 for RL sampling, got {self.temperature!r} (greedy is for "
                             "evaluation: rk.evaluate)")
        try:
            SamplingParams(n=self.n, max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if self.kl is not None:
            try:  # the coefficient, the KL name and a function's signature
                mode, coef = _resolve_kl(self.kl)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{name}: {e}") from None
            object.__setattr__(self, "kl", (mode, coef))  # kl=1e-3 means ("low_var_kl", 1e-3), as in update
        for field_name in ("mini_batch_size", "micro_batch_size"):
            if getattr(self, field_name) is not None:
                int_at_least(getattr(self, field_name), f"{name}.{field_name}", 1, " or None")
        int_at_least(self.epochs, f"{name}.epochs", 1)
        int_at_least(self.log_samples, f"{name}.log_samples", 0, " (rows shown per step as the 'samples' metric; 0: none)")
        # 0, -5, 2.5 or "100" used to pass here and fail inside the first update, after its rollout and scoring
        int_at_least(self.loss_scale_growth_interval, f"{name}.loss_scale_growth_interval", 1,
                     " (finite float16 steps in a row before the loss scale doubles; GradScaler's is "
                     f"{LOSS_SCALE_GROWTH_INTERVAL})")
        # a negative norm used to be accepted and turned every update into gradient ascent
        positive_finite_or_none(self.max_grad_norm, f"{name}.max_grad_norm", "no clipping")
        # names too: a misspelt loss, option or aggregation used to surface after the first rollout
        from rlkit.algos import ADVANTAGE_ESTIMATORS, AGGREGATIONS
        from rlkit.transforms.update import _resolve_loss

        default_agg = next(f.default for f in fields(self) if f.name == "agg")
        try:
            if self.agg is not None:
                AGGREGATIONS.get(self.agg)
            # an agg the loss cannot receive is refused as update refuses it (only a non-default one:
            # the class's own default is what its loss is written for)
            loss_fn, loss_kw, wants_generator, _ = _resolve_loss(self.loss, self.loss_kw,
                                                                 self.agg if self.agg != default_agg else None,
                                                                 drop_agg=f"drop agg (agg={default_agg!r})")
            _check_builtin_loss_options(loss_fn, loss_kw, wants_generator)
            # and the estimator and the engine (the KL mode: _resolve_kl above): they failed after the first rollout
            estimator = getattr(self, "estimator", None)
            if isinstance(estimator, str):
                ADVANTAGE_ESTIMATORS.get(estimator)
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{name}: {e}") from None
        if self.n < 2 and self.compares_groups():
            # a group of one has no statistics to compare with: advantage refused it after the
            # first rollout, naming rollout(..., n=8) rather than this field
            from rlkit.transforms.advantage import group_builtin

            estimator = getattr(self, "estimator", None)
            shown = estimator if isinstance(estimator, str) else group_builtin(estimator) or getattr(estimator, "__name__", estimator)
            raise ValueError(f"{name}.n={self.n}: the estimator {shown!r} compares the n responses sampled for each prompt, "
                             "so it needs n >= 2 (e.g. .with_(n=8))")
        from rlkit.transforms.rollout import ENGINES

        if self.engine is not None and not (self.engine in ENGINES if isinstance(self.engine, str) else callable(getattr(self.engine, "generate", None))):
            raise ValueError(f"{name}: engine={self.engine!r} is not an engine; give one of {', '.join(ENGINES)}, an Engine object, "
                             "or None (the built-in engine)")
        try:
            coef = float(self.entropy_coef)  # a 0-d tensor or numpy number too, as update takes it
        except (TypeError, ValueError):
            coef = math.nan
        if not math.isfinite(coef):
            # nan made every optimizer step non-finite: each was skipped, with only warnings
            raise ValueError(f"{name}.entropy_coef must be a finite number (0: no entropy bonus), got {self.entropy_coef!r}")
        object.__setattr__(self, "entropy_coef", coef)
        if self.reward_weights is not None:
            object.__setattr__(self, "reward_weights", _checked_reward_weights(self.reward_weights, name))

    def with_(self, **changes) -> "Recipe":
        """A copy with ``changes`` to its fields (``recipe.with_(n=16)``); an unknown field is a
        ``TypeError`` listing the recipe's fields."""
        check_fields(type(self), changes, f"{type(self).__name__}.with_")
        return replace(self, **changes)

    def sample(self, state, prompts, **kw) -> Batch:
        """The rollout, responses left as token ids: :meth:`score` decodes them, after the device
        passes are queued (decoding is host work the GPU need not wait for)."""
        from rlkit.transforms.rollout import rollout

        return rollout(state, prompts, n=self.n, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                       top_p=self.top_p, engine=self.engine, **{"decode": False, **kw})

    def score(self, state, batch: Batch, reward) -> Batch:
        """``rk.score`` with the recipe's ``reward_weights``: ``rewards`` is the weighted sum, each
        function's own values kept as ``reward/<name>``."""
        from rlkit.transforms.score import RewardError, _reward_functions, _reward_weights, score

        if self.reward_weights is not None:
            try:  # the count or names checked against the reward here, where the recipe can be named
                _reward_weights(self.reward_weights, _reward_functions(reward))
            except RewardError as e:
                raise RewardError(f"{type(self).__name__}.reward_weights={self.reward_weights!r} does not fit the reward: {e}") from None
        return score(batch, reward, weights=self.reward_weights, tokenizer=state.tokenizer)

    def device_passes(self, state, batch: Batch) -> Batch:
        """The forward passes the update will need (reference log-probs under a KL penalty),
        queued before the host scores the batch: they never wait for the device, so reward
        functions run on the CPU while the GPU computes them (the update would otherwise run
        them after scoring, serially).

        The critic's ``values`` too, on a state with a critic, when the recipe's estimator takes a
        ``values`` parameter: a learned-value baseline in ``GRPO(estimator=...)`` or ``CriticFree``
        always received ``values=None`` (only the PPO recipe ran the critic), while the update
        trained the critic for nothing."""
        if self.needs_ref() and state.ref is not None:
            from rlkit.transforms.forward import compute_ref_logprobs

            batch = compute_ref_logprobs(state, batch, temperature=self.temperature, micro_batch_size=self.micro_batch_size)
        if state.critic is not None and "values" not in batch.keys() and _takes_values(getattr(self, "estimator", None)):
            from rlkit.transforms.forward import compute_values

            batch = compute_values(state, batch, micro_batch_size=self.micro_batch_size)
        return batch

    def update_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of this recipe's :func:`rlkit.update`. Under the
        ``"seq-mean-token-sum-norm"`` aggregation (Dr. GRPO), given by name or as the function
        (``rk.algos.losses.seq_mean_token_sum_norm``), ``horizon`` is ``max_new_tokens``, the
        longest response the rollout can return: a constant normaliser, where the update's default
        (each batch's padded width) changed the loss scale with the longest response of the batch.
        An aggregation of your own that takes ``horizon`` (or ``**kwargs``) gets the same constant."""
        return dict(loss=self.loss, loss_kw=self.loss_kw, agg=self.agg, horizon=self._horizon(), kl=self.kl, entropy_coef=self.entropy_coef,
                    temperature=self.temperature, mini_batch_size=self.mini_batch_size,
                    micro_batch_size=self.micro_batch_size, epochs=self.epochs, max_grad_norm=self.max_grad_norm,
                    loss_scale_growth_interval=self.loss_scale_growth_interval)

    def _horizon(self) -> int | None:
        """``max_new_tokens`` for an aggregation that reads ``horizon``, else None (the update's default).

        Decided on the function the name resolves to (``AGGREGATIONS.get``), so the name, an alias
        and the function object agree: the function used to get the batch's width, a loss scale
        that changed with padding (by ``max_new_tokens / width``)."""
        if self.agg is None:
            return None
        import inspect

        from rlkit.algos import AGGREGATIONS, losses

        fn = AGGREGATIONS.get(self.agg)
        if fn is losses.seq_mean_token_sum_norm:
            return self.max_new_tokens
        if fn in (losses.token_mean, losses.seq_mean_token_sum, losses.seq_mean_token_mean):
            return None  # built-ins that ignore horizon: the update's default, as before
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a builtin or C callable without a signature
            return None
        takes = "horizon" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        return self.max_new_tokens if takes else None

    def sample_metrics(self, state, batch: Batch) -> dict[str, Any]:
        """``{"samples": [...]}``: ``log_samples`` rows of ``batch`` (:func:`rlkit.observe.samples`,
        decoded with ``state.tokenizer`` where the batch has no text columns) for a step's metrics;
        ``{}`` when ``log_samples`` is 0, so the metrics are only numbers, as before. ``state`` is
        the one the update returned (the one given to it is donated). On several ranks each has its
        own rows; ``rk.fit`` logs rank 0's."""
        if not self.log_samples:
            return {}
        from rlkit.observe.sinks import samples

        return {"samples": samples(batch, self.log_samples, tokenizer=state.tokenizer)}

    def needs_ref(self) -> bool:
        return bool(self.kl and self.kl[1])

    def needs_critic(self) -> bool:
        return False

    def compares_groups(self) -> bool:
        """Whether a step compares the n responses of each prompt with each other (so needs n >= 2):
        true for a built-in group estimator (:func:`rlkit.transforms.advantage.group_builtin`: by
        name as registered now, function or ``functools.partial``). A user's own estimator owns its
        statistics."""
        from rlkit.transforms.advantage import group_builtin

        return group_builtin(getattr(self, "estimator", None)) is not None

    def step(self, state, prompts, reward):
        """One training step: ``(state, metrics)``. Subclasses define it (the built-in recipes do)."""
        own = sorted(n for n in vars(type(self)) if not n.startswith("_") and callable(getattr(type(self), n))
                     and n not in vars(Recipe))
        close = [n for n in own if n.lower().startswith("step") or "step" in n.lower()]
        hint = f" (it defines {', '.join(close)}: a misspelt step?)" if close else ""
        raise NotImplementedError(
            f"{type(self).__name__} has no step method{hint}; a Recipe subclass defines "
            "step(self, state, prompts, reward) -> (state, metrics), e.g. rollout, score, advantage and update "
            "(see rlkit/recipes/base.py, or tutorials/custom_algorithm.md 'A recipe')")


def check_fields(factory: Callable, changes: Mapping[str, Any], where: str) -> None:
    """``TypeError`` led by ``where`` naming the keys of ``changes`` that are not fields of the
    recipe ``factory`` builds (a Recipe class, or a function such as ``rloo`` returning one), with
    the fields it has: the dataclass's own message named ``__init__`` and not what is valid."""
    cls = factory if isinstance(factory, type) else type(factory())
    names = [f.name for f in fields(cls) if f.init]
    unknown = sorted(set(changes) - set(names))
    if unknown:
        import difflib

        near = {u: difflib.get_close_matches(u, names, n=1) for u in unknown}
        close = [f"{m[0]!r} for {u!r}" for u, m in near.items() if m]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise TypeError(f"{where}: {cls.__name__} has no field(s) {unknown}{hint}; its fields: {', '.join(names)}")


def _takes_values(estimator) -> bool:
    """Whether an advantage estimator (a registered name or a function) declares ``values``."""
    import inspect

    from rlkit.algos.advantages import ADVANTAGE_ESTIMATORS

    if estimator is None:
        return False
    try:
        return "values" in inspect.signature(ADVANTAGE_ESTIMATORS.get(estimator)).parameters
    except (KeyError, ValueError, TypeError):
        return False
