"""``torch.compile`` for the training-side decoder: each transformer block compiled in place.

Why per block, in place (``nn.Module.compile``): the blocks of a model share one code object and
(with dynamo's default ``inline_inbuilt_nn_modules``) their parameters are graph *inputs*, so one
compiled graph serves every block of every model of the same config (actor and reference alike);
the state-dict keys do not change (no ``_orig_mod.`` prefix), so checkpoints, weight sync and
FSDP2's per-block ``fully_shard`` see the same module tree.

Shapes: dynamo's automatic dynamic shapes (``dynamic=None``): the first call of a variant compiles
for its exact sizes, and the first change of a size (the packed token count changes every batch)
recompiles it once with that size symbolic. Not ``dynamic=True``: under FSDP2 dynamo sources the
blocks' attributes from an FSDP-managed module, and ``dynamic=True`` then made integers such as
``head_dim`` graph inputs too; the rotary and shared-prompt gather kernels compiled around a
symbolic head size ran 6-8x slower on an H200 and the FSDP(2) log-prob pass took 0.21 s instead
of 0.16 s (``benchmarks/multi_gpu.py --profile``). Automatic dynamic keeps every size that never
changes a constant.

What it buys on GPU (Qwen2.5-0.5B shape, one H200, ``benchmarks/grpo_step.py``): the RMSNorms,
rotary embeddings, SiLU-gating and residual adds of each block fuse into a few kernels; see
``benchmarks/README.md`` for the measured update and log-prob pass figures.

:func:`maybe_compile` is what :func:`rlkit.state.init` calls (``compile="auto"``: on CUDA when
Triton is importable and the model has at least :data:`AUTO_MIN_PARAMS` parameters; never on CPU,
where compilation needs a C++ toolchain and takes longer than the tiny models it would speed up).
:func:`eager_fallback` keeps a compiler failure from stopping a run: the blocks go back to eager
mode, a warning names the error, and the call is retried.
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any, Callable, Iterable

import torch
from torch import nn

#: environment override for ``compile="auto"``: "0" never compiles, "1" compiles on any device
ENV = "RLKIT_COMPILE"

#: ``compile="auto"`` leaves models with fewer parameters than this eager. Compiling costs about
#: 20 s up front (two compilations: the first batch's sizes, then symbolic ones), which a small
#: model earns back slowly or never. Measured on one H200 with ``benchmarks/compile_sizes.py``
#: (the standard GRPO step, blocks and decode pieces compiled against eager; the break-even is the
#: number of steps after which the compiled run has caught up):
#:
#: - 0.6M parameters: 0.88x and 1.07x a step, so never, or after 1,674 steps;
#: - 6M: 1.32x, 1.32x and 1.49x, even after 256, 311 and 185 steps;
#: - 13M: 1.65x, even after 150 steps (compiling added 25 s);
#: - 24M: 1.33x, 1.60x and 1.71x, even after 178, 119 and 115 steps;
#: - 39M: 2.03x and 1.67x, 72 and 115 steps; 129M: 1.72x, 62 steps; 494M: 1.69x, 21 steps.
#:
#: So the line sits between 6M and 24M; at 13M a run needs about 150 steps to earn the compile
#: back, more than a notebook's first try (30 steps at 13M: 15 s eager against 35 s compiled).
#: The quickstart's 0.5M-parameter model runs 30 GRPO steps in about 2 s eagerly. Every real
#: language model (GPT-2 small has 124M) is above the line.
AUTO_MIN_PARAMS = 20_000_000


def large_enough(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether ``tensors`` hold at least :data:`AUTO_MIN_PARAMS` elements, each tensor counted
    once (a tied weight listed under two names is one tensor). The rule of ``compile="auto"`` and
    of the rollout engine's default ``compile_decode``."""
    unique = {id(t): t for t in tensors}
    return sum(t.numel() for t in unique.values()) >= AUTO_MIN_PARAMS


def _blocks(model: nn.Module) -> list[nn.Module]:
    from rlkit.parallel.fsdp import decoder_layers

    return decoder_layers(model)


def is_compiled(model: nn.Module) -> bool:
    """True when the decoder blocks of ``model`` run through ``torch.compile``."""
    blocks = _blocks(model)
    return bool(blocks) and all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)


def compile_layers(model: nn.Module, *, dynamic: bool | None = None, backend: str | Callable = "inductor", **options: Any) -> int:
    """Compile every decoder block of ``model`` in place; returns how many were compiled.

    ``dynamic``: passed to ``torch.compile``; the default ``None`` is dynamo's automatic dynamic
    shapes (module docstring: why not ``True``).

    Idempotent for blocks already compiled. Raises ``ValueError`` when the model has no
    recognisable block list (``model.model.layers`` for Llama/Qwen)."""
    blocks = _blocks(model)
    if not blocks:
        raise ValueError(
            f"compile_layers: found no decoder blocks in {type(model).__name__} (looked for an nn.ModuleList named "
            "'layers', 'h' or 'blocks'); compile the model yourself with torch.compile or pass compile=False"
        )
    _raise_recompile_limit(RECOMPILE_LIMIT)
    for block in blocks:
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(dynamic=dynamic, backend=backend, **options)
    return len(blocks)


#: compiled variants allowed per code object (automatic dynamic shapes: up to two per variant,
#: the first for exact sizes, then one with the token count symbolic). All blocks share one (``forward`` of the block
#: class), and each combination of model (actor / reference: parameters' requires_grad differs),
#: grad mode (update / log-prob pass) and attention layout (varlen, shared prompts, padded) a
#: block meets is one variant. Dynamo's default of 8 is reached by a GRPO run that also checks
#: or evaluates, and past it the blocks silently run eagerly: measured, the update went from
#: 0.57 to 0.76 s per step (benchmarks/HISTORY.md).
RECOMPILE_LIMIT = 64


def _raise_recompile_limit(limit: int) -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < limit:
        setattr(config, name, limit)


def uncompile_layers(model: nn.Module) -> None:
    """Put the decoder blocks back in eager mode (undoes :func:`compile_layers`)."""
    for block in _blocks(model):
        block._compiled_call_impl = None


def auto_enabled(model: nn.Module) -> bool:
    """The ``compile="auto"`` rule: the model's parameters are on CUDA, it has at least
    :data:`AUTO_MIN_PARAMS` of them, and Triton is importable (``RLKIT_COMPILE=0`` / ``=1``
    overrides it)."""
    env = os.environ.get(ENV)
    if env is not None and env.strip() != "":
        return env.strip() not in ("0", "false", "False", "no")
    param = next(model.parameters(), None)
    if param is None or not param.is_cuda:
        return False
    # numel of a sharded (FSDP2) parameter is its global size, so every rank decides alike
    if not large_enough(model.parameters()):
        return False
    return importlib.util.find_spec("triton") is not None


def maybe_compile(model: nn.Module | None, mode: bool | str) -> bool:
    """Apply ``compile`` = True / False / "auto" to ``model``'s blocks; returns whether it compiled."""
    if model is None or mode is False:
        return False
    if mode not in (True, "auto"):
        raise ValueError(f"compile must be True, False or 'auto', got {mode!r}")
    if mode == "auto" and not auto_enabled(model):
        return False
    if mode == "auto" and not _blocks(model):
        return False
    compile_layers(model)
    return True


def _compile_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = []
    try:
        from torch._dynamo.exc import TorchDynamoException

        errors.append(TorchDynamoException)
    except ImportError:  # pragma: no cover - very old torch
        pass
    try:
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)


def eager_fallback(model: nn.Module, call: Callable[[], Any]) -> Any:
    """``call()``; if it fails inside the compiler, uncompile ``model``'s blocks, warn, and retry eagerly.

    A compile error is raised on the first forward of a new shape, before any parameter or
    optimizer state changes, so the retry computes exactly what the failed call would have."""
    if not is_compiled(model):
        return call()
    try:
        return call()
    except _compile_errors() as exc:
        uncompile_layers(model)
        warnings.warn(
            f"rlkit: torch.compile failed on {type(model).__name__}'s decoder blocks ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); continuing in eager mode. "
            f"Pass compile=False to rk.init (or set {ENV}=0) to skip compilation.",
            RuntimeWarning,
            stacklevel=3,
        )
        return call()
