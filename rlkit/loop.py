"""``fit``: the plain loop over a recipe's ``step``, with evaluation, sinks and checkpoints.

It is a convenience, not a Trainer: the loop body is ``state, metrics = recipe.step(state,
prompts, reward)`` and you can always write that loop yourself in a notebook cell.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Callable, Iterable, Mapping

from rlkit._checks import check_switch, int_at_least
from rlkit.data import PromptSet, load_prompts, prompt_fingerprint
from rlkit.observe.sinks import as_sinks, broadcast, end_after_error, end_all, rewind_all, step_row

#: ``state.extras`` key of the batch size that ``state.data_position`` counts batches of
BATCH_SIZE_KEY = "fit/batch_size"
#: ``state.extras`` key of the fingerprint (:func:`rlkit.data.prompt_fingerprint`) of the prompts it counts
PROMPTS_KEY = "fit/prompts"
#: ``state.extras`` key of the training wall time (seconds) of the steps so far, over every ``fit`` call
ELAPSED_KEY = "fit/elapsed_s"


def fit(
    state,
    recipe,
    reward: Callable,
    prompts: PromptSet,
    *,
    steps: int,
    batch_size: int,
    sinks: Iterable[Any] = (),
    eval_fn: Callable[[Any], dict[str, float]] | None = None,
    eval_every: int = 0,
    checkpointer: Any = None,
    shuffle: bool = True,
):
    """Run ``recipe.step`` until ``state.step == steps``; returns ``(state, history)``.

    ``history``: one row per step this call ran, ``{"step": n, **metrics}`` (a ``ListSink``'s
    rows; on a resumed run the first row's step is the resumed state's step + 1).

    ``prompts``: a :class:`rlkit.data.PromptSet`, or anything :func:`rlkit.load_prompts` reads (a
    list of strings or dicts, a path to a .jsonl, .json, .csv or .parquet file, a pandas DataFrame, a ``datasets.Dataset``), tokenized with the state's
    tokenizer. Resumable: batches come from ``prompts.batch_at(state.data_position, ...)``, so a
    state restored from a checkpoint continues with exactly the batches the uninterrupted run
    would see. ``data_position`` counts batches, so the batch size is kept with it (in
    ``state.extras["fit/batch_size"]``, saved in checkpoints): resumed with another ``batch_size``,
    the position is converted when the prompts used so far in the current epoch are a whole number
    of new batches (the run goes on with the next unseen prompt), and refused with a ``ValueError``
    otherwise (the new batches would repeat some prompts and skip others). A fingerprint of the
    prompt set (:func:`rlkit.data.prompt_fingerprint`, in ``state.extras["fit/prompts"]``) is
    kept with the position too: resumed on other prompts, ``fit`` warns (``RuntimeWarning``) and
    goes on at the same position of the new set.

    ``eval_fn(state) -> {"accuracy": ...}`` runs every ``eval_every`` steps and after the last step;
    the two go together (``eval_every=0``, the default, with ``eval_fn=None``: no evaluation; one
    without the other is a ``ValueError``). ``shuffle``: True or False (a string such as ``"no"`` is
    refused). ``checkpointer.maybe_save(state)`` is called after every step when
    given, and the last step is saved too (``Checkpointer.save_final``, whatever its ``every``, 0
    included), so a finished run resumes finished instead of redoing the steps since its last
    periodic checkpoint (or the whole run). ``recipe`` may be a name (``"grpo"``:
    ``rk.recipes.get``); ``sinks`` one sink or several. A state past step 0 (a resumed run) first
    calls ``sink.rewind(state.step)`` on the sinks that have it: :class:`rlkit.observe.JSONLSink`
    and the in-memory sinks drop what they logged for later steps, which this run redoes, so a
    metrics file has each step once, in order. When the run stops (finished, or stopped by an
    exception, which still leaves ``fit`` as it was) ``sink.on_end(step)`` is called on the sinks
    that have it, with the last step done: the notebook dashboard draws the last step then, which
    its ``every`` may skip. On several processes only rank 0 calls the sinks (the metrics are the
    run's, the same on every rank), so a script may build its sinks on every rank: a sink with
    ``all_ranks = True`` is called on every rank. A sink that raises stops the run after its step;
    on a lowered state every rank does (one small all-reduce per step): the others raise
    :class:`rlkit.parallel.FailedOnAnotherRank`.

    Each step's metrics get ``time/step_s`` and ``time/elapsed_s``, the run's training wall time:
    it goes on from ``state.extras["fit/elapsed_s"]`` (kept in checkpoints), so a second ``fit``
    on the same state or a resumed run continues the clock; the time between calls is not counted.

    Before the first step every prompt of the set is checked against the model's context (its
    tokens plus the recipe's ``max_new_tokens``): a ``ValueError`` names the prompt-set rows that
    do not fit, where the rollout of their batch would have failed steps later.

    ``recipe.step`` returns ``(state, metrics)``, the TrainState first; anything else (the two
    swapped, the metrics alone) is a ``TypeError`` naming the step (its ``exc.state`` is the state
    it returned, if any).

    Nothing is lost when the run stops early: an exception leaving ``fit`` (an error in a reward
    or ``eval_fn``, or Ctrl-C) carries the latest state and the history so far as ``exc.state``
    and ``exc.history`` (the state passed in was donated to the first update). A step whose
    evaluation was interrupted keeps its training metrics (in ``exc.history`` and the sinks).
    Using the donated handle again (the cell run a second time) raises a ``DonatedStateError``
    that names the stop and carries the same latest state as its ``.state``.
    """
    state, recipe, sinks = _check_fit_args(state, recipe, reward, steps, sinks, checkpointer)
    shuffle = check_switch(shuffle, "fit: shuffle", "True: each epoch's batches from a new random order of the prompts")
    history: list[dict[str, float]] = []
    prompts = _checked_run(state, prompts, steps, batch_size, eval_every, eval_fn)
    _check_reward_inputs(state, recipe, reward, prompts)
    # every rank of a lowered state must run fit with the same settings (one all-gather per call;
    # a no-op on one process): a batch_size, steps or lr given to one rank only trained silently or hung
    from rlkit.parallel.agree import check_fit_agrees, lowered_group

    _warn_unlowered(state)
    check_fit_agrees(state, recipe, prompts, steps=steps, batch_size=batch_size, shuffle=shuffle,
                     eval_every=eval_every, checkpointer=checkpointer)
    # the ranks of a lowered state agree after each step's sinks whether one raised (one all-reduce):
    # a sink failing on rank 0 alone stopped it there while the others waited in the next step
    agree_sinks, sink_group = lowered_group(state)
    if state.step < steps:
        _check_prompt_lengths(state, recipe, prompts)
        ids = getattr(prompts, "ids", None)
        if ids:
            from rlkit.data import check_padding

            check_padding(ids, state.tokenizer, "fit")  # the whole set, before the first step
    position = _data_position(state, prompts, batch_size)
    fingerprint = _check_same_prompts(state, prompts, position)
    if state.step > 0:
        rewind_all(sinks, state.step)
    t_start = time.perf_counter()
    elapsed_before = _elapsed_before(state)
    given = state  # the handle passed in (donated to the first update)
    first_step, ended = state.step, False  # ended: the sinks were told the run ended (once: not again when that raised)
    try:
        # the checkpointer's SIGTERM handler (save at the next step boundary) only while the loop runs
        with getattr(checkpointer, "armed", contextlib.nullcontext)():
            while state.step < steps:
                batch_prompts = prompts.batch_at(position, batch_size, seed=state.seed, shuffle=shuffle)
                t0 = time.perf_counter()
                scheduled = _scheduler_steps(state) if state.step == first_step else None
                state, metrics = _checked_step_output(recipe.step(state, batch_prompts, reward), recipe)
                if scheduled is not None:
                    _warn_schedule_ends_early(state, scheduled, steps)
                position += 1
                now = time.perf_counter()
                elapsed = elapsed_before + (now - t_start)
                extras = {**state.extras, BATCH_SIZE_KEY: batch_size, PROMPTS_KEY: fingerprint, ELAPSED_KEY: elapsed}
                state = state.replace(data_position=position, extras=extras)
                metrics["time/step_s"] = now - t0
                metrics["time/elapsed_s"] = elapsed
                if eval_fn is not None and eval_every and (state.step % eval_every == 0 or state.step == steps):
                    try:
                        evaluated = _eval_metrics(eval_fn, state)
                    except BaseException:
                        # Ctrl-C in a slow evaluation (or an eval_fn error) after the step trained: its
                        # training metrics are kept and logged, as exc.state is this step's state
                        history.append(step_row(state.step, metrics))
                        broadcast(sinks, state.step, metrics)
                        raise
                    metrics.update({f"eval/{k}": v for k, v in evaluated.items()})
                history.append(step_row(state.step, metrics))
                sink_error = None
                try:
                    broadcast(sinks, state.step, metrics)
                except Exception as exc:  # noqa: BLE001 - raised below, on every rank
                    sink_error = exc
                if agree_sinks:
                    sink_error = _sink_error_everywhere(sink_error, sink_group, state.step)
                if sink_error is not None:
                    # a failing sink (a metrics server gone) stops the run, but the step it logged has
                    # trained: its checkpoint, when one is due, is saved first (it was skipped, and a
                    # resume redid the step). Ctrl-C in a sink stops at once, as everywhere. Several
                    # processes save only where the ranks agreed that a sink failed (a lowered state):
                    # a save is a collective, and a sink may fail on one rank alone
                    if checkpointer is not None and (agree_sinks or not _several_processes()):
                        checkpointer.maybe_save(state)
                    raise sink_error
                if checkpointer is not None:
                    # after the sinks: a step inside a checkpoint has its metrics logged, even when this
                    # save is the last thing a preempted (SIGTERM) run does
                    checkpointer.maybe_save(state)
            if history and checkpointer is not None and callable(getattr(checkpointer, "save_final", None)):
                checkpointer.save_final(state)
        ended = True
        end_all(sinks, state.step)
    except BaseException as exc:  # noqa: BLE001 - re-raised; only annotated
        if isinstance(exc, StepReturnError) and exc.returned_state is not None:
            state = exc.returned_state  # the step's update donated the state passed in: this is the latest one
        elif _is_live_state(getattr(exc, "state", None)):
            state = exc.state  # an update that finished, then failed (NonFiniteError, a warning as error): its new state
        _attach_progress(exc, state, history, checkpointer)
        if not ended:
            # a state mid-update (donated) is not readable: the last step done is the last one logged
            end_after_error(exc, sinks, state.step if _is_live_state(state) else first_step + len(history), "rk.fit")
        from rlkit.state import record_stop

        # the cell run again with the donated handle points at the latest state, or says none is left
        record_stop(given, state if _is_live_state(state) else None, exc, during=first_step + len(history) + 1)
        raise
    return state, history


def _warn_unlowered(state) -> None:
    """Warn when fit runs on several processes with a state no Plan sharded: every rank then trains
    its own full copy on the whole batch (N times the work, no data parallelism) and saves it, which a
    launched script that forgot ``Pipeline(...).lower().shard(state)`` did without a word. Independent
    runs per rank (one seed each) are legitimate: a warning, not an error."""
    import warnings

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if "dp" in state._cache or "split" in state._cache:
        return
    warnings.warn(f"fit: {dist.get_world_size()} processes run this fit, but the state was not lowered: each rank trains "
                  "its own full copy on the whole batch (no data parallelism). Shard it first: plan = rk.Pipeline(recipe, "
                  "reward).lower(); state = plan.shard(state); plan.fit(state, ...). Ignore this for independent runs per rank",
                  RuntimeWarning, stacklevel=3)


def _this_ranks_sinks(sinks: list) -> list:
    """The sinks this process calls: all of them on one process; on several (torch.distributed
    initialised, more than one rank) those of rank 0 only, whose metrics are the run's (every rank
    reports the same, reduced figures), unless a sink sets ``all_ranks = True``. A script launched
    on 2 ranks with a JSONLSink on each wrote every step twice into one file, and a progress bar per rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or dist.get_rank() == 0:
        return sinks
    return [s for s in sinks if getattr(s, "all_ranks", False)]


def _elapsed_before(state) -> float:
    """The wall time of the steps before this ``fit`` (``state.extras["fit/elapsed_s"]``, kept in
    checkpoints), so ``time/elapsed_s`` goes on across a resumed run or a second ``fit`` call on
    the same state instead of restarting at zero; a state at step 0 starts at zero (a fresh run
    from a copied state does not inherit the time of another one's steps)."""
    value = state.extras.get(ELAPSED_KEY) if state.step > 0 else None
    try:
        value = float(value) if value is not None else 0.0
    except (TypeError, ValueError):
        return 0.0
    return value if value >= 0.0 and value == value and value != float("inf") else 0.0


class StepReturnError(TypeError):
    """The recipe's step returned something other than ``(state, metrics)``; ``returned_state`` is the
    TrainState it returned, if any (the one passed in was donated to its update)."""

    def __init__(self, message: str, state=None):
        super().__init__(message)
        self.returned_state = state


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"a {type(value).__name__} ({inner})"
    return f"a {type(value).__name__}"


def _checked_step_output(result: Any, recipe):
    """``recipe.step``'s ``(state, metrics)``, checked: a step returning ``(metrics, state)`` (or
    the metrics alone) failed further on with "'dict' object has no attribute 'extras'", naming
    neither the step nor what it must return. The metrics are returned as a dict (fit adds its
    timings to them)."""
    from rlkit.state import TrainState

    if isinstance(result, (tuple, list)) and len(result) == 2:
        new_state, metrics = result
        if isinstance(new_state, TrainState) and isinstance(metrics, Mapping):
            return new_state, metrics if isinstance(metrics, dict) else dict(metrics)
    name = f"{type(recipe).__name__}.step"
    returned = next((x for x in (result if isinstance(result, (tuple, list)) else (result,)) if isinstance(x, TrainState)), None)
    swapped = (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[1], TrainState)
               and isinstance(result[0], Mapping))
    hint = " (the two are swapped: `return state, metrics`)" if swapped else ""
    raise StepReturnError(
        f"fit: {name} returned {_describe(result)}; a step must return (state, metrics): the TrainState after its update "
        f"(rk.update returns it first) and a dict of float metrics{hint}", returned)


def _check_prompt_lengths(state, recipe, prompts) -> None:
    """Refuse, before the first step, a prompt set holding a prompt that does not fit the actor's
    context with the recipe's ``max_new_tokens``: ``rollout`` found it only when its batch came up
    (many steps in) and named its row within the batch ("prompt 0"), not in the prompt set. A
    recipe without an int ``max_new_tokens`` (a custom one) is checked for the prompts alone."""
    from rlkit._checks import context_limit, is_int

    limit = context_limit(state.actor)
    ids = getattr(prompts, "ids", None)
    if limit is None or not ids:
        return
    new = getattr(recipe, "max_new_tokens", None)
    new = new if is_int(new) and new > 0 else 0
    lengths = [len(row) for row in ids]
    over = [i for i, n in enumerate(lengths) if n + new > limit]
    if not over:
        return
    i = max(over, key=lambda k: (lengths[k], -k))  # the longest; the first of equal ones
    shown = over[:10]
    rows = ", ".join(map(str, shown)) + (f", ... ({len(over)} in all)" if len(over) > len(shown) else "")
    with_new = f" and with max_new_tokens={new} needs {lengths[i] + new} positions," if new else ","
    raise ValueError(
        f"fit: prompt row {i} of the prompt set has {lengths[i]} tokens{with_new} over the model's context of "
        f"{limit} tokens (max_position_embeddings); rows that do not fit: {rows}. Shorten or drop those prompts, lower the "
        "recipe's max_new_tokens, or load the prompts with rk.load_prompts(..., max_prompt_tokens=..., truncate=True)"
    )


def _data_position(state, prompts, batch_size: int) -> int:
    """The stream position (in batches of ``batch_size``) where ``state``'s run goes on.

    ``state.data_position`` counts batches of the size recorded in ``state.extras`` (none
    recorded: taken to be ``batch_size``). Under another batch size, batch ``k`` of an epoch is
    other prompts, so the position is converted: the prompts used in the current epoch must be a
    whole number of new batches, or some would be trained on twice and others never."""
    position, before = state.data_position, state.extras.get(BATCH_SIZE_KEY)
    if not position or before is None or before == batch_size:
        return position
    n = len(prompts)
    if n // before == 0:
        raise ValueError(
            f"fit: the state's data_position={position} counts batches of batch_size={before} (state.extras"
            f"[{BATCH_SIZE_KEY!r}]), more than these {n} prompts: it comes from a run on another prompt set; "
            f"pass that run's prompts, or start the data over with state.replace(data_position=0)")
    if n // batch_size == 0:
        return position  # batch_at says batch_size is too large for the prompts
    epoch, k = divmod(position, n // before)
    used = k * before
    if used % batch_size:
        raise ValueError(
            f"fit: batch_size={batch_size} differs from the batch_size={before} the state's data_position={position} "
            f"counts (state.extras[{BATCH_SIZE_KEY!r}], saved with checkpoints): {used} prompt(s) of epoch {epoch} are used, "
            f"not a whole number of batches of {batch_size}, so the new batches would repeat some prompts and skip others. "
            f"Pass batch_size={before} (or one that divides {used}), or start the data over with state.replace(data_position=0)")
    return epoch * (n // batch_size) + used // batch_size


def _check_same_prompts(state, prompts, position: int) -> str | None:
    """The prompts' fingerprint; a warning when the state's ``data_position`` counts batches of
    another prompt set (its fingerprint, kept in ``state.extras``, differs): the run goes on at the
    same position of the new set, which a changed data set rarely means."""
    fingerprint = prompt_fingerprint(prompts)
    before = state.extras.get(PROMPTS_KEY)
    if position and fingerprint is not None and before is not None and before != fingerprint:
        import warnings

        warnings.warn(
            f"fit: the state's data_position={position} counts batches of another prompt set than these {len(prompts)} "
            f"prompts (fingerprint {before} in state.extras[{PROMPTS_KEY!r}], these prompts {fingerprint}): the run goes "
            f"on at batch {position} of the new set. If that is not what you meant, pass the run's own prompts, or start the "
            f"data over with state.replace(data_position=0)", RuntimeWarning, stacklevel=3)
    return fingerprint


def _checked_run(state, prompts, steps: int, batch_size: int, eval_every: int, eval_fn):
    """``prompts`` as a PromptSet, after fit's checks of the run's extent and evaluation (``steps``
    already an int): made before any work, by fit and, in the caller before its workers start, by
    ``rk.launch(plan, ...)`` (which reads the prompts once there, not once per worker)."""
    if steps < state.step:
        raise ValueError(f"steps={steps} is below the state's step {state.step}; the run is already past it")
    int_at_least(batch_size, "batch_size", 1, " (prompts per step)")
    int_at_least(eval_every, "eval_every", 0, " (0: no evaluation)")
    if eval_every and eval_fn is None:
        raise ValueError(f"eval_every={eval_every} asks for evaluation but eval_fn is None; pass eval_fn=lambda state: {{...}} or eval_every=0")
    if eval_fn is not None and not eval_every:
        # the opposite mistake: the run finished without a single evaluation, and without a word
        raise ValueError(f"eval_fn is given but eval_every={eval_every!r} (never): pass eval_every=N to evaluate every N steps "
                         "and after the last (eval_every=steps: only after the last), or drop eval_fn")
    if not hasattr(prompts, "batch_at"):
        if state.tokenizer is None:
            raise TypeError(f"prompts is a {type(prompts).__name__} and the state has no tokenizer to read it with; "
                            "pass rk.load_prompts(prompts, tokenizer), or rk.init(..., tokenizer=...)")
        prompts = load_prompts(prompts, state.tokenizer)
    return prompts


def _check_fit_args(state, recipe, reward, steps, sinks, checkpointer):
    """Check ``fit``'s arguments before the first step (a wrong one used to fail after a step,
    with the state passed in already donated); a recipe may be given by name."""
    from rlkit.state import TrainState

    if not isinstance(state, TrainState):
        raise TypeError(f"fit: state must be a TrainState (from rk.init), got {type(state).__name__}")
    if isinstance(recipe, str):
        from rlkit.recipes import get

        recipe = get(recipe)
    from rlkit.recipes import check_not_uncalled

    check_not_uncalled(recipe, "fit")
    if not callable(getattr(recipe, "step", None)):
        raise TypeError(f"fit: recipe must be a recipe (rk.recipes.get('grpo'), or any object with "
                        f".step(state, prompts, reward)), got {type(recipe).__name__}")
    from rlkit.transforms.score import check_reward

    check_reward(reward, "fit", getattr(recipe, "reward_weights", None))
    int_at_least(steps, "steps", 0, " (the step count to reach)")
    sinks = _this_ranks_sinks(as_sinks(sinks, "fit"))
    if checkpointer is not None and not callable(getattr(checkpointer, "maybe_save", None)):
        raise TypeError(f"fit: checkpointer must be an rk.Checkpointer (with .maybe_save(state)), got {checkpointer!r}")
    return state, recipe, sinks


def _check_reward_inputs(state, recipe, reward, prompts) -> None:
    """What a built-in recipe gives its reward, checked before the first rollout (both failed after
    it): the responses as text need ``state.tokenizer`` (the error said "pass tokenizer=", an
    argument fit does not have), and a TRL-style reward's required columns must be among the
    prompt set's."""
    from rlkit.recipes.base import Recipe
    from rlkit.transforms.score import _reward_functions, check_reward_columns, reward_style

    if not isinstance(recipe, Recipe):
        return
    if state.tokenizer is None:
        text = [name for name, fn in _reward_functions(reward).items() if reward_style(fn) != "batch"]
        if text:
            raise ValueError(
                f"fit: the reward {text[0]!r} reads the responses as text, and this state has no tokenizer to decode them "
                "(state.tokenizer is None: rk.init was given none, and a model loaded with rk.models.load_model does not "
                "carry one). Fix: rk.init(model, ..., tokenizer=rk.models.load_tokenizer(path)), or "
                "state = state.replace(tokenizer=...)"
            )
    if isinstance(getattr(prompts, "columns", None), Mapping):
        check_reward_columns(reward, list(prompts.columns), "fit")


def _eval_metrics(eval_fn, state) -> dict:
    out = eval_fn(state)
    if not isinstance(out, Mapping):
        raise TypeError(f"fit: eval_fn must return a dict of metrics (e.g. {{'accuracy': 0.5}}), got {type(out).__name__} {out!r:.60}")
    return out


def _is_live_state(state) -> bool:
    """Whether ``state`` is a TrainState not yet donated to an update."""
    from rlkit.state import TrainState

    if not isinstance(state, TrainState):
        return False
    try:
        state.step  # noqa: B018 - raises once donated
    except Exception:  # noqa: BLE001
        return False
    return True


def _sink_error_everywhere(error: Exception | None, group, step: int) -> Exception | None:
    """This rank's sink error, or, where a sink failed on another rank only, a
    :class:`~rlkit.parallel.agree.FailedOnAnotherRank` naming it: every rank stops after the same step."""
    from rlkit.parallel.agree import FailedOnAnotherRank, failed_rank

    rank = failed_rank(error is not None, group)
    if error is not None or rank is None:
        return error
    return FailedOnAnotherRank(f"fit: a sink raised on rank {rank} after step {step}, so every rank stops after that step "
                               f"(its error is in rank {rank}'s output); the step trained and is in exc.state", rank)


def _several_processes() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _scheduler_steps(state) -> int | None:
    """How many optimizer steps the actor's LR schedule has counted (None: no schedule to read)."""
    return getattr(getattr(state, "scheduler", None), "last_epoch", None)


def _warn_schedule_ends_early(state, before: int, steps: int) -> None:
    """After the first step of a fit call: warn when a decaying LR schedule (cosine, linear) will
    end before the run does. ``total_steps`` counts optimizer steps, and one fit step takes one per
    mini-batch and epoch: with ``mini_batch_size=4`` (4 mini-batches) and ``total_steps=8`` for an
    8-step run, the schedule ended at step 2 and the other 6 steps trained at ``min_lr``
    (0 by default), silently."""
    spec = getattr(state, "optimizer_spec", None)
    after = _scheduler_steps(state)
    if spec is None or after is None or spec.schedule == "constant" or spec.total_steps is None:
        return
    per_step = after - before
    if per_step <= 1:
        return  # one optimizer step per fit step: total_steps is the fit steps, as it reads
    end = after + per_step * (steps - state.step)
    if end <= spec.total_steps:
        return
    last = state.step + max(0, spec.total_steps - after) // per_step
    warnings.warn(
        f"rk.fit: the LR schedule (schedule={spec.schedule!r}, total_steps={spec.total_steps}) counts optimizer steps, "
        f"and a step of this recipe takes {per_step} (one per mini-batch and epoch): the {steps} steps reach "
        f"{end}, so the schedule ends at about step {last} and the steps after it train at min_lr "
        f"({spec.lr * spec.min_lr_ratio:g}). For a schedule over the whole run give "
        f"rk.optim.adamw(..., total_steps={steps * per_step}) (steps x {per_step})",
        RuntimeWarning, stacklevel=3)


def _attach_progress(exc: BaseException, state, history: list, checkpointer=None) -> None:
    """Put the run's latest state and history on an exception leaving ``fit`` (Ctrl-C included):
    the state passed in was donated to the first update, so without this a failure at step 900
    (or an interrupt) would lose 900 steps. The exception carries them as ``exc.state`` and
    ``exc.history``; in a notebook the last exception is ``sys.last_value``."""
    from rlkit.state import DonatedStateError

    try:
        state.step  # noqa: B018 - raises if the interrupt landed after an update donated it
    except DonatedStateError:
        state = None
    except Exception:  # noqa: BLE001 - never mask the real error
        state = None
    try:
        exc.state, exc.history = state, history
    except Exception:  # noqa: BLE001 - an exception type without a __dict__: leave it as it is
        return
    if not hasattr(exc, "add_note"):
        return
    if state is not None:
        exc.add_note(
            f"rk.fit stopped after step {state.step} with {len(history)} step(s) of history: the exception carries them "
            "as exc.state and exc.history (in a notebook: import sys; state = sys.last_value.state)"
        )
        return
    # mid-update: the parameters and optimizer moved partly, so no consistent state is left; the note
    # had pointed at exc.state, which is None
    latest = getattr(checkpointer, "latest", None)
    try:
        saved = latest() if callable(latest) else None
    except Exception:  # noqa: BLE001 - never mask the real error
        saved = None
    restore = (f"restore the last checkpoint, {saved} (`state = checkpointer.resume(template)`), or start over from "
               "rk.init" if saved is not None else "start over from rk.init (no checkpoint was saved)")
    exc.add_note(
        f"rk.fit stopped during an update, after {len(history)} logged step(s) (exc.history): that update had already "
        f"changed the parameters and optimizer in place, so no consistent state is left (exc.state is None); {restore}"
    )
