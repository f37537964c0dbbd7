"""Argument checks shared by the public functions: one wording for every "must be an int" error."""
from __future__ import annotations

import math
import numbers


def is_int(x) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A real number (Python's or numpy's), not a bool; NaN and inf included (check the range)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_seed(seed, where: str, hint: str = "") -> None:
    """Raise ``ValueError`` naming ``where`` unless ``seed`` is an int in ``[0, 2**63)``: what a
    torch generator takes (1.5 was truncated to 1, 2**64 overflowed inside it, None and "a" failed
    deep inside torch or ``random``). ``hint`` follows the requirement in the message."""
    if not (is_int(seed) and 0 <= seed < 2**63):
        raise ValueError(f"{where}: seed must be an int in [0, 2**63){hint}, got {seed!r}")


def int_at_least(value, name: str, minimum: int = 1, hint: str = "") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) ``>= minimum``;
    ``hint`` follows the requirement in the message (``" or None (the whole batch)"``)."""
    if not is_int(value) or value < minimum:
        need = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {need}{hint}, got {value!r}")


def unit_interval(value, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a real number in ``[0, 1]`` (NaN fails)."""
    if not is_real(value) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def positive_finite_or_none(value, name: str, none: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is None or a finite number > 0;
    ``none`` says what None means (``"no clipping"``)."""
    if value is not None and not (is_real(value) and 0 < value < math.inf):
        raise ValueError(f"{name} must be a finite number > 0, or None ({none}), got {value!r}")


def model_of(model, where: str, *, accept_state: bool = True):
    """The ``nn.Module`` a function that takes a model was given: a :class:`rlkit.TrainState`'s
    actor when ``accept_state`` (else a message naming ``state.actor``); a clear ``TypeError``
    for anything that is not a module."""
    import torch

    from rlkit.state import TrainState

    if isinstance(model, TrainState):
        if accept_state:
            return model.actor
        raise TypeError(f"{where} takes a model, not a TrainState; pass state.actor (or warm up before rk.init)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where} takes a model (a torch.nn.Module, e.g. rk.models.tiny(...)), got {type(model).__name__}")
    return model


def tokenizer_of(tokenizer, where: str):
    if tokenizer is None:
        raise TypeError(f"{where} needs a tokenizer (to read prompts and decode responses); got None")
    return tokenizer


def context_limit(model) -> int | None:
    """The model's context in tokens (``config.max_position_embeddings``), or None if it names none."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def check_context(model, tokens: int, where: str, hint: str) -> None:
    """Raise ``ValueError`` when ``tokens`` positions exceed the model's context
    (:func:`context_limit`): positions past it index nothing the model learned (the built-in
    engine would extend its rotary table and generate from them without a word)."""
    limit = context_limit(model)
    if limit is not None and tokens > limit:
        raise ValueError(f"{where} needs {tokens} positions, over the model's context of {limit} tokens "
                         f"(max_position_embeddings); {hint}")


def output_vocab(model) -> int | None:
    """Width of the model's logits: its output embedding's rows (a wrapper's ``.model`` looked
    through; a sharded weight's global shape), else ``config.vocab_size``, else None."""
    for m in (model, getattr(model, "model", None)):
        get = getattr(m, "get_output_embeddings", None)
        head = get() if callable(get) else None
        weight = getattr(head, "weight", None)
        if weight is not None and getattr(weight, "ndim", 0) == 2:
            return int(weight.shape[0])
    for m in (model, getattr(model, "model", None)):
        size = getattr(getattr(m, "config", None), "vocab_size", None)
        if isinstance(size, int):
            return size
    return None


def input_vocab(model) -> int | None:
    """Rows of the model's input embedding (a wrapper's ``.model`` looked through), or None."""
    for m in (model, getattr(model, "model", None)):
        get = getattr(m, "get_input_embeddings", None)
        if callable(get):
            rows = getattr(get(), "num_embeddings", None)
            if rows is not None:
                return int(rows)
    return None


def check_token_ids(batch, model, where: str) -> None:
    """Raise ``ValueError`` naming the field, row and id when a batch's ``prompt_ids`` or
    ``response_ids`` fall outside the model's vocabulary under their masks (pads may hold any id).
    Only for host tensors (reading a device
    tensor's range would wait for the device): there the embedding lookup failed later with an
    ``index out of bounds`` that named neither, and on a GPU it is a device-side assert that ends
    the process's CUDA context."""
    vocab = input_vocab(model)
    if vocab is None:
        return
    for key in ("prompt_ids", "response_ids"):
        ids = batch[key]
        if ids.device.type != "cpu" or ids.numel() == 0:
            continue
        # the real tokens only: a pad id is never embedded (the packed layouts leave pads out, the
        # padded one embeds id 0 there), so whatever a pad holds is fine
        bad = ((ids < 0) | (ids >= vocab)) & batch[key.replace("_ids", "_mask")].bool()
        if bad.any():
            row, col = (bad.nonzero()[0]).tolist()
            raise ValueError(
                f"{where}: batch[{key!r}] holds token id {int(ids[row, col])} (row {row}), outside the model's vocabulary "
                f"[0, {vocab}); were these ids made by another tokenizer than the model's? (rk.models.tiny(tokenizer) "
                "sizes the vocabulary to its tokenizer; a loaded model needs the tokenizer saved with it)")


def check_switch(value, name: str, meaning: str) -> bool:
    """``value`` as a bool: True or False (a numpy bool too), else a ``ValueError`` naming
    ``name``, as ``SamplingParams.ignore_stop`` is checked: a truthy string such as ``"no"`` (from a
    config file or the command line) ran as True, and 0/1 are refused alike. ``meaning`` says what
    True does."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")):
        return bool(value)
    raise ValueError(f"{name} must be True or False ({meaning}), got {type(value).__name__} {value!r}")
