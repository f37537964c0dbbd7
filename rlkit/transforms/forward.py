"""Forward-only passes that add fields to a Batch: old/ref log-probs and critic values.

Each runs in micro-batches under ``torch.no_grad`` and returns a new Batch.
"""
from __future__ import annotations

import math
import warnings

import torch

from rlkit._checks import check_context, check_token_ids, context_limit, int_at_least
from rlkit.batch import Batch, shallow_copy, validate
from rlkit.state import TrainState


def check_state(state, where: str) -> None:
    """Raise ``TypeError`` naming ``where`` unless ``state`` is a :class:`rlkit.TrainState`, as
    :func:`rlkit.rollout` and :func:`rlkit.update` do ("expects a TrainState first"). A model
    (``state.actor``) failed later with ``'Qwen2ForCausalLM' object has no attribute 'actor'``."""
    if not isinstance(state, TrainState):
        hint = (" (a model: pass the state itself, not state.actor)"
                if isinstance(state, torch.nn.Module) else "")
        raise TypeError(f"{where} expects a TrainState first (from rk.init), got {type(state).__name__}{hint}")


def check_micro_batch_size(micro_batch_size, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``micro_batch_size`` is None or an int >= 1, as
    :func:`rlkit.update` requires: -1 failed in ``torch.cat`` on no micro-batch, 2.5 in ``range``,
    and 0 silently ran the whole batch here where update refuses it."""
    if micro_batch_size is not None:
        int_at_least(micro_batch_size, f"{where}: micro_batch_size", 1,
                     " (rows per forward), or None for the whole batch in one pass (0 is refused, as by rk.update)")


def check_batch_context(model, batch: Batch, where: str) -> None:
    """Raise ``ValueError`` when a row of ``batch`` (its prompt and response tokens) needs more
    positions than ``model``'s context (:func:`rlkit._checks.check_context`, which rollout, fit
    and evaluate apply to prompts): a hand-made or concatenated batch was trained on positions the
    model never learned. Decided on the shapes when the padded width fits (the usual case); the
    masks are read (a host sync for a batch on a device) only when it does not."""
    from rlkit.models.logprobs import _longest_row

    limit = context_limit(model)
    if limit is None:
        return
    prompt_mask, response_mask = batch["prompt_mask"], batch["response_mask"]
    longest = _longest_row(prompt_mask, response_mask, limit)  # the padded width when it fits: no read
    if longest <= limit:
        return
    prompt_len, response_len = prompt_mask.sum(1), response_mask.sum(1)
    over = ((prompt_len + response_len) > limit).nonzero().flatten().tolist()
    i = int((prompt_len + response_len).argmax())
    check_context(model, longest,
                  f"{where}: row {i} of the batch ({int(prompt_len[i])} prompt + {int(response_len[i])} response tokens)",
                  f"the rows over it are {over[:8]}{' ...' if len(over) > 8 else ''} of {batch.batch_size[0]}. Drop or "
                  "shorten them (batch[keep]), or use a model with a longer context; rk.rollout refuses a prompt whose "
                  "tokens plus max_new_tokens exceed the context, so a batch it sampled always fits")


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

    validate(batch, require=_INPUTS)
    check_micro_batch_size(micro_batch_size, "log-probs")
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


#: the per-row float field recording the temperature a row's ``logprobs`` are at (set by rollout)
TEMPERATURE = "temperature"


def _float32(x: float) -> float:
    """``x`` rounded to float32, as the ``temperature`` column stores it."""
    return torch.tensor(x, dtype=torch.float32).item()


def _shortest(v: float) -> float:
    """The shortest decimal that rounds to the float32 ``v`` (0.6, not 0.6000000238418579): the
    temperature the rollout was given, so the trainer divides its logits by the same number."""
    for digits in range(1, 10):
        candidate = float(f"{v:.{digits}g}")
        if _float32(candidate) == v:
            return candidate
    return v


def recorded_temperatures(batch: Batch) -> list[float]:
    """The distinct temperatures of the batch's ``temperature`` column (sorted), the temperatures its
    rows' ``logprobs`` are at; ``[]`` when the batch has no such column (built with ``make_batch``)."""
    if TEMPERATURE not in batch.keys():
        return []
    column = batch.get(TEMPERATURE)
    if not isinstance(column, torch.Tensor) or column.numel() == 0:
        return []
    return [_shortest(v) for v in torch.unique(column.detach().float().cpu()).tolist()]


def resolve_temperature(batch: Batch, temperature: float | None, where: str, *, mismatch: str, stacklevel: int = 3) -> float:
    """The temperature a pass over ``batch`` computes its log-probs at.

    ``temperature=None``: the batch's recorded one (its ``temperature`` column, which
    :func:`rlkit.rollout` sets; every row must agree, else a ``ValueError`` naming the values asks for
    an explicit temperature), or 1.0 when the batch has no such column. An explicit temperature is
    used as given; one that differs from the recorded one warns (``RuntimeWarning`` naming both,
    followed by ``mismatch``: what goes wrong)."""
    recorded = recorded_temperatures(batch)
    if temperature is None:
        if len(recorded) > 1:
            raise ValueError(
                f"{where}: the batch's rows were sampled at different temperatures {recorded} (its 'temperature' column), "
                "so its log-probs are at no one temperature; pass temperature=... explicitly (the temperature the "
                "log-probs should be computed at), or process the rows of each temperature separately"
            )
        return recorded[0] if recorded else 1.0
    try:
        given = _float32(float(temperature))
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return temperature  # not a number: refused where it is used, as before
    other = [t for t in recorded if _float32(t) != given and not (math.isnan(given) and math.isnan(t))]
    if other:
        shown = recorded[0] if len(recorded) == 1 else recorded
        warnings.warn(
            f"{where}: temperature={temperature} but the batch's log-probs were sampled at temperature {shown} (its "
            f"'temperature' column, recorded by rk.rollout); {mismatch}. Leave temperature=None to use the batch's",
            RuntimeWarning, stacklevel=stacklevel,
        )
    return temperature


def compute_old_logprobs(state, batch: Batch, *, temperature: float | None = None, micro_batch_size: int | None = None) -> Batch:
    """Add ``old_logprobs``: the actor's log-probs before the update (verl's recompute).

    ``temperature``: None (the default) computes them at the temperature the batch's log-probs were
    sampled at (its ``temperature`` column, which :func:`rlkit.rollout` records; 1.0 for a batch
    without one), as :func:`rlkit.update` does by default, so the ratio is 1 on-policy. A batch
    whose rows were sampled at different temperatures needs an explicit one (``ValueError``); an
    explicit temperature that differs from the recorded one warns (``RuntimeWarning``).

    ``micro_batch_size``: rows per forward, an int >= 1, or None (the default) for the whole batch
    in one pass. A batch of 0 rows (:func:`rlkit.validate`), or with a row longer than the
    model's context, is refused before any work; so are :func:`compute_ref_logprobs`' and
    :func:`compute_values`'."""
    check_state(state, "compute_old_logprobs")
    validate(batch, require=_INPUTS)
    check_micro_batch_size(micro_batch_size, "rk.compute_old_logprobs")
    check_batch_context(state.actor, batch, "rk.compute_old_logprobs")
    temperature = resolve_temperature(
        batch, temperature, "rk.compute_old_logprobs",
        mismatch="the old log-probs will be at another temperature than the policy that sampled the rows, so the "
                 "update's ratio will not be 1 on-policy",
    )
    module = state._cache.get("actor_module", state.actor)
    with torch.profiler.record_function("rlkit.old_logprobs"):  # names the range in a profiler trace
        lp = _sharded_map(state, batch, lambda rows: model_logprobs(module, rows, temperature=temperature, micro_batch_size=micro_batch_size)[0])
    out = shallow_copy(batch)
    out.set("old_logprobs", lp)
    return out


def compute_ref_logprobs(state, batch: Batch, *, temperature: float | None = None, micro_batch_size: int | None = None) -> Batch:
    """Add ``ref_logprobs`` from the frozen reference model (``rk.init(..., ref="copy")``).

    ``temperature``: None (the default) is the batch's recorded sampling temperature (its
    ``temperature`` column; 1.0 without one), the one :func:`rlkit.update` computes the policy's
    log-probs at by default; see :func:`compute_old_logprobs` (``micro_batch_size`` too)."""
    check_state(state, "compute_ref_logprobs")
    validate(batch, require=_INPUTS)
    check_micro_batch_size(micro_batch_size, "rk.compute_ref_logprobs")
    if state.ref is None:
        raise ValueError("state has no reference model; create it with rk.init(model, ref='copy') or drop the KL penalty")
    check_batch_context(state.ref, batch, "rk.compute_ref_logprobs")
    temperature = resolve_temperature(
        batch, temperature, "rk.compute_ref_logprobs",
        mismatch="the reference log-probs will be at another temperature than the policy's, which the update computes "
                 "at the batch's temperature by default, so the KL penalty compares distributions at different temperatures",
    )
    module = state._cache.get("ref_module", state.ref)
    with torch.profiler.record_function("rlkit.ref_logprobs"):
        lp = _sharded_map(state, batch, lambda rows: model_logprobs(module, rows, temperature=temperature, micro_batch_size=micro_batch_size)[0])
    out = shallow_copy(batch)
    out.set("ref_logprobs", lp)
    return out


@torch.no_grad()
def compute_values(state, batch: Batch, *, micro_batch_size: int | None = None) -> Batch:
    """Add ``values (b t)`` from the critic (PPO). ``micro_batch_size``: as in
    :func:`compute_old_logprobs`."""
    from rlkit.models.logprobs import values_for_response

    check_state(state, "compute_values")
    validate(batch, require=_INPUTS)
    check_micro_batch_size(micro_batch_size, "rk.compute_values")
    if state.critic is None:
        raise ValueError("state has no critic; create it with rk.init(model, critic=rk.models.critic(model))")
    check_batch_context(state.critic, batch, "rk.compute_values")
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
