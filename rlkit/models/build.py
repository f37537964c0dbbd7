"""Build, load and derive models: a seeded random tiny causal LM, a local checkpoint, a critic.

Everything is a plain ``transformers`` model, so ``save_pretrained`` / ``from_pretrained``,
FSDP2 wrapping and the engines all work on what these functions return. Nothing is downloaded.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

#: architecture presets: name -> config fields (head_dim = hidden_size / num_attention_heads)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024),
    # Qwen2.5-0.5B's shape (random weights): https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
    ),
}

#: arch name -> transformers config class name
ARCHS = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config"}

#: weight files of which a model directory needs at least one
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _vocab_fields(vocab: Any) -> dict[str, Any]:
    """vocab_size and special-token ids from a tokenizer, or just vocab_size from an int."""
    if isinstance(vocab, bool) or vocab is None:
        raise TypeError(f"vocab must be a tokenizer or an int vocabulary size, got {vocab!r}")
    if isinstance(vocab, int):
        if vocab < 1:
            raise ValueError(f"vocab size must be >= 1, got {vocab}")
        return {"vocab_size": vocab}
    if not hasattr(vocab, "convert_tokens_to_ids"):
        raise TypeError(f"vocab must be a tokenizer or an int vocabulary size, got {type(vocab).__name__}")
    fields = {"vocab_size": len(vocab)}
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(vocab, name, None)
        if value is not None:
            fields[name] = value
    return fields


#: override names :func:`tiny_config` handles itself or that configs take beside their fields
#: (``rope_theta`` goes into ``rope_parameters``; ``head_dim`` is read by every arch's attention)
EXTRA_FIELDS = ("head_dim", "rope_theta", "rope_scaling", "attn_implementation", "num_labels")


def _check_overrides(arch: str, overrides: dict[str, Any]) -> None:
    """Refuse override names the architecture does not have: transformers configs keep any
    keyword as an attribute, so ``hiden_size=64`` would build the default shape silently."""
    import difflib

    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    known = set(getattr(transformers, ARCHS[arch])().to_dict()) | set(EXTRA_FIELDS)
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hints.append(f"{name!r} (did you mean {', '.join(map(repr, close))}?)" if close else repr(name))
        raise ValueError(f"unknown {ARCHS[arch]} field(s) {', '.join(hints)}; tiny takes size, arch, seed, dtype and "
                         f"config fields such as hidden_size, num_hidden_layers, num_attention_heads, intermediate_size")


def _check_heads(fields: dict[str, Any]) -> None:
    """Name the shape rule a head count breaks (transformers reports a RoPE error about head_dim
    or a tensor-size mismatch in attention instead)."""
    from rlkit._checks import int_at_least

    for name in ("hidden_size", "num_attention_heads", "num_key_value_heads"):
        if fields.get(name) is not None:
            int_at_least(fields[name], name)
    hidden, heads, kv = fields["hidden_size"], fields["num_attention_heads"], fields.get("num_key_value_heads")
    if "head_dim" not in fields:
        if hidden % heads:
            raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads} (each head gets "
                             "hidden_size / num_attention_heads dimensions); change one, or give head_dim=... explicitly")
        if (hidden // heads) % 2:
            raise ValueError(f"head_dim = hidden_size / num_attention_heads = {hidden // heads} is odd; rotary embeddings "
                             "rotate pairs of dimensions, so pick sizes that give an even head_dim (or give head_dim=...)")
    if kv is not None and heads % kv:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv} (grouped-query "
                         "attention shares each key/value head among a whole number of query heads)")


def _dtype(dtype: Any, where: str, auto: bool = False) -> torch.dtype | str:
    """``dtype`` as a floating torch.dtype, from itself or a name (``"bfloat16"``,
    ``"torch.float16"``); ``"auto"`` (the checkpoint's own) where ``auto``."""
    if auto and dtype == "auto":
        return dtype
    value = dtype
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        accepted = "a floating torch.dtype (torch.bfloat16) or its name: 'bfloat16', 'float16', 'float32'" + (
            ", or 'auto' (the checkpoint's dtype)" if auto else "")
        raise ValueError(f"{where}: dtype={dtype!r} is not a floating dtype; use {accepted}")
    return value


def _config(arch: str, fields: dict[str, Any]) -> PretrainedConfig:
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    fields = dict(fields)
    rope_theta = fields.pop("rope_theta", None)
    if rope_theta is not None:
        # transformers 5 keeps theta inside rope_parameters; one built from rope_scaling (or
        # given whole without a theta) would silently fall back to 10000
        scaling = fields.pop("rope_scaling", None)
        params = dict(fields.get("rope_parameters") or scaling or {"rope_type": "default"})
        if "type" in params and "rope_type" not in params:  # the older key of rope_scaling
            params["rope_type"] = params.pop("type")
        if "rope_theta" in params and float(params["rope_theta"]) != float(rope_theta):
            raise ValueError(f"rope_theta={rope_theta} disagrees with rope_parameters' rope_theta={params['rope_theta']}; give one")
        fields["rope_parameters"] = {**params, "rope_theta": float(rope_theta)}
    return getattr(transformers, ARCHS[arch])(**fields)


def tiny_config(vocab: Any, size: str = "tiny", arch: str = "qwen2", **overrides: Any) -> PretrainedConfig:
    """The config :func:`tiny` builds its model from (same arguments, no weights allocated)."""
    if size not in PRESETS:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(PRESETS)} (or pass hidden_size=... overrides)")
    _check_overrides(arch, overrides)
    fields: dict[str, Any] = {"tie_word_embeddings": True, **PRESETS[size]}
    fields.update(_vocab_fields(vocab))
    fields.update(overrides)
    _check_heads(fields)
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    return _config(arch, fields)


def tiny(
    vocab: Any,
    size: str = "tiny",
    arch: str = "qwen2",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised causal LM (seeded, deterministic, on CPU) of a preset shape.

    ``vocab``: a tokenizer (vocab size and pad/bos/eos ids are taken from it) or an int vocab size
    (the benchmark's Qwen2.5 shape takes ``vocab=151936``; the preset's own 151936 is what
    ``overrides`` replace, and ``vocab`` always sets it). ``size``: one of :data:`PRESETS`.
    ``arch``: ``"qwen2"`` (q/k/v biases), ``"llama"`` or ``"qwen3"`` (q/k RMS norms).
    ``overrides``: any config field (``hidden_size=64``, ``rope_theta=1e6``,
    ``tie_word_embeddings=False``, ...). Word embeddings are tied by default. The global RNG is
    left untouched: the seed only drives this initialisation. A tokenizer given as ``vocab`` is
    kept as ``model.rlkit_tokenizer`` (``rlkit.init`` reads it).
    """
    from transformers import AutoModelForCausalLM

    dtype = _dtype(dtype, "tiny")
    config = tiny_config(vocab, size, arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if not isinstance(vocab, int):
        # rk.init picks the tokenizer up from here, so tiny(tokenizer) alone is enough to train
        model.rlkit_tokenizer = vocab
    return model


def _check_model_dir(path: str | os.PathLike, what: str) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{what}: {str(directory)!r} is not a directory; pass a local model directory "
            "(one written by model.save_pretrained(path)); rlkit never downloads from the hub"
        )
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{what}: {str(directory)!r} has no config.json (it holds {sorted(p.name for p in directory.iterdir())[:20]}); "
            "save the model with model.save_pretrained(path)"
        )
    if not any((directory / f).is_file() for f in WEIGHT_FILES):
        raise FileNotFoundError(
            f"{what}: {str(directory)!r} has no weights (looked for {list(WEIGHT_FILES)}; it holds "
            f"{sorted(p.name for p in directory.iterdir())[:20]}); save the model with model.save_pretrained(path)"
        )
    return directory


def causal_lm_types() -> list[str]:
    """model_type names that ``AutoModelForCausalLM`` can build."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def load_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
) -> PreTrainedModel:
    """Load a causal LM from a LOCAL directory (``local_files_only``), checking what is there first.

    ``dtype``: a torch.dtype or its name (``"bfloat16"``), or ``"auto"`` (the checkpoint's);
    ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:0"``, ... (both checked before anything loads)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from rlkit.state import _checked_device

    dtype = _dtype(dtype, "load_model", auto=True)
    if device is not None:
        device = _checked_device(device, "load_model")
    directory = _check_model_dir(path, "load_model")
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    supported = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if config.model_type not in supported:
        raise ValueError(
            f"load_model: {str(directory)!r} holds a {config.model_type!r} model (architectures="
            f"{getattr(config, 'architectures', None)}), which is not a causal LM; supported model_type values: "
            f"{', '.join(sorted(supported))}"
        )
    architectures = getattr(config, "architectures", None) or []
    causal_classes = set(supported.values())
    if architectures and not any(a in causal_classes or a.endswith("ForCausalLM") for a in architectures):
        raise ValueError(
            f"load_model: {str(directory)!r} was saved as {architectures}, not a causal LM "
            f"(for {config.model_type!r} that is {supported[config.model_type]}); a value model loads with "
            "rlkit.models.critic(path)"
        )
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, local_files_only=True)
    if device is not None:
        model = model.to(device)
    return model


#: name fragments of dropout rates: config fields (``attention_dropout``, ``attn_pdrop``,
#: ``hidden_dropout_prob``, OPT's ``layerdrop``, ...) and the float attributes transformers modules
#: copy them into at construction (``Qwen2Attention.attention_dropout``, ``OPTDecoderLayer.dropout``)
DROPOUT_NAMES = ("dropout", "pdrop", "layerdrop")


def _is_rate_name(name: str) -> bool:
    lowered = name.lower()
    return any(part in lowered for part in DROPOUT_NAMES)


def _rate(value: Any) -> bool:
    """A dropout rate: a float (or int) that is not a bool."""
    return isinstance(value, (float, int)) and not isinstance(value, bool)


def _configs(model: nn.Module) -> list[PretrainedConfig]:
    """Every distinct config of ``model`` and its submodules, with their sub-configs (``text_config``, ...)."""
    seen: dict[int, PretrainedConfig] = {}
    stack = [getattr(m, "config", None) for m in model.modules()]
    while stack:
        config = stack.pop()
        if not isinstance(config, PretrainedConfig) or id(config) in seen:
            continue
        seen[id(config)] = config
        stack.extend(v for v in vars(config).values() if isinstance(v, PretrainedConfig))
    return list(seen.values())


def active_dropout(model: nn.Module) -> tuple[list[str], list[str]]:
    """Where ``model`` drops out in training mode: ``(modules, config_fields)``.

    ``modules``: each dropout module with ``p > 0`` (``"transformer.h.0.attn.attn_dropout
    (p=0.1)"``) and each module keeping a dropout rate > 0 as a float attribute (OPT's layers,
    ``"model.decoder.layers.0 (dropout=0.1)"``). ``config_fields``: the attention dropout the
    config sets (``"attn_pdrop=0.1"``), which rlkit's packed attention reads
    (:mod:`rlkit.models.logprobs`). Both empty for a model without dropout (:func:`tiny`'s)."""
    from rlkit.models.logprobs import _ATTENTION_DROPOUT_FIELDS

    modules = []
    for name, module in model.named_modules():
        where = name or type(module).__name__
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                modules.append(f"{where} (p={module.p})")
            continue
        rates = [f"{attr}={value}" for attr, value in vars(module).items() if _is_rate_name(attr) and _rate(value) and value > 0]
        if rates:
            modules.append(f"{where} ({', '.join(rates)})")
    fields = []
    for config in _configs(model):
        for field in _ATTENTION_DROPOUT_FIELDS:
            value = getattr(config, field, None)
            if _rate(value) and value > 0:
                fields.append(f"{field}={value}")
    return modules, list(dict.fromkeys(fields))


def disable_dropout(model: nn.Module) -> nn.Module:
    """Turn every dropout of ``model`` off, in place, and return it (TRL's ``disable_dropout=True``).

    Sets ``p = 0`` on every dropout module, 0 on every dropout rate the modules copied from the
    config at construction (float attributes named like :data:`DROPOUT_NAMES`: Llama/Qwen
    attention's ``attention_dropout``, OPT's ``dropout``), and 0 on the config's own dropout fields
    (``attn_pdrop``, ``attention_dropout``, ``layerdrop``, ...), so that rlkit's attention functions
    and anything else reading the config agree. Afterwards a transformers causal LM's
    training-mode forward equals its eval-mode one (dropout was the only difference).

    Why: rlkit trains the actor in training mode, and rollouts and ``compute_old_logprobs`` run in
    eval mode. With dropout on (GPT-2 and OPT default to 0.1) the training log-probs are noisy, so
    PPO's ratio is not 1 on an on-policy batch, a share of the tokens clips on the first step, and
    the ``actor/logprob_gap`` metrics measure the dropout noise. Call it before ``rk.init``::

        model = rk.models.disable_dropout(rk.models.load_model(path))
        state = rk.init(model, ...)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"disable_dropout takes a model (an nn.Module), got {type(model).__name__}")
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
            continue
        for attr, value in list(vars(module).items()):
            if _is_rate_name(attr) and _rate(value):
                setattr(module, attr, 0.0)
    for config in _configs(model):
        for field, value in list(vars(config).items()):
            if _is_rate_name(field) and _rate(value):
                setattr(config, field, 0.0)
    return model


def _critic_config(config: PretrainedConfig) -> PretrainedConfig:
    config = copy.deepcopy(config)
    config.num_labels = 1
    # verl's critic: no dropout on the value head, so values are deterministic in train mode.
    config.classifier_dropout = 0.0
    config.architectures = None
    return config


def critic(
    source: PreTrainedModel | PretrainedConfig | str | os.PathLike,
    *,
    init_from_actor: bool = True,
    seed: int = 0,
    dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """A value model: the actor's backbone with a scalar head, ``AutoModelForTokenClassification(num_labels=1)``.

    As in verl's critic, the head is ``score: Linear(hidden, 1)`` over the backbone's final hidden
    states; the result is a normal transformers model, so ``save_pretrained`` and
    ``critic(saved_dir)`` round-trip.

    ``source``: an actor model (its backbone weights are copied when ``init_from_actor``),
    a config (random init, seeded), or a local directory (a causal-LM checkpoint gives the
    backbone and a fresh head; a saved critic loads whole).
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    if dtype is not None:
        dtype = _dtype(dtype, "critic")
    if isinstance(source, (str, os.PathLike)):
        directory = _check_model_dir(source, "critic")
        config = _critic_config(AutoConfig.from_pretrained(str(directory), local_files_only=True))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return AutoModelForTokenClassification.from_pretrained(
                str(directory), config=config, dtype=dtype or torch.float32, local_files_only=True
            )
    if isinstance(source, PreTrainedModel):
        actor: PreTrainedModel | None = source
        config = source.config
    elif isinstance(source, PretrainedConfig):
        actor, config = None, source
    else:
        raise TypeError(f"critic: source must be a model, a config or a local directory, got {type(source).__name__}")
    config = _critic_config(config)
    if dtype is None:
        dtype = next(actor.parameters()).dtype if actor is not None else torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        value_model = AutoModelForTokenClassification.from_config(config, dtype=dtype)
    if actor is not None and init_from_actor:
        backbone = value_model.base_model
        missing, unexpected = backbone.load_state_dict(actor.base_model.state_dict(), strict=False)
        if missing or unexpected:
            raise ValueError(
                f"critic: the actor's backbone does not match the critic's (missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}); build the critic from the actor's own config"
            )
        device = next(actor.parameters()).device
        value_model = value_model.to(device)
    return value_model
