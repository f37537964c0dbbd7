"""``fit``: the plain loop over a recipe's ``step``, with evaluation, sinks and checkpoints.

It is a convenience, not a Trainer: the loop body is ``state, metrics = recipe.step(state,
prompts, reward)`` and you can always write that loop yourself in a notebook cell.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from rlkit._checks import int_at_least
from rlkit.data import PromptSet, load_prompts
from rlkit.observe.sinks import broadcast


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

    ``prompts``: a :class:`rlkit.data.PromptSet`, or anything :func:`rlkit.load_prompts` reads (a
    list of strings or dicts, a JSONL path, a ``datasets.Dataset``), tokenized with the state's
    tokenizer. Resumable: batches come from ``prompts.batch_at(state.data_position, ...)``, so a
    state restored from a checkpoint continues with exactly the batches the uninterrupted run
    would see. ``eval_fn(state) -> {"accuracy": ...}`` runs every ``eval_every`` steps and after the
    last step (``eval_every=0``: never); ``checkpointer.maybe_save(state)`` is called after every
    step when given.
    """
    sinks = list(sinks)
    history: list[dict[str, float]] = []
    if steps < state.step:
        raise ValueError(f"steps={steps} is below the state's step {state.step}; the run is already past it")
    int_at_least(batch_size, "batch_size", 1, " (prompts per step)")
    int_at_least(eval_every, "eval_every", 0, " (0: no evaluation)")
    if eval_every and eval_fn is None:
        raise ValueError(f"eval_every={eval_every} asks for evaluation but eval_fn is None; pass eval_fn=lambda state: {{...}} or eval_every=0")
    if not hasattr(prompts, "batch_at"):
        if state.tokenizer is None:
            raise TypeError(f"prompts is a {type(prompts).__name__} and the state has no tokenizer to read it with; "
                            "pass rk.load_prompts(prompts, tokenizer), or rk.init(..., tokenizer=...)")
        prompts = load_prompts(prompts, state.tokenizer)
    t_start = time.perf_counter()
    while state.step < steps:
        batch_prompts = prompts.batch_at(state.data_position, batch_size, seed=state.seed, shuffle=shuffle)
        t0 = time.perf_counter()
        state, metrics = recipe.step(state, batch_prompts, reward)
        state = state.replace(data_position=state.data_position + 1)
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics["time/elapsed_s"] = time.perf_counter() - t_start
        if eval_fn is not None and eval_every and (state.step % eval_every == 0 or state.step == steps):
            metrics.update({f"eval/{k}": v for k, v in eval_fn(state).items()})
        history.append(metrics)
        broadcast(sinks, state.step, metrics)
        if checkpointer is not None:
            # after the sinks: a step inside a checkpoint has its metrics logged, even when this
            # save is the last thing a preempted (SIGTERM) run does
            checkpointer.maybe_save(state)
    return state, history
