"""Supervised warm-up: teach a fresh model the task format before RL.

``warmup(model, tokenizer, examples, steps=...)`` minimises the negative log-likelihood of the
target completions (prompt tokens are context only), with the same chunked log-prob code the
RL update uses.
"""
from __future__ import annotations

import random
from collections import abc
from typing import Any, Callable, Iterable, Sequence

import torch

from rlkit._checks import check_context, int_at_least, model_of, tokenizer_of
from rlkit.batch import make_batch
from rlkit.models.tokenizers import check_known_characters, encode_prompt
from rlkit.observe.sinks import CallbackSink, as_sinks, broadcast, end_after_error, end_all, step_row
from rlkit.optim import adamw


def _encode(tokenizer, prompt: str, completion: str, where: str = "sft_batch") -> tuple[list[int], list[int]]:
    """``(prompt ids, completion ids + EOS)``: the prompt as rollouts encode it (with the
    tokenizer's leading special tokens, e.g. BOS: :func:`rlkit.models.tokenizers.encode_prompt`),
    the completion without special tokens; refused when either text has characters the tokenizer
    encodes as its unknown token (:func:`rlkit.models.tokenizers.check_known_characters`)."""
    eos = tokenizer.eos_token_id
    prompt_ids = encode_prompt(tokenizer, prompt)
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    check_known_characters(tokenizer, prompt, tokenizer(prompt, add_special_tokens=False)["input_ids"], f"{where}'s prompt")
    check_known_characters(tokenizer, completion, completion_ids, f"{where}'s completion")
    return prompt_ids, completion_ids + ([eos] if eos is not None else [])


def _batch_of(tokenizer, encoded: Sequence[tuple[list[int], list[int]]]):
    return make_batch([e[0] for e in encoded], [e[1] for e in encoded], pad_token_id=tokenizer.pad_token_id or 0)


def sft_batch(tokenizer, pairs: Sequence[tuple[str, str]]):
    """A Batch of (prompt, completion) pairs: the completion (with EOS) is the response."""
    return _batch_of(tokenizer, [_encode(tokenizer, p, t, f"sft_batch: pair {n}") for n, (p, t) in enumerate(pairs)])


def warmup(
    model: torch.nn.Module,
    tokenizer,
    examples: Iterable[tuple[str, str]],
    *,
    steps: int = 200,
    batch_size: int = 64,
    lr: float = 3e-3,
    warmup_steps: int = 20,
    seed: int = 0,
    on_step: Callable[[int, dict], None] | None = None,
    sinks: Iterable[Any] = (),
) -> list[dict]:
    """Train ``model`` in place on (prompt, completion) pairs; returns per-step metrics,
    ``[{"step": n, "sft/loss": .., "sft/lr": ..}, ...]`` (a ``ListSink``'s rows).

    ``examples`` is a list or any iterable (a generator is read once, up front). An example with
    characters the tokenizer encodes as its unknown token (rlkit's character tokenizer does for
    any character outside its alphabet), or longer than the model's context, is refused with a
    ``ValueError`` naming it, before the first step: the steps' draws are made first and every
    example drawn is checked (one never drawn is not).

    The optimizer is AdamW without weight decay; ``lr`` is the peak of its schedule: a linear
    warm-up over ``min(warmup_steps, steps)`` steps, then a cosine decay towards ``0.1 * lr``,
    reached after the last step. Gradients are clipped to a total norm of 1.0. ``sft/lr`` is the learning rate the
    step trained with.

    ``sinks`` (as :func:`rlkit.fit`'s: a progress bar, a notebook dashboard, a JSONL file) and
    ``on_step`` get ``(steps done, metrics)`` after every step, so the last call says ``steps``::

        board = rk.observe.notebook.Dashboard(total=1500, keys=("sft/loss",), every=150)
        rk.sft.warmup(model, tokenizer, examples, steps=1500, sinks=[board])
    """
    model = model_of(model, "warmup", accept_state=False)
    tokenizer = tokenizer_of(tokenizer, "warmup")
    int_at_least(steps, "warmup: steps", 0)
    int_at_least(batch_size, "warmup: batch_size", 1)
    if examples is not None and not isinstance(examples, abc.Sequence):
        # a generator or any other iterable: read once, here, since examples are drawn by index
        try:
            examples = list(examples)
        except TypeError:
            raise TypeError(f"warmup: examples must be a list (or any iterable) of (prompt, completion) pairs of strings, "
                            f"got {type(examples).__name__} {examples!r:.80}") from None
    if not examples:
        raise ValueError("warmup got no examples")
    for n, example in enumerate(examples):
        if isinstance(example, (str, bytes)) or not isinstance(example, abc.Sequence) or len(example) != 2 \
                or not all(isinstance(part, str) for part in example):
            raise ValueError(f"warmup: example {n} is {example!r:.80}; each example must be a (prompt, completion) pair of strings, "
                             "e.g. ('12+34=', '46')")
    if steps == 0:  # nothing to train (rlkit run --sft-steps 0); the model is left as it is
        return []
    from rlkit.models.logprobs import response_logprobs

    device = next(model.parameters()).device
    spec = adamw(lr=lr, weight_decay=0.0, warmup_steps=min(warmup_steps, steps), total_steps=steps, schedule="cosine", min_lr_ratio=0.1)
    optimizer, scheduler = spec.build(model)
    rng = random.Random(seed)
    history = []
    sinks = as_sinks(sinks, "sft.warmup") + ([CallbackSink(on_step)] if on_step is not None else [])
    # every step's draws first, then each drawn example tokenized and checked once, before the first
    # step: an example refused (unknown characters, too long) stops the warm-up before it trains,
    # not after the steps that happened to come before its first draw. Examples never drawn are not
    # tokenized (a large dataset pays for the draws only), as when each was encoded on first draw
    draws = [[rng.randrange(len(examples)) for _ in range(batch_size)] for _ in range(steps)]
    encoded: dict[int, tuple[list[int], list[int]]] = {}
    for picks in draws:
        for i in picks:
            if i not in encoded:
                encoded[i] = _encode_checked(model, tokenizer, examples[i], i)
    was_training = model.training
    model.train()
    try:
        for step, picks in enumerate(draws):
            batch = _batch_of(tokenizer, [encoded[i] for i in picks]).to(device)
            logprobs, _ = response_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"])
            mask = batch["response_mask"]
            loss = -(logprobs * mask).sum() / mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            lr_used = optimizer.param_groups[0]["lr"]  # the rate this step uses, not the next step's
            optimizer.step()
            scheduler.step()
            metrics = {"sft/loss": float(loss.detach()), "sft/lr": lr_used}
            history.append(step_row(step + 1, metrics))
            broadcast(sinks, step + 1, metrics)
    except BaseException as exc:
        end_after_error(exc, sinks, len(history), "warmup")  # the dashboard draws the step it stopped at
        raise
    finally:
        model.train(was_training)  # as evaluate does: the caller's mode, whatever happened
    end_all(sinks, steps)  # a dashboard draws the last step, which its `every` may skip
    return history


def _encode_checked(model, tokenizer, example: tuple[str, str], i: int) -> tuple[list[int], list[int]]:
    """:func:`_encode` of example ``i``, refused when its prompt has no token, either text has
    characters the tokenizer does not know, or the pair exceeds the model's context (which rollouts
    refuse too)."""
    prompt, target = _encode(tokenizer, *example, f"warmup: example {i}")
    if not prompt:
        raise ValueError(f"warmup: example {i}'s prompt {example[0]!r} tokenizes to no tokens; "
                         "every example needs a non-empty prompt")
    if not target:
        # nothing to imitate: it failed at its first draw, as a rollout's "response_mask is all False"
        raise ValueError(f"warmup: example {i}'s completion {example[1]!r} gives no token to train on (it is empty, and the "
                         "tokenizer has no EOS token to end it with); give every example a non-empty completion")
    check_context(model, len(prompt) + len(target), f"warmup: example {i} ({example[0][:40]!r}...)", "shorten it or drop it")
    return prompt, target
