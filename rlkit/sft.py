"""Supervised warm-up: teach a fresh model the task format before RL.

``warmup(model, tokenizer, examples, steps=...)`` minimises the negative log-likelihood of the
target completions (prompt tokens are context only), with the same chunked log-prob code the
RL update uses.
"""
from __future__ import annotations

import random
from typing import Callable, Sequence

import torch

from rlkit.batch import make_batch
from rlkit.optim import adamw


def sft_batch(tokenizer, pairs: Sequence[tuple[str, str]]):
    eos = tokenizer.eos_token_id
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in pairs]
    targets = [tokenizer(t, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else []) for _, t in pairs]
    return make_batch(prompts, targets, pad_token_id=tokenizer.pad_token_id or 0)


def warmup(
    model: torch.nn.Module,
    tokenizer,
    examples: Sequence[tuple[str, str]],
    *,
    steps: int = 200,
    batch_size: int = 64,
    lr: float = 3e-3,
    warmup_steps: int = 20,
    seed: int = 0,
    on_step: Callable[[int, dict], None] | None = None,
) -> list[dict]:
    """Train ``model`` in place on (prompt, completion) pairs; returns per-step metrics."""
    from rlkit.models.logprobs import response_logprobs

    if not examples:
        raise ValueError("warmup got no examples")
    device = next(model.parameters()).device
    spec = adamw(lr=lr, weight_decay=0.0, warmup_steps=min(warmup_steps, steps), total_steps=steps, schedule="cosine", min_lr_ratio=0.1)
    optimizer, scheduler = spec.build(model.parameters())
    rng = random.Random(seed)
    history = []
    model.train()
    for step in range(steps):
        pairs = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        batch = sft_batch(tokenizer, pairs).to(device)
        logprobs, _ = response_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"])
        mask = batch["response_mask"]
        loss = -(logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        metrics = {"sft/loss": float(loss.detach()), "sft/lr": scheduler.get_last_lr()[0]}
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
    model.eval()
    return history
