"""Training layout: FSDP2 (``fully_shard``) over a data-parallel mesh.

Every decoder layer is its own FSDP unit (all-gathered just before it runs, freed after), then
the root module takes the rest (embeddings, final norm, lm_head). Parameters become DTensors
sharded ``Shard(0)`` (row chunks, ``torch.chunk`` sizes) over the mesh.

**Which module is the root matters.** FSDP all-gathers a unit's parameters in that module's
forward pre-hook. rlkit computes log-probs by running the backbone and then a chunked lm_head
over the hidden states (``h @ lm_head.weight.T`` per chunk), never ``CausalLM.forward`` on the
whole sequence. If the HF ``CausalLM`` were the root, its pre-hook would never fire on that path
and ``embed_tokens``/``norm``/``lm_head.weight`` would still be sharded DTensors when used (torch
raises "mixed torch.Tensor and DTensor"). So shard the module whose ``forward`` you call: the
log-prob wrapper (``forward = backbone + chunked head``) is the root, and the decoder layers are
found inside it. Other entry points of the root can be registered with ``forward_methods``; for
no-grad reads outside any forward use :func:`unsharded`.

Gradient reduction: FSDP reduce-scatters gradients with a MEAN over the data-parallel group by
default. rlkit normalises token-mean losses by the global token count, so the data-parallel
gradient must be the SUM of the per-rank gradients:

    n_tokens = global_sum(response_mask.sum(), mesh)          # all ranks agree on the normaliser
    loss = (per_token_loss * response_mask).sum() / n_tokens   # this rank's share of the global mean
    loss.backward()                                           # with shard_model(..., gradient_reduction="sum")

(equivalently keep ``"mean"`` and multiply the loss by the data-parallel size).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Literal, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from rlkit.parallel.mesh import device_mesh

#: names of the ModuleList holding transformer blocks in common model families
LAYER_LIST_NAMES = ("layers", "h", "blocks")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model`` (HF Llama/Qwen2: ``model.model.layers[*]``).

    Finds every ``nn.ModuleList`` whose attribute name is one of :data:`LAYER_LIST_NAMES`, at any
    depth (so a wrapper holding a CausalLM works), and returns its entries in order.
    """
    found: list[nn.Module] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in LAYER_LIST_NAMES:
            found.extend(module)
    return found


def mixed_precision_policy(enabled: bool) -> MixedPrecisionPolicy:
    """bf16 compute (parameters all-gathered in bf16), fp32 sharded master weights, fp32 gradient reduction."""
    if not enabled:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    mixed_precision: bool | MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    gradient_reduction: Literal["mean", "sum"] = "mean",
    layers: Sequence[nn.Module] | None = None,
    forward_methods: Sequence[str] = (),
) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to each decoder layer and then to ``model`` (the root), in place.

    - ``model``: the module whose ``forward`` you will call (see the module docstring: for
      log-probs, the backbone + chunked-head wrapper, not the bare CausalLM). Its parameters must
      already be on the mesh's device (or on ``meta``, then call ``model.to_empty`` and
      initialise / :func:`load_full_state_dict` afterwards).
    - ``mesh``: a 1-D data-parallel DeviceMesh; ``None`` = all ranks (:func:`device_mesh`).
    - ``mixed_precision``: bf16 compute, fp32 params and reductions. ``None`` = on for CUDA
      meshes, off on CPU. A ``MixedPrecisionPolicy`` is used as given.
    - ``cpu_offload``: keep sharded parameters, gradients and optimizer state on the CPU.
    - ``activation_checkpointing``: recompute each layer's activations in backward (composable
      ``checkpoint``, so parameter names do not change).
    - ``reshard_after_forward``: free each layer's gathered parameters after its forward (ZeRO-3);
      ``False`` keeps them until backward (ZeRO-2 memory, less communication).
    - ``gradient_reduction``: ``"mean"`` (FSDP's default: divide by the data-parallel size) or
      ``"sum"``, which rlkit's globally normalised losses need (see module docstring).
    - ``layers``: the blocks to wrap individually; default :func:`decoder_layers`.
    - ``forward_methods``: other methods of ``model`` that run a forward (e.g. ``"generate"``);
      FSDP hooks are registered for them too.

    Returns ``model`` (now also an ``FSDPModule``).
    """
    if isinstance(model, FSDPModule):
        raise ValueError(f"shard_model: {type(model).__name__} is already sharded (an FSDPModule); shard a model once")
    if gradient_reduction not in ("mean", "sum"):
        raise ValueError(f"shard_model: gradient_reduction={gradient_reduction!r}; use 'mean' or 'sum'")
    mesh = device_mesh() if mesh is None else mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"shard_model: mesh has {mesh.ndim} dimensions {mesh.mesh_dim_names}; pass the 1-D data-parallel "
            "sub-mesh, e.g. mesh['dp']"
        )
    if mixed_precision is None:
        mixed_precision = mesh.device_type == "cuda"
    mp_policy = mixed_precision if isinstance(mixed_precision, MixedPrecisionPolicy) else mixed_precision_policy(bool(mixed_precision))
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    blocks = list(decoder_layers(model) if layers is None else layers)
    if not blocks:
        warnings.warn(
            f"shard_model: found no decoder layers in {type(model).__name__} (looked for ModuleLists named "
            f"{LAYER_LIST_NAMES}); sharding the whole model as one unit, which all-gathers every parameter at "
            "once. Pass layers=[...] to shard block by block.",
            stacklevel=2,
        )
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint  # composable: keeps parameter names

        for block in blocks:
            checkpoint(block)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, offload_policy=offload)
    for method in forward_methods:
        register_fsdp_forward_method(model, method)
    set_gradient_reduction(model, gradient_reduction)
    return model


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every FSDP unit inside ``model`` (root included)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule) or bool(fsdp_modules(model))


def set_gradient_reduction(model: nn.Module, mode: Literal["mean", "sum"]) -> None:
    """Make FSDP's data-parallel gradient reduction a ``"sum"`` or a ``"mean"`` (its default).

    The divide factor is per FSDP unit, so it is set on every unit.
    """
    if mode not in ("mean", "sum"):
        raise ValueError(f"gradient reduction mode {mode!r}; use 'mean' or 'sum'")
    for unit in fsdp_modules(model):
        # torch < 2.8 names it set_reduce_scatter_divide_factor
        set_factor = getattr(unit, "set_gradient_divide_factor", None) or unit.set_reduce_scatter_divide_factor
        force_sum = getattr(unit, "set_force_sum_reduction_for_comms", None)
        if mode == "sum":
            set_factor(1.0)
            if force_sum is not None:
                # SUM + a post-division by 1 instead of PREMUL_SUM(1.0), which gloo lacks.
                force_sum(True)
        else:
            set_factor(float(_shard_group_size(unit)))
            if force_sum is not None:
                force_sum(False)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the backward of ``model``'s FSDP units reduce-scatters their gradients (FSDP2's
    ``set_requires_gradient_sync`` on every unit; a no-op for a module that is not sharded).

    Off, each backward adds to unsharded gradients the rank keeps (gradient accumulation without
    communication); the next backward with it on reduce-scatters the sum."""
    for unit in fsdp_modules(model):
        unit.set_requires_gradient_sync(enabled, recurse=False)


def discard_unreduced_gradients(model: nn.Module) -> None:
    """Drop the unsharded gradients that backwards with gradient sync off left in ``model``'s FSDP
    units, and turn gradient sync back on.

    For an update that fails between micro-batches: FSDP2 would otherwise add those gradients
    into the next reduce-scatter, i.e. into the next update. Reads FSDP2's per-parameter state
    (``FSDPParam``), which has no public API for this."""
    for unit in fsdp_modules(model):
        unit.set_requires_gradient_sync(True, recurse=False)
        for group in _param_groups(unit):
            for fsdp_param in group.fsdp_params:
                if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                    fsdp_param.unsharded_accumulated_grad = None
                inner = getattr(fsdp_param, "_unsharded_param", None)
                if inner is not None:
                    inner.grad = None


def _param_groups(unit: nn.Module) -> list:
    """The FSDP unit's parameter groups (FSDP2 internals): ``_fsdp_param_groups`` (a list, newer
    torch) or ``_fsdp_param_group`` (one group or None, torch <= 2.11). Raises if neither is there,
    so that a torch whose internals moved again fails loudly instead of keeping the gradients."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise RuntimeError(
        f"rlkit cannot find FSDP2's parameter groups on this torch ({torch.__version__}): neither "
        "_fsdp_param_groups nor _fsdp_param_group; the unreduced gradients of a failed update cannot be dropped"
    )


def _shard_group_size(unit: nn.Module) -> int:
    for param in unit.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            return mesh.size()
    return 1


def dp_size(mesh: DeviceMesh | None) -> int:
    """Number of data-parallel ranks (1 when ``mesh`` is None or torch.distributed is not initialised)."""
    if mesh is None:
        return dist.get_world_size() if dist.is_initialized() else 1
    return mesh.size()


def global_sum(value: torch.Tensor | float | int, mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Sum of ``value`` over the data-parallel group (a new tensor; the input is not modified).

    Use it for loss normalisers (token or sequence counts) so every rank divides by the same
    global count. ``mesh=None`` means the default group; without torch.distributed it returns
    ``value`` as a tensor.

    Floating-point inputs keep their dtype. Bool and integer inputs come back as int64 counts, with
    or without torch.distributed: the sum is taken in int64, and casting it back to the input's
    dtype turned a count of flags (``[True, False, True]`` on 2 ranks) into ``[True, False, True]``
    instead of ``[2, 0, 2]``, and wrapped int8/int16/int32 sums that overflow them.
    """
    tensor = torch.as_tensor(value).detach().clone()
    out_dtype = tensor.dtype if tensor.is_floating_point() or tensor.is_complex() else torch.int64
    if not dist.is_initialized():
        return tensor.to(out_dtype)
    group = mesh.get_group() if mesh is not None else None
    comm = tensor
    if dist.get_backend(group) == "nccl" and tensor.device.type != "cuda":
        comm = tensor.to(torch.device("cuda", torch.cuda.current_device()))
    comm = comm.to(out_dtype)
    dist.all_reduce(comm, op=dist.ReduceOp.SUM, group=group)
    return comm.to(device=tensor.device, dtype=out_dtype)


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block every FSDP unit of ``model`` holds its full parameters (no-grad reads only).

    For code that reads weights outside any forward (e.g. an engine copying them). Gradients of
    parameters used this way are NOT reduced by FSDP; for training, call the root's forward.
    """
    units = fsdp_modules(model)
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()


def full_state_dict(model: nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict, for saving or handing to an engine.

    ``cpu_offload=True`` (default) gathers to CPU and only rank 0 receives the tensors (other
    ranks get ``{}``), which keeps GPU and host memory flat; ``False`` gives every rank the full
    tensors on its device. Collective: every rank of the model's mesh must call it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, from_rank0: bool = True) -> None:
    """Load a full state dict into a (sharded) model; each rank keeps only its shard.

    ``from_rank0=True``: only rank 0 needs the tensors (others may pass ``{}``); they are
    broadcast. Collective. ``state_dict`` itself is left as it was (its entries are not replaced).

    The names and shapes of ``state_dict`` are checked against the model's full (unsharded)
    parameters and buffers before any tensor moves, and every rank raises the same ``ValueError``
    naming what differs. torch's own load reported a wrong shape on the other ranks only, as a
    broadcast error naming no parameter, while rank 0 waited in a send until the group timed out;
    and an unexpected key raised on rank 0 while the other ranks loaded, so the ranks disagreed
    about whether the load happened.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    _check_full_state_dict(model, state_dict, from_rank0=from_rank0)
    # a shallow copy: torch writes the loaded entries (this rank's DTensor shards) into the dict it
    # is given, and the caller's full state dict (a notebook's "best weights") became shards
    set_model_state_dict(model, dict(state_dict), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0))


#: at most this many names per kind of mismatch in load_full_state_dict's error
_MISMATCH_SHOWN = 8


def _model_state_shapes(model: nn.Module) -> dict[str, tuple[int, ...] | None]:
    """``{name: full shape}`` of what :func:`load_full_state_dict` expects (``None`` for a non-tensor
    entry such as extra state). The names are torch.distributed.checkpoint's (wrapper prefixes such
    as ``_orig_mod.`` removed), as :func:`full_state_dict` writes them; a sharded parameter is a
    DTensor, whose ``shape`` is the full one. No communication: the sharded state dict is local."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    local = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False, cpu_offload=False))
    return {k: tuple(v.shape) if torch.is_tensor(v) else None for k, v in local.items()}


def _state_dict_mismatch(model: nn.Module, state_dict: dict) -> str | None:
    """What differs between ``state_dict`` and ``model`` (names, and shapes of the tensors both have),
    as the body of an error message; ``None`` when they match."""
    expected = _model_state_shapes(model)
    names = [k for k in state_dict if isinstance(k, str)]
    if len(names) != len(state_dict):
        # keys that are submodules (torch's nested form): torch flattens them itself; check nothing
        return None

    def listed(items: list[str]) -> str:
        more = f", and {len(items) - _MISMATCH_SHOWN} more" if len(items) > _MISMATCH_SHOWN else ""
        return ", ".join(items[:_MISMATCH_SHOWN]) + more

    def shape(t) -> str:
        return str(tuple(t.shape)) if torch.is_tensor(t) else type(t).__name__

    wrong = [
        f"{k!r}: {shape(state_dict[k])} in the state dict, {expected[k]} in the model"
        for k in names
        if k in expected and expected[k] is not None and (not torch.is_tensor(state_dict[k]) or tuple(state_dict[k].shape) != expected[k])
    ]
    unexpected = [repr(k) for k in names if k not in expected]
    missing = [repr(k) for k in expected if k not in state_dict]
    parts = []
    if wrong:
        parts.append(f"another shape: {listed(wrong)}")
    if unexpected:
        parts.append(f"not in the model: {listed(unexpected)}")
    if missing:
        parts.append(f"missing from the state dict: {listed(missing)}")
    return "; ".join(parts) or None


def _check_full_state_dict(model: nn.Module, state_dict: dict, *, from_rank0: bool) -> None:
    """Raise the same ``ValueError`` on every rank when the state dict that would be loaded does not
    match ``model``. ``from_rank0``: rank 0 checks its dict and broadcasts the verdict (the other
    ranks' dicts are not read); otherwise every rank checks its own and the verdicts are gathered.
    Uses the default group, as torch's broadcast of the tensors does. One small object collective."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    mine = None
    if rank == 0 or not from_rank0:
        try:
            mine = _state_dict_mismatch(model, state_dict)
        except Exception as e:  # noqa: BLE001 - a check that raised on one rank only would leave the others waiting
            mine = f"it could not be compared ({type(e).__name__}: {e})"
    if not distributed:
        verdicts = [mine]
    elif from_rank0:
        verdicts = [mine]
        dist.broadcast_object_list(verdicts, src=0)
    else:
        from rlkit.parallel.agree import gather_checked

        # tagged: a rank that skipped this load pairs the gather with its next collective, named
        verdicts = gather_checked(mine, "load_full_state_dict")
    bad = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if not bad:
        return
    src, problem = bad[0]
    # FSDP2 makes the model an instance of a generated FSDP<name> subclass: name the user's class
    cls = next((c for c in type(model).__mro__ if not issubclass(c, FSDPModule)), type(model))
    whose = "rank 0's state dict" if from_rank0 else f"the state dict of rank {src}" + (
        f" (and of rank(s) {[r for r, _ in bad[1:]]})" if len(bad) > 1 else "")
    raise ValueError(
        f"load_full_state_dict: {whose} does not match {cls.__name__}'s parameters and buffers: "
        f"{problem}. Nothing was loaded. Load a state dict saved from a model of this architecture and "
        "config (full_state_dict(model) writes the names and full shapes expected), or rename, reshape or "
        "drop those entries first"
    )
