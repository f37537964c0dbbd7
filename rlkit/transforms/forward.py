"""Forward-only passes that add fields to a Batch: old/ref log-probs and critic values.

Each runs in micro-batches under ``torch.no_grad`` and returns a new Batch.
"""
from __future__ import annotations

import torch

from rlkit.batch import Batch, validate


def _micro(batch: Batch, micro_batch_size: int | None):
    b = batch.batch_size[0]
    size = micro_batch_size or b
    for i in range(0, b, size):
        yield slice(i, min(b, i + size))


def _inputs(mb: Batch, device):
    return (
        mb["prompt_ids"].to(device),
        mb["prompt_mask"].to(device),
        mb["response_ids"].to(device),
        mb["response_mask"].to(device),
    )


@torch.no_grad()
def model_logprobs(model, batch: Batch, *, temperature: float = 1.0, micro_batch_size: int | None = None, with_entropy: bool = False):
    """(b t) log-probs (and entropy) of the batch's responses under ``model``."""
    from rlkit.models.logprobs import response_logprobs

    validate(batch, require=("prompt_ids", "prompt_mask", "response_ids", "response_mask"))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out_lp, out_ent = [], []
    try:
        for sl in _micro(batch, micro_batch_size):
            lp, ent = response_logprobs(model, *_inputs(batch[sl], device), temperature=temperature, with_entropy=with_entropy)
            out_lp.append(lp.float())
            if with_entropy:
                out_ent.append(ent.float())
    finally:
        model.train(was_training)
    lp = torch.cat(out_lp).to(batch["response_ids"].device)
    return lp, (torch.cat(out_ent).to(lp.device) if with_entropy else None)


def compute_old_logprobs(state, batch: Batch, *, temperature: float = 1.0, micro_batch_size: int | None = None) -> Batch:
    """Add ``old_logprobs``: the actor's log-probs before the update (verl's recompute)."""
    lp, _ = model_logprobs(state.actor, batch, temperature=temperature, micro_batch_size=micro_batch_size)
    out = batch.clone(recurse=False)
    out.set("old_logprobs", lp)
    return out


def compute_ref_logprobs(state, batch: Batch, *, temperature: float = 1.0, micro_batch_size: int | None = None) -> Batch:
    """Add ``ref_logprobs`` from the frozen reference model (``rk.init(..., ref="copy")``)."""
    if state.ref is None:
        raise ValueError("state has no reference model; create it with rk.init(model, ref='copy') or drop the KL penalty")
    lp, _ = model_logprobs(state.ref, batch, temperature=temperature, micro_batch_size=micro_batch_size)
    out = batch.clone(recurse=False)
    out.set("ref_logprobs", lp)
    return out


@torch.no_grad()
def compute_values(state, batch: Batch, *, micro_batch_size: int | None = None) -> Batch:
    """Add ``values (b t)`` from the critic (PPO)."""
    from rlkit.models.logprobs import values_for_response

    if state.critic is None:
        raise ValueError("state has no critic; create it with rk.init(model, critic=rk.models.critic(model))")
    validate(batch, require=("prompt_ids", "response_ids"))
    critic = state.critic
    device = next(critic.parameters()).device
    was_training = critic.training
    critic.eval()
    try:
        values = torch.cat([values_for_response(critic, *_inputs(batch[sl], device)).float() for sl in _micro(batch, micro_batch_size)])
    finally:
        critic.train(was_training)
    out = batch.clone(recurse=False)
    out.set("values", values.to(batch["response_ids"].device))
    return out
