"""Forward-only passes that add fields to a Batch: old/ref log-probs and critic values.

Each runs in micro-batches under ``torch.no_grad`` and returns a new Batch.
"""
from __future__ import annotations

import torch

from rlkit._checks import check_token_ids
from rlkit.batch import Batch, shallow_copy, validate


def _micro(batch: Batch, micro_batch_size: int | None):
    b = batch.batch_size[0]
    size = micro_batch_size or b
    for i in range(0, b, size):
        yield slice(i, min(b, i + size))


_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def rows_view(model, rows: Batch, device):
    """The :class:`rlkit.models.logprobs.ResponseView` of ``rows`` for ``model`` computing on
    ``device``, built where the rows live (the CPU for a rollout's batch: no device sync)."""
    from rlkit.models.logprobs import backbone_of, response_view

    return response_view(backbone_of(model), *(rows[k] for k in _INPUTS), device=device)


def _inputs(mb: Batch, model, device) -> dict:
    """The four model inputs on ``device`` and the rows' view (:func:`rows_view`), copied over
    without waiting for the device; the GPU can still be busy with the previous pass."""
    from rlkit.models.logprobs import to_device

    return {**{k: to_device(mb[k], device) for k in _INPUTS}, "view": rows_view(model, mb, device)}


def _sharded_map(state, batch: Batch, fn):
    """Run ``fn(rows) -> (b t)`` on this data-parallel rank's rows and gather the result."""
    dp = state._cache.get("dp") if state is not None else None
    if dp is None or dp.size <= 1:
        return fn(batch)
    from rlkit.parallel.placement import shard_rows
    from rlkit.parallel.reshard import comm_device

    local = fn(shard_rows(batch, dp.mesh))
    width = local.shape[1]
    comm = local.to(comm_device(dp.group))
    parts = [torch.empty_like(comm) for _ in range(dp.size)]
    torch.distributed.all_gather(parts, comm, group=dp.group)
    return torch.cat(parts).to(local.device)[:, :width]


def module_device(model) -> torch.device:
    """Where ``model`` computes: its parameters' device, or this rank's device for DTensor (FSDP) shards."""
    param = next(model.parameters())
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None:
        return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    return param.device


@torch.no_grad()
def model_logprobs(model, batch: Batch, *, temperature: float = 1.0, micro_batch_size: int | None = None, with_entropy: bool = False):
    """(b t) log-probs (and entropy) of the batch's responses under ``model``, on the model's
    device. The pass never waits for the device: it is queued and returned (read the result
    to wait for it), so the host can prepare the next pass or score rewards meanwhile."""
    from rlkit.models.logprobs import response_logprobs

    validate(batch, require=("prompt_ids", "prompt_mask", "response_ids", "response_mask"))
    check_token_ids(batch, model, "log-probs")
    device = module_device(model)
    was_training = model.training
    model.eval()
    out_lp, out_ent = [], []
    try:
        for sl in _micro(batch, micro_batch_size):
            lp, ent = response_logprobs(model, **_inputs(batch[sl], model, device), temperature=temperature, with_entropy=with_entropy)
            out_lp.append(lp.float())
            if with_entropy:
                out_ent.append(ent.float())
    finally:
        model.train(was_training)
    lp = torch.cat(out_lp)
    return lp, (torch.cat(out_ent) if with_entropy else None)


def compute_old_logprobs(state, batch: Batch, *, temperature: float = 1.0, micro_batch_size: int | None = None) -> Batch:
    """Add ``old_logprobs``: the actor's log-probs before the update (verl's recompute)."""
    module = state._cache.get("actor_module", state.actor)
    with torch.profiler.record_function("rlkit.old_logprobs"):  # names the range in a profiler trace
        lp = _sharded_map(state, batch, lambda rows: model_logprobs(module, rows, temperature=temperature, micro_batch_size=micro_batch_size)[0])
    out = shallow_copy(batch)
    out.set("old_logprobs", lp)
    return out


def compute_ref_logprobs(state, batch: Batch, *, temperature: float = 1.0, micro_batch_size: int | None = None) -> Batch:
    """Add ``ref_logprobs`` from the frozen reference model (``rk.init(..., ref="copy")``)."""
    if state.ref is None:
        raise ValueError("state has no reference model; create it with rk.init(model, ref='copy') or drop the KL penalty")
    module = state._cache.get("ref_module", state.ref)
    with torch.profiler.record_function("rlkit.ref_logprobs"):
        lp = _sharded_map(state, batch, lambda rows: model_logprobs(module, rows, temperature=temperature, micro_batch_size=micro_batch_size)[0])
    out = shallow_copy(batch)
    out.set("ref_logprobs", lp)
    return out


@torch.no_grad()
def compute_values(state, batch: Batch, *, micro_batch_size: int | None = None) -> Batch:
    """Add ``values (b t)`` from the critic (PPO)."""
    from rlkit.models.logprobs import values_for_response

    if state.critic is None:
        raise ValueError("state has no critic; create it with rk.init(model, critic=rk.models.critic(model))")
    validate(batch, require=("prompt_ids", "response_ids"))
    check_token_ids(batch, state.critic, "compute_values")
    critic = state._cache.get("critic_module", state.critic)
    device = module_device(critic)
    was_training = critic.training
    critic.eval()

    def run(rows):
        return torch.cat([values_for_response(critic, **_inputs(rows[sl], critic, device)).float() for sl in _micro(rows, micro_batch_size)]).cpu()

    try:
        values = _sharded_map(state, batch, run)
    finally:
        critic.train(was_training)
    out = shallow_copy(batch)
    out.set("values", values.to(batch["response_ids"].device))
    return out
