"""``rk.launch(plan, state, prompts, steps=..., batch_size=...)``: the notebook's pipeline on N processes.

The same lines that train in a notebook cell::

    plan = rk.Pipeline(recipe, reward=task.reward).lower()
    state, history = plan.fit(state, task.train, steps=100, batch_size=16)

run on N processes by naming the plan (or the pipeline) in ``rk.launch`` instead::

    state, history = rk.launch(plan, state, task.train, steps=100, batch_size=16, nproc_per_node=2)

What happens: the state (its models, optimizers and their moments, schedulers, step, seed and
extras) is written once to the run directory; each worker joins the process group, loads it,
lowers the pipeline again on all ranks with the plan's own options (``mixed_precision``,
``grad_reduce``, ``release_rollout_memory``, ...) and ``lower=``'s over them (what only exists on
several processes: ``lower={"tp": 2}``, or ``lower={"placement": {"actor": 2, "rollout": 2}}`` for
a split placement), shards the state (FSDP2 actor, engine in the generation layout) and runs
:meth:`rlkit.pipeline.Plan.fit`. At the end the workers save the trained state together
(torch.distributed.checkpoint) and the caller loads it into its own state, which it returns: the
notebook goes on with the trained models, optimizer moments and schedule, exactly where the
workers left them. Rank 0's history is returned with it, and every step's metrics stream to the
caller's ``sinks`` as the workers log them (live plots in a notebook); with no sinks (and no
``on_metrics``) a progress bar shows the steps with the latest reward and accuracy.

The state passed in is donated only when the launch succeeds (as ``fit`` donates it); when a
worker fails, it is untouched and the :class:`rlkit.launch.WorkerError` is raised: pass a
``checkpointer=`` (a folder every worker can reach) to keep the workers' progress.

Why a file and a checkpoint rather than pickled arguments: torch elastic hands ``fn``'s arguments
to every worker through a pipe, a copy per worker in memory, while ``torch.load(mmap=True)`` maps
one file; and the trained state leaves FSDP2 shards on every rank, which the distributed
checkpoint gathers without any rank holding the whole optimizer state twice.
"""
from __future__ import annotations

import inspect
import os
from typing import Any

#: the run directory's subfolders for the state that goes in and the state that comes out
STATE_FILE = "state.pt"
RESULT_DIR = "result"

#: fit's keyword arguments that ``rk.launch(plan, ...)`` passes through to the workers (``lower=`` goes to Pipeline.lower)
FIT_KEYWORDS = ("sinks", "eval_fn", "eval_every", "checkpointer", "shuffle")

def lowering_options(plan) -> dict[str, Any]:
    """The keyword arguments of :meth:`rlkit.Pipeline.lower` that made ``plan`` (all but the placement)."""
    from rlkit.pipeline import Pipeline

    names = [n for n in inspect.signature(Pipeline.lower).parameters if n not in ("self", "placement")]
    return {name: getattr(plan, name) for name in names}


def _lowering(options: dict, lower: Any) -> dict[str, Any]:
    """The plan's lowering ``options`` with ``lower`` (``rk.launch(plan, ..., lower={...})``) over
    them: keywords of :meth:`rlkit.Pipeline.lower`, applied in the workers, where a tensor-parallel
    degree or a split placement can exist (``pipe.lower(tp=2)`` in one process is an error).
    ``placement`` there is None (every role on all ranks) or ``{role: processes}``, which each
    worker turns into :func:`rlkit.parallel.split_placement`."""
    from collections.abc import Mapping

    from rlkit.pipeline import Pipeline

    if lower is None:
        return dict(options)
    if not isinstance(lower, Mapping):
        raise TypeError(f"launch: lower must be a dict of Pipeline.lower keywords, e.g. {{'tp': 2}}, got {lower!r}")
    names = [n for n in inspect.signature(Pipeline.lower).parameters if n != "self"]
    unknown = sorted(set(lower) - set(names))
    if unknown:
        raise TypeError(f"launch: lower={dict(lower)!r}: {', '.join(map(repr, unknown))} is not a keyword of Pipeline.lower "
                        f"(it takes {', '.join(names)})")
    placement = lower.get("placement")
    if placement is not None and not (isinstance(placement, Mapping) and placement
                                      and all(isinstance(k, str) and isinstance(v, int) and v >= 1 for k, v in placement.items())):
        raise TypeError("launch: lower['placement'] must be None (every role on all ranks) or a dict of role -> number of "
                        "processes, e.g. {'actor': 2, 'rollout': 2} (each worker builds split_placement from it; a "
                        f"DeviceMesh or Placement exists only inside the workers), got {placement!r}")
    return {**options, **lower}


def _world(launch_options: dict) -> int | None:
    """The number of workers when it is fixed (one machine, or ``nnodes`` without a range), else None."""
    nnodes = launch_options.get("nnodes", 1)
    if isinstance(nnodes, str):
        lo, _, hi = nnodes.partition(":")
        nnodes = int(lo) if not hi or hi == lo else None
    return None if nnodes is None else nnodes * launch_options.get("nproc_per_node", 1)


def _check_shape(options: dict, batch_size: int, world: int | None) -> None:
    """What the lowering would refuse in every worker, said here: a placement that does not add up
    to the processes, a ``tp`` that does not divide them, a batch that the generation replicas
    cannot split evenly (fit failed at the first rollout, after the workers had started)."""
    if world is None:
        return
    placement, tp = options.get("placement"), options.get("tp", 1) or 1
    if placement is not None:
        if sum(placement.values()) != world:
            raise ValueError(f"launch: lower['placement']={dict(placement)!r} places {sum(placement.values())} process(es); "
                             f"the launch starts {world}: make them equal")
        replicas = placement.get("rollout", world)
    else:
        if world % tp:
            raise ValueError(f"launch: lower['tp']={tp} does not divide the {world} process(es) of the launch; use a tp that "
                             "divides nproc_per_node x nnodes")
        replicas = world // tp
    if batch_size % replicas:
        raise ValueError(f"launch: batch_size={batch_size} prompts cannot be split evenly over the {replicas} generation "
                         f"replica(s) of {world} process(es); use a multiple of {replicas}")


def _checked(target, args: tuple, kwargs: dict, launch_options: dict):
    """``(pipeline, options, state, prompts, steps, batch_size, fit_kwargs)`` from ``rk.launch(plan,
    ...)``'s arguments, each wrong one named before any process starts."""
    from rlkit.loop import _check_prompt_lengths, _checked_run, fit
    from rlkit.pipeline import Plan
    from rlkit.state import TrainState

    if isinstance(target, Plan):
        if not target.is_local:
            raise ValueError(
                "launch: this Plan was lowered onto a torch.distributed placement of this process; launch lowers the "
                "pipeline again in its workers, on their own ranks, so give it a plan lowered in the notebook "
                "(pipe.lower(), placement None) or the Pipeline itself")
        pipeline, options = target.pipeline, lowering_options(target)
    else:
        pipeline, options = target, {}
    if len(args) != 2:
        raise TypeError(
            f"launch: a {type(target).__name__} is launched as rk.launch(plan, state, prompts, steps=..., batch_size=..., "
            f"nproc_per_node=...): after the plan come exactly the state and the prompts, got {len(args)} positional "
            "argument(s)")
    state, prompts = args
    if not isinstance(state, TrainState):
        raise TypeError(f"launch: the state after the plan must be a TrainState (from rk.init), got {type(state).__name__}")
    state._check()  # a donated handle is named here, not in every worker
    if "dp" in state._cache or "split" in state._cache:
        raise ValueError("launch: this state is sharded already (plan.shard ran on it on several processes); give the "
                         "state from rk.init or a checkpoint: each worker shards its own copy")
    kwargs = dict(kwargs)
    options = _lowering(options, kwargs.pop("lower", None))
    missing = [name for name in ("steps", "batch_size") if name not in kwargs]
    unknown = sorted(set(kwargs) - {"steps", "batch_size", *FIT_KEYWORDS})
    if missing or unknown:
        said = ([f"it needs {' and '.join(missing)} (as plan.fit does)"] if missing else []) + (
            [f"{', '.join(map(repr, unknown))} is not an argument of plan.fit (it takes steps, batch_size, "
             f"{', '.join(FIT_KEYWORDS)})"] if unknown else [])
        raise TypeError("launch: with a plan, the keywords go to plan.fit (and lower= to Pipeline.lower): " + "; ".join(said))
    # the same checks fit makes before its first step, here and not after N workers have started
    inspect.signature(fit).bind(state, pipeline.step, pipeline.reward, prompts, **kwargs)
    from rlkit._checks import check_switch, int_at_least

    int_at_least(kwargs["steps"], "launch: steps", 0, " (the step count to reach)")
    if "shuffle" in kwargs:
        check_switch(kwargs["shuffle"], "launch: shuffle", "True: each epoch's batches from a new random order of the prompts")
    prompts = _checked_run(state, prompts, kwargs["steps"], kwargs["batch_size"], kwargs.get("eval_every", 0), kwargs.get("eval_fn"))
    _check_shape(options, kwargs["batch_size"], _world(launch_options))
    if state.step < kwargs["steps"]:
        _check_prompt_lengths(state, pipeline.step, prompts)
    if launch_options.get("nnodes", 1) not in (1, "1", "1:1") and launch_options.get("run_dir") is None:
        raise ValueError("launch: a plan on several machines needs run_dir=, a folder every machine reaches at the same "
                         "path: the workers read the state from it and save the trained state into it")
    fit_kwargs = {k: v for k, v in kwargs.items() if k not in ("steps", "batch_size")}
    return pipeline, options, state, prompts, kwargs["steps"], kwargs["batch_size"], fit_kwargs


class _Emit:
    """The workers' sink: rank 0's metrics of every step, sent to the caller (``rlkit.launch.emit``)."""

    def on_step(self, step: int, metrics: dict) -> None:
        from rlkit.launch import emit

        emit({**metrics, "step": step})


class _Feed:
    """The caller's ``on_metrics``: each streamed step into the caller's sinks (and ``on_metrics``).

    A sink (or ``on_metrics``) that raises does not stop the others or the run: the workers go on
    (they cannot be told), every other sink gets every step, and the first failure is kept in
    ``error`` as ``(what, step, exception)`` for ``launch_fit`` to raise once the trained state is
    back. The first sink that raised used to keep the sinks after it from ever getting a step, and
    the launch then raised "on_metrics raised ..." without returning the trained state."""

    def __init__(self, sinks: list, on_metrics):
        self.sinks = sinks
        self.on_metrics = on_metrics
        self.error: tuple[str, Any, BaseException] | None = None
        self.last_step: int | None = None  # the last step fed: the run's end, for the sinks' on_end

    def _failed(self, what: str, step: Any, exc: BaseException) -> None:
        if self.error is None:
            self.error = (what, step, exc)

    def __call__(self, rank: int, record: dict) -> None:
        if self.on_metrics is not None:
            try:
                self.on_metrics(rank, dict(record))
            except Exception as e:  # noqa: BLE001 - raised by launch_fit after the run, with the trained state
                self._failed(f"on_metrics {self.on_metrics!r:.80}", record.get("step"), e)
        record = dict(record)
        step = record.pop("step", None)
        if step is None:
            return
        self.last_step = step
        # emit writes NaN and infinities as numbers (Python's JSON), so a text metric "nan" stays text
        metrics = record
        for sink in self.sinks:
            try:
                sink.on_step(step, metrics)
            except Exception as e:  # noqa: BLE001 - as rk.fit's broadcast: the other sinks still get the step
                self._failed(f"sink {sink!r:.80}", step, e)


def _fit_worker(pipeline, options: dict, state_file: str, prompts, steps: int, batch_size: int, fit_kwargs: dict,
                result_dir: str, on_accelerator: bool, compiled: tuple[str, ...]):
    """In every worker: join the group, load the state, lower, shard, fit, save the trained state together."""
    import torch

    from rlkit import checkpoint
    from rlkit.models.compile import compile_layers
    from rlkit.parallel.mesh import default_device, init_distributed

    info = init_distributed()
    where = default_device() if on_accelerator else torch.device("cpu")
    if not os.path.isfile(state_file):
        import socket

        # the caller wrote it before any worker started: a worker that cannot see it is on a machine
        # where run_dir is another folder (each node's local disk), and would fail in torch.load
        raise FileNotFoundError(
            f"launch: rank {info.rank} (on {socket.gethostname()}) cannot see the state the caller wrote to {state_file}. "
            "run_dir must be a folder every machine of the launch reaches at the same path (a shared or network file "
            "system): the workers read the state from it and save the trained state into it"
        )
    state = _rebuilt_optimizers(torch.load(state_file, map_location=where, weights_only=False, mmap=True))
    for role in compiled:  # compiled blocks come out of a pickle eager: compile them as the caller had them
        compile_layers(getattr(state, role))
    options = dict(options)
    placement = options.pop("placement", None)
    if placement is not None:  # {role: processes}, as lower= gave it
        from rlkit.parallel import split_placement

        placement = split_placement(placement)
    plan = pipeline.lower(placement, **options)
    state = plan.shard(state)
    state, history = plan.fit(state, prompts, steps=steps, batch_size=batch_size, sinks=[_Emit()], **fit_kwargs)
    checkpoint.save(state, result_dir, checksum=False, save_ref=False)
    return history


def _rebuilt_optimizers(state):
    """``state`` with its optimizers and schedulers built afresh from their specs and loaded with the
    unpickled ones' state: a pickled optimizer loses the hook its scheduler put on ``step`` (torch
    then warns at the first scheduler step that ``optimizer.step()`` was overridden)."""
    changes = {}
    for model, opt, sched, spec, names in (
        (state.actor, state.optimizer, state.scheduler, state.optimizer_spec, ("optimizer", "scheduler")),
        (state.critic, state.critic_optimizer, state.critic_scheduler, state.critic_optimizer_spec or state.optimizer_spec,
         ("critic_optimizer", "critic_scheduler")),
    ):
        if model is None or opt is None or spec is None:
            continue
        new_opt, new_sched = spec.build(model)
        new_opt.load_state_dict(opt.state_dict())
        if sched is not None and new_sched is not None:
            new_sched.load_state_dict(sched.state_dict())
        changes.update({names[0]: new_opt, names[1]: new_sched if sched is not None else None})
    return state.replace(**changes) if changes else state


def launch_fit(target, args: tuple, kwargs: dict, launch_options: dict):
    """``rk.launch(plan, state, prompts, steps=..., batch_size=..., **launch_options)``; see the module."""
    import shutil
    import tempfile

    import cloudpickle
    import torch

    from rlkit import checkpoint
    from rlkit.launch import WorkerError, launch
    from rlkit.models.compile import is_compiled
    from rlkit.observe.sinks import as_sinks, end_after_error, end_all, rewind_all

    pipeline, options, state, prompts, steps, batch_size, fit_kwargs = _checked(target, args, kwargs, launch_options)
    sinks = as_sinks(fit_kwargs.pop("sinks", None), "launch")
    run_dir = os.path.abspath(launch_options.pop("run_dir", None) or tempfile.mkdtemp(prefix="rlkit_run_"))
    os.makedirs(run_dir, exist_ok=True)
    state_file = os.path.join(run_dir, STATE_FILE)
    result_dir = os.path.join(run_dir, RESULT_DIR)
    shutil.rmtree(result_dir, ignore_errors=True)  # a reused run_dir's earlier result must not be loaded as this one's
    # the engine and the lowering live in the cache: each worker builds its own
    shipped = state.replace(_cache={})
    try:
        with open(state_file + ".tmp", "wb") as f:
            torch.save(shipped, f, pickle_module=cloudpickle)
    except Exception as e:
        raise TypeError(f"launch: the state cannot be written for the workers ({type(e).__name__}: {e}); its models, "
                        "optimizers and tokenizer must be picklable") from e
    os.replace(state_file + ".tmp", state_file)
    if state.step > 0:
        rewind_all(sinks, state.step)  # a resumed state: the sinks drop the steps this run redoes, as in fit
    on_metrics = launch_options.pop("on_metrics", None)
    bar = None
    if on_metrics is None and not sinks:
        # the default: a progress bar over the steps with the latest reward, accuracy, entropy, KL and
        # log-prob gap (what `rlkit run` shows), not every metric of every step as a line of text
        from rlkit.observe.console import ConsoleSink

        bar = ConsoleSink(steps, "rk.launch")
        sinks = [bar]
    feed = _Feed(sinks, on_metrics)
    on_accelerator = state.device.type != "cpu"
    compiled = tuple(role for role in ("actor", "ref", "critic") if getattr(state, role) is not None and is_compiled(getattr(state, role)))
    try:
        history = launch(_fit_worker, pipeline, options, state_file, prompts, steps, batch_size, fit_kwargs, result_dir,
                         on_accelerator, compiled, on_metrics=feed, run_dir=run_dir, **launch_options)
    except BaseException as e:
        if isinstance(e, WorkerError) and hasattr(e, "add_note"):  # Python 3.11+
            e.add_note("rk.launch(plan, ...): the state passed in is unchanged (the workers trained copies of it); a state "
                       "the worker's traceback mentions (exc.state) lived in that worker. To keep a failed run's progress, "
                       "pass checkpointer=rk.Checkpointer(folder) and resume from that folder")
        end_after_error(e, sinks, feed.last_step if feed.last_step is not None else state.step, "rk.launch")
        raise
    finally:
        if bar is not None:
            bar.close()
        if os.path.exists(state_file):  # a copy of the caller's state: as large as the models and optimizer
            os.remove(state_file)
    try:
        end_all(sinks, feed.last_step if feed.last_step is not None else state.step)  # as fit: the dashboard draws the last step
    except Exception as e:  # noqa: BLE001 - as a sink's on_step: raised below, with the trained state
        feed._failed("a sink's on_end", feed.last_step, e)
    trained = checkpoint.latest(result_dir)
    if trained is None:
        raise RuntimeError(f"launch: the workers finished but left no trained state in {result_dir}")
    trained_state = checkpoint.load(state, trained, checksum=False, load_ref=False)
    state.donate("rlkit.launch", trained_state)  # the old handle's error names the launch, not the load inside it
    shutil.rmtree(result_dir, ignore_errors=True)  # loaded: the caller holds it now
    if feed.error is not None:
        what, step, exc = feed.error
        error = RuntimeError(
            f"rk.launch: {what} raised {type(exc).__name__}: {exc} at step {step}; the other sinks got every step and "
            f"the run finished: exc.state is the trained state (at step {trained_state.step}; the state passed in is "
            f"donated to it) and exc.history rank 0's history (in a notebook: import sys; state = sys.last_value.state)")
        error.state, error.history = trained_state, history
        raise error from exc
    return trained_state, history

