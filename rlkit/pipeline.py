"""The small scheduler: a Pipeline is a step plus where each role lives; ``lower`` makes it runnable.

    pipe = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward)
    plan = pipe.lower()                          # one process: the identity, costs nothing
    state = plan.shard(state)
    state, metrics = plan.step(state, prompts)

Under ``rlkit.launch`` / torchrun the same code lowers onto a placement (role -> DeviceMesh):

- the actor (and critic, ref) are wrapped with FSDP2 ``fully_shard`` on their mesh (mixed
  precision on GPU), with summed gradient reduction so rlkit's globally normalised losses give
  exactly the single-process gradient;
- the rollout engine holds the actor's weights in the generation layout (replicated per
  data-parallel replica, or tensor-parallel), refreshed by :func:`rlkit.parallel.gather_weights`
  after every update (bytes and seconds reported as ``sync/*`` metrics);
- ``rollout`` splits the prompts across generation replicas and gathers one global Batch, so
  ``score`` and ``advantage`` see whole groups (and whole-batch statistics) on every rank; the
  reward functions themselves run on 1/N of the rows per rank and their values are all-gathered
  (:func:`rlkit.parallel.shard_reward`, ``lower(shard_reward=False)`` to opt out);
- ``update`` trains on this rank's rows of that Batch, normalising by global token counts.

Placement is data stored with the state (``state._cache``), so recipes and user steps run
unchanged: the transforms consult it, nothing else changes.
"""
from __future__ import annotations

import os

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from rlkit.data import Prompts
from rlkit.recipes.base import Recipe
from rlkit.state import TrainState


@dataclass(frozen=True)
class SplitRoles:
    """Split placement: training on ``actor_ranks``, generation on disjoint ``rollout_ranks``."""

    actor_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]


@dataclass(frozen=True)
class DataParallel:
    """A role's data-parallel context: the mesh, this rank's index in it and its size."""

    mesh: Any
    rank: int
    size: int
    #: True when the framework averages gradients over ranks (then update scales the loss by size)
    mean_reduce: bool = False

    @property
    def group(self):
        return self.mesh.get_group() if self.mesh is not None else None


def mesh(*shape: int, names: tuple[str, ...] | None = None):
    """A DeviceMesh over all ranks (``rk.mesh()`` = 1-D data parallel over the world)."""
    from rlkit.parallel import device_mesh

    return device_mesh(shape or None, names)


#: when a lowered update reduce-scatters gradients (``Pipeline.lower(grad_reduce=...)``)
GRAD_REDUCE = ("micro_batch", "step")

StepFn = Callable[[TrainState, Prompts, Callable], "tuple[TrainState, dict]"]


def _check_order(step: Any, reward: Any) -> None:
    """Refuse ``Pipeline(reward, step)``, the arguments swapped. A recipe name given as the reward was
    refused as "unknown reward 'grpo'" after the reward function had been taken as the step (a
    function passes for one), and a recipe class or factory is callable, so it passed for a reward
    function and failed at the first score; a reward's name given as the step was an "unknown
    algorithm"."""
    from rlkit.recipes import RECIPES
    from rlkit.transforms.score import BUILT_IN_REWARDS

    def shown(obj) -> str:
        name = getattr(obj, "__name__", "")
        return repr(obj) if isinstance(obj, str) else name if name.isidentifier() else "reward"

    if isinstance(reward, Recipe):
        what, fix = f"a recipe ({type(reward).__name__})", "recipe"
    elif isinstance(reward, str) and reward in RECIPES:
        what, fix = f"the recipe name {reward!r}", repr(reward)
    elif (isinstance(reward, type) and issubclass(reward, Recipe)) or any(reward is f for f in RECIPES.values()):
        name = next((k for k, f in RECIPES.items() if f is reward), None)
        what = f"the recipe {'class' if isinstance(reward, type) else 'factory'} {reward.__name__}"
        fix = f"rk.recipes.get({name!r})" if name else f"{reward.__name__}(...)"
    elif isinstance(step, str) and step in BUILT_IN_REWARDS and step not in RECIPES:
        raise TypeError(f"Pipeline: step {step!r} is a built-in reward's name, not a recipe; the order is "
                        f"Pipeline(step, reward), e.g. Pipeline('grpo', {step!r})")
    else:
        return
    # the swapped call, where the step given looks like the reward (not a recipe or a recipe's name)
    swapped = "" if isinstance(step, (str, Recipe)) else f": Pipeline({fix}, {shown(step)})"
    raise TypeError(f"Pipeline: reward is {what}; the order is Pipeline(step, reward){swapped}")


@dataclass(frozen=True)
class Pipeline:
    """A training step (a recipe, or any ``f(state, prompts, reward) -> (state, metrics)``) and its reward.

    ``roles`` documents which roles the step uses; placement of each is decided by :meth:`lower`.
    """

    step: Any
    reward: Callable
    roles: tuple[str, ...] = ("actor", "rollout")

    def __post_init__(self) -> None:
        # checked here, not on the first step: a wrong step or reward otherwise surfaces after a
        # whole rollout, deep inside the loop or score, as "'str' object is not callable"
        _check_order(self.step, self.reward)
        if isinstance(self.step, str):
            from rlkit.recipes import get

            object.__setattr__(self, "step", get(self.step))  # a recipe name: that recipe's defaults
        else:
            from rlkit.recipes import check_not_uncalled

            check_not_uncalled(self.step, "Pipeline")
        if not (callable(getattr(self.step, "step", None)) or callable(self.step)):
            raise TypeError(
                "Pipeline: step must be a recipe (rk.recipes.get('grpo')), a recipe name such as 'grpo', or a "
                f"function step(state, prompts, reward) -> (state, metrics); got {type(self.step).__name__}"
            )
        reward = self.reward
        from rlkit.transforms.score import check_reward

        # what rk.score takes, built-in names included; with the recipe's reward_weights where it has them
        check_reward(reward, "Pipeline", getattr(self.step, "reward_weights", None))

    def _fn(self) -> StepFn:
        return self.step.step if hasattr(self.step, "step") else self.step

    def __call__(self, state: TrainState, prompts: Prompts):
        return self._fn()(state, prompts, self.reward)

    def lower(
        self,
        placement=None,
        *,
        tp: int = 1,
        mixed_precision: bool | None = None,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        rollout_dtype: torch.dtype | None = None,
        release_rollout_memory: bool = False,
        shard_reward: bool = True,
        grad_reduce: str = "micro_batch",
    ) -> "Plan":
        """Lower onto a placement: ``None`` = this process (identity when torch.distributed is
        off, every role colocated on all ranks when it is on); a DeviceMesh = every role
        colocated on it; or an :class:`rlkit.parallel.Placement` (role -> mesh).

        ``tp``: tensor-parallel degree of generation on colocated roles; it must divide the
        rollout role's ranks, so ``tp > 1`` is an error on one process, not silently ignored.

        ``release_rollout_memory``: colocated roles take turns on memory — the engine frees its
        KV cache (and CUDA graphs) after every rollout so training gets that memory back, at the
        cost of rebuilding them on the next rollout.

        ``shard_reward``: every rank holds the same global Batch after the rollout; each rank
        scores 1/N of it and the rewards are all-gathered (:func:`rlkit.parallel.shard_reward`).
        ``False`` scores every row on every rank (a TRL-style reward that needs all rows at once).

        ``grad_reduce``: when FSDP2 reduce-scatters the trained roles' gradients in an update of
        several micro-batches per optimizer step. ``"micro_batch"`` (default): as each
        micro-batch's backward ends, so a rank only ever holds its gradient shards.
        ``"step"``: the micro-batches accumulate unsharded gradients locally and only the last
        one's backward reduce-scatters them: 1/k of the gradient communication for k
        micro-batches (the ``no_sync`` accumulation of DDP and accelerate), for the memory of a
        full float32 gradient of the model on every rank (4 bytes a parameter; FSDP2 keeps it
        in the reduce dtype). The optimizer step and its result are the same either way, up to
        the order of float additions."""
        from torch.distributed.device_mesh import DeviceMesh

        from rlkit._checks import int_at_least
        from rlkit.parallel import Placement, colocated_placement, local_placement

        # placement and tp are checked here: a wrong placement otherwise fails in shard() with an
        # AttributeError, or not at all (fit without shard trains locally), and a tp that cannot
        # apply would be dropped silently
        distributed = dist.is_available() and dist.is_initialized()
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if not distributed and world > 1:
            # under torchrun / rk.launch without init_distributed(): each rank lowered to a local
            # plan and trained the whole batch alone, writing the same checkpoints, without a word
            raise RuntimeError(f"Pipeline.lower: this process is one of WORLD_SIZE={world} (torchrun or rk.launch), but "
                               "torch.distributed is not initialised; call rk.parallel.init_distributed() first")
        if placement is None:
            placement = colocated_placement() if distributed and dist.get_world_size() > 1 else local_placement()
        elif isinstance(placement, DeviceMesh):
            placement = colocated_placement(placement)
        elif not isinstance(placement, Placement):
            raise TypeError(
                "Pipeline.lower: placement must be None (all ranks, or this process), a DeviceMesh (every role "
                "colocated on it, e.g. rk.mesh()) or an rlkit.parallel.Placement (e.g. "
                f"rk.parallel.split_placement({{'actor': 2, 'rollout': 2}})); got {placement!r}"
            )
        int_at_least(tp, "Pipeline.lower: tp", 1, " (tensor-parallel degree of generation)")
        if tp > 1 and "rollout" in placement.meshes:
            if "actor" in placement.meshes and not placement.colocated("actor", "rollout"):
                raise NotImplementedError("Pipeline.lower: tensor-parallel generation is lowered for colocated roles "
                                          f"only, not for a split placement; use tp=1 there (got tp={tp})")
            n = len(placement.ranks("rollout"))
            if n % tp:
                where = "one process (no torch.distributed world)" if placement.mesh("rollout") is None else f"{n} rank(s)"
                raise ValueError(f"Pipeline.lower: tp={tp} cannot apply: the rollout role runs on {where}, and tensor "
                                 f"parallelism needs a multiple of {tp} ranks; use tp=1 or launch a multiple of {tp} processes")
        if rollout_dtype is not None and not isinstance(rollout_dtype, torch.dtype):
            raise TypeError(f"Pipeline.lower: rollout_dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {rollout_dtype!r}")
        if grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"grad_reduce must be one of {', '.join(map(repr, GRAD_REDUCE))}, got {grad_reduce!r}")
        return Plan(self, placement, tp=tp, mixed_precision=mixed_precision, cpu_offload=cpu_offload,
                    activation_checkpointing=activation_checkpointing, rollout_dtype=rollout_dtype,
                    release_rollout_memory=release_rollout_memory, shard_reward=shard_reward, grad_reduce=grad_reduce)


@dataclass
class Plan:
    """A lowered pipeline: :meth:`shard` a state onto the placement, then :meth:`step` it."""

    pipeline: Pipeline
    placement: Any
    tp: int = 1
    mixed_precision: bool | None = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    rollout_dtype: torch.dtype | None = None
    release_rollout_memory: bool = False
    shard_reward: bool = True
    grad_reduce: str = "micro_batch"
    reports: list = field(default_factory=list)
    _rewards: dict = field(default_factory=dict, repr=False)

    @property
    def is_local(self) -> bool:
        return all(m is None for m in self.placement.meshes.values())

    def shard(self, state: TrainState) -> TrainState:
        """Wrap the trained roles with FSDP2 and set up the rollout layout; identity on one process."""
        if self.is_local:
            if self.release_rollout_memory:
                return state.replace(_cache={**state._cache, "release_engine": True})
            return state
        if "dp" in state._cache or "split" in state._cache:
            # a notebook cell run again: the actor is sharded already, and building the engine from
            # its DTensors failed with an error about the engine
            raise ValueError("Plan.shard: this state is lowered already (Plan.shard was called on it, or on the state it "
                             "came from); shard the state from rk.init (or a checkpoint loaded into one) once")
        from rlkit.engines.torch_engine import TorchEngine
        from rlkit.models.logprobs import LogprobModule, ValueModule
        from rlkit.parallel import fsdp
        from rlkit.parallel.agree import check_models_agree, placement_group

        # every rank must bring the same full model: sharding models built with another seed per
        # rank glued one actor out of halves of different ones, without a word
        applies, group = placement_group(self.placement)
        if applies:
            check_models_agree({"actor": state.actor, "ref": state.ref, "critic": state.critic}, "Plan.shard", group)
        actor_mesh = self.placement.mesh("actor")
        if not self.placement.colocated("actor", "rollout"):
            return self._shard_split(state)
        ranks = list(self.placement.ranks("actor"))
        me = dist.get_rank()
        dp = DataParallel(actor_mesh, ranks.index(me), len(ranks), mean_reduce=False)
        actor = state.actor
        # a state restored from a checkpoint (or trained a few steps in the notebook) before sharding
        # keeps its AdamW moments and its place in the schedule: the rebuild started both afresh.
        # Taken before FSDP replaces the parameters (the optimizer's state is keyed by the old ones)
        carried = _progress(actor, state.optimizer, state.scheduler)
        critic_carried = _progress(state.critic, state.critic_optimizer, state.critic_scheduler) if state.critic is not None else None
        dtype = self.rollout_dtype
        opts = dict(mixed_precision=self.mixed_precision, cpu_offload=self.cpu_offload,
                    activation_checkpointing=self.activation_checkpointing, gradient_reduction="sum")
        pad = getattr(state.tokenizer, "pad_token_id", None)
        rollout_dp = dp
        if self.tp > 1:
            # generation layout TP(tp) x DP(n / tp) on the same ranks; each rank keeps only its shard
            from rlkit.parallel import gather_weights, role_mesh, tensor_parallel

            if len(ranks) % self.tp:
                raise ValueError(f"tp={self.tp} does not divide the {len(ranks)} ranks of the rollout role")
            grid = role_mesh(ranks, (len(ranks) // self.tp, self.tp), ("dp", "tp"))
            actor_module = fsdp.shard_model(LogprobModule(actor), actor_mesh, **opts)
            weights, _ = gather_weights(actor, tensor_parallel(self.tp, dtype=dtype))
            engine = TorchEngine(actor.config, weights, pad_token_id=pad, tp_group=grid["tp"].get_group())
            replica = ranks.index(me) // self.tp
            rollout_dp = DataParallel(grid["dp"], replica, len(ranks) // self.tp)
        else:
            # the engine keeps its own full copy in the generation layout (the actor becomes sharded)
            weights = {k: v.detach().clone() if dtype is None else v.detach().to(dtype) for k, v in actor.named_parameters()}
            engine = TorchEngine(actor.config, weights, pad_token_id=pad)
            actor_module = fsdp.shard_model(LogprobModule(actor), actor_mesh, **opts)
        engine.policy_version = state.policy_version
        cache = dict(state._cache)
        cache.update(dp=dp, actor_module=actor_module, engine=engine, engine_kind="torch",
                     rollout_dp=rollout_dp, weight_sync=self._weight_sync, release_engine=self.release_rollout_memory,
                     grad_reduce=self.grad_reduce)
        critic_opt = state.critic_optimizer
        if state.critic is not None:
            cache["critic_module"] = fsdp.shard_model(ValueModule(state.critic), actor_mesh, **opts)
        if state.ref is not None:
            cache["ref_module"] = fsdp.shard_model(LogprobModule(state.ref), actor_mesh, **opts)
        # optimizers must see the sharded (DTensor) parameters: rebuild them from the spec
        from rlkit.state import warn_sharded_low_precision

        spec = state.optimizer_spec
        optimizer, scheduler = spec.build(actor)
        _restore_progress(actor, optimizer, scheduler, carried, "actor")
        warn_sharded_low_precision(actor, spec, "actor", "Pipeline.lower")
        if state.critic is not None:
            # the critic's own spec (init's critic_optimizer): it was rebuilt with the actor's
            critic_opt, critic_sched = (state.critic_optimizer_spec or spec).build(state.critic)
            _restore_progress(state.critic, critic_opt, critic_sched, critic_carried, "critic")
            warn_sharded_low_precision(state.critic, state.critic_optimizer_spec or spec, "critic", "Pipeline.lower")
        else:
            critic_sched = None
        return state.replace(optimizer=optimizer, scheduler=scheduler, critic_optimizer=critic_opt,
                             critic_scheduler=critic_sched, _cache=cache)

    def _shard_split(self, state: TrainState) -> TrainState:
        """Actor on one group of ranks (FSDP2), rollout on another (its own engine); weights
        travel between the groups by collectives after every update."""
        from rlkit.engines.torch_engine import TorchEngine
        from rlkit.models.logprobs import LogprobModule
        from rlkit.parallel import fsdp

        if state.critic is not None or state.ref is not None:
            raise NotImplementedError(
                "split placement is lowered for critic-free recipes without a reference model (GRPO, Dr. GRPO, "
                "DAPO, RLOO, REINFORCE++ with kl=None); colocate the roles for PPO or a KL penalty"
            )
        if self.tp > 1:
            raise NotImplementedError("tensor-parallel generation is not lowered yet; use tp=1")
        actor_ranks, rollout_ranks = self.placement.ranks("actor"), self.placement.ranks("rollout")
        if set(actor_ranks) & set(rollout_ranks):
            raise ValueError(f"split placement needs disjoint rank groups, got actor {actor_ranks} and rollout {rollout_ranks}")
        me = dist.get_rank()
        cache = dict(state._cache)
        cache.update(split=SplitRoles(tuple(actor_ranks), tuple(rollout_ranks)), synced_version=state.policy_version,
                     split_sync=self._split_sync)
        actor = state.actor
        if me in rollout_ranks:
            dtype = self.rollout_dtype
            weights = {k: v.detach().clone() if dtype is None else v.detach().to(dtype) for k, v in actor.named_parameters()}
            engine = TorchEngine(actor.config, weights, pad_token_id=getattr(state.tokenizer, "pad_token_id", None))
            engine.policy_version = state.policy_version
            mesh = self.placement.mesh("rollout")
            cache.update(engine=engine, engine_kind="torch",
                         rollout_dp=DataParallel(mesh, list(rollout_ranks).index(me), len(rollout_ranks)))
            return state.replace(_cache=cache)
        if me not in actor_ranks:
            raise ValueError(f"rank {me} has no role in this placement (actor {actor_ranks}, rollout {rollout_ranks})")
        mesh = self.placement.mesh("actor")
        opts = dict(mixed_precision=self.mixed_precision, cpu_offload=self.cpu_offload,
                    activation_checkpointing=self.activation_checkpointing, gradient_reduction="sum")
        carried = _progress(actor, state.optimizer, state.scheduler)
        cache.update(actor_module=fsdp.shard_model(LogprobModule(actor), mesh, **opts),
                     dp=DataParallel(mesh, list(actor_ranks).index(me), len(actor_ranks)), grad_reduce=self.grad_reduce)
        optimizer, scheduler = state.optimizer_spec.build(actor)
        _restore_progress(actor, optimizer, scheduler, carried, "actor")
        from rlkit.state import warn_sharded_low_precision

        warn_sharded_low_precision(actor, state.optimizer_spec, "actor", "Pipeline.lower")
        return state.replace(optimizer=optimizer, scheduler=scheduler, _cache=cache)

    def _split_sync(self, state: TrainState) -> dict[str, float]:
        """Collective over all ranks: actor shards -> full weights on every rollout rank."""
        from rlkit.parallel import gather_weights, split

        roles = state._cache["split"]
        weights, report = gather_weights(state.actor, split(roles.actor_ranks, roles.rollout_ranks, dtype=self.rollout_dtype))
        engine = state._cache.get("engine")
        loaded = engine.load_weights(weights, version=state.policy_version) if engine is not None else None
        self.reports.append(report)
        return _sync_report(report, loaded, engine)

    def _weight_sync(self, state: TrainState, engine) -> dict[str, float]:
        from rlkit.parallel import gather_weights, replicated, tensor_parallel

        layout = tensor_parallel(self.tp, dtype=self.rollout_dtype) if self.tp > 1 else replicated(dtype=self.rollout_dtype)
        weights, report = gather_weights(state.actor, layout)
        loaded = engine.load_weights(weights, version=state.policy_version)
        self.reports.append(report)
        return _sync_report(report, loaded, engine)

    def step(self, state: TrainState, prompts: Prompts):
        """One iteration of the pipeline's step on this process's share of the work."""
        return self.pipeline._fn()(state, prompts, self.reward(state))

    def reward(self, state: TrainState):
        """The pipeline's reward as this plan runs it: split over the ranks that hold the global
        Batch (colocated: the data-parallel mesh; split placement: all ranks) unless
        ``shard_reward=False`` or on one process."""
        if self.is_local or not self.shard_reward:
            return self.pipeline.reward
        dp = state._cache.get("dp")
        mesh = dp.mesh if dp is not None and "split" not in state._cache else None
        key = id(mesh)
        if key not in self._rewards:  # one wrapper per mesh, kept by this plan (its own reward)
            from rlkit.parallel import shard_reward

            self._rewards[key] = (mesh, shard_reward(self.pipeline.reward, mesh))
        return self._rewards[key][1]

    def fit(self, state: TrainState, prompts, *, steps: int, batch_size: int, **kwargs):
        """:func:`rlkit.fit` over this plan (same arguments)."""
        from types import SimpleNamespace

        from rlkit.loop import fit

        step = self.pipeline.step
        # the recipe itself when there is one: fit reads its max_new_tokens (the prompt-length check
        # before the first step) and compares its settings across ranks; a bare function is wrapped
        recipe = step if callable(getattr(step, "step", None)) else SimpleNamespace(step=self.pipeline._fn())
        return fit(state, recipe, self.reward(state), prompts, steps=steps, batch_size=batch_size, **kwargs)


def _sync_report(report, loaded, engine) -> dict[str, float]:
    """What a lowered weight sync reports: zeros under the engine's declared ``sync_keys``, the
    engine's own ``load_weights`` report over them (``fused_bytes``, ``buckets``), and the
    collective's ``bytes`` and ``seconds`` over those; a step that syncs logs the same ``sync/*``
    keys as one that does not (:func:`rlkit.transforms.rollout._no_sync`), on every rank and
    placement. The engine's figures had been dropped: step 1 logged ``sync/fused_bytes`` (no
    sync: the declared keys) and later steps did not."""
    out = {k: 0.0 for k in getattr(engine, "sync_keys", ("bytes", "seconds"))}
    out.update({k: float(v) for k, v in (loaded or {}).items()})
    out.update(bytes=float(report.bytes), seconds=float(report.seconds))
    return out


def _progress(model, optimizer, scheduler):
    """The optimizer's per-parameter state (by parameter name, cloned) and hyper-parameters, and the
    scheduler's state, taken before sharding rebuilds both; None for a state that has not stepped."""
    if model is None or optimizer is None:
        return None
    if not optimizer.state and (scheduler is None or getattr(scheduler, "last_epoch", 0) <= 0):
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    per_param = {names[id(p)]: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in st.items()}
                 for p, st in optimizer.state.items() if id(p) in names}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return per_param, groups, (scheduler.state_dict() if scheduler is not None else None)


def _restore_progress(model, optimizer, scheduler, carried, role: str) -> None:
    """Load what :func:`_progress` took into the optimizer and scheduler built over the shards:
    each moment becomes a DTensor laid out as its (sharded) parameter. The float32 master copies
    of :class:`rlkit.optim.MasterWeightAdamW` have no place in an optimizer of sharded weights: they
    are dropped, with a warning."""
    if carried is None:
        return
    import warnings

    per_param, groups, sched_sd = carried
    if len(groups) != len(optimizer.param_groups):
        raise RuntimeError(f"Pipeline.lower: the {role}'s optimizer was rebuilt with {len(optimizer.param_groups)} parameter "
                           f"groups, the state has {len(groups)}; shard the state before its first step")
    if scheduler is not None and sched_sd is not None:
        scheduler.load_state_dict(sched_sd)
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(saved)  # after the scheduler: the learning rate of the step reached
    keeps_master = type(optimizer).__name__ == "MasterWeightAdamW"
    dropped = False
    for name, param in model.named_parameters():
        saved = per_param.get(name)
        if saved is None:
            continue
        state = {}
        for key, value in saved.items():
            if key == "master" and not keeps_master:
                dropped = True
                continue
            if (not keeps_master and torch.is_tensor(value) and value.is_floating_point() and value.shape == param.shape
                    and value.dtype != param.dtype):
                # MasterWeightAdamW keeps float32 moments of bf16/fp16 weights; the optimizer of the
                # shards keeps them in the weights' dtype (torch's fused AdamW refused the mix at the
                # first step: "expected scalar type BFloat16 but found Float")
                value = value.to(param.dtype)
            if torch.is_tensor(value) and hasattr(param, "device_mesh") and value.shape == param.shape:
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
            state[key] = value
        optimizer.state[param] = state
    if dropped:
        warnings.warn(f"Pipeline.lower: the {role}'s float32 master weights are not kept over FSDP shards (the optimizer "
                      "steps the sharded weights themselves); its moments and schedule carry over, the master copies do not",
                      RuntimeWarning, stacklevel=4)


def split_prompts(prompts: Prompts, dp: DataParallel) -> tuple[Prompts, int]:
    """This replica's contiguous share of the prompts and the index of its first prompt."""
    from rlkit.parallel.placement import contiguous_share

    start, stop = contiguous_share(len(prompts), dp.rank, dp.size)
    return prompts[start:stop], start
