"""The built-in rollout engine: a functional Llama/Qwen2/Qwen3 decoder over Hugging Face weights.

The model is a dict ``name -> tensor`` with Hugging Face parameter names
(``model.layers.0.self_attn.q_proj.weight``, ...). :meth:`TorchEngine.from_model` takes the
model's own parameter storage (``detach()``, no copy), so an in-place optimizer step is seen by
the next ``generate`` and weight sync costs nothing when training and rollout share a device.

Generation: left-padded prompts, one prefill over the prompt, then one decode step per token
against a static, preallocated KV cache of ``p + max_new_tokens`` slots. A decode step has fixed
shapes and reads its position from a device tensor, so it does no host synchronisation (it can
be captured in a CUDA graph); the host checks "all rows finished" only every ``sync_every``
tokens. Numerics follow transformers: RMSNorm in float32, the model's own rotary embedding
module for cos/sin (``rope_theta`` and rope scaling from the config), SDPA attention with GQA.

Sampling: logits -> / temperature -> top-k -> top-p -> sample with the exponential-race trick
(``argmax(log p - log E)``, ``E ~ Exp(1)``, drawn from the caller's ``torch.Generator``), which
samples exactly from ``p``. The behaviour log-prob is ``log p(token)`` under that processed
distribution; greedy decoding (temperature 0) reports the plain log-softmax.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rlkit.engines.base import Generation, SamplingParams

#: model_type -> name of its rotary-embedding class in ``transformers.models.<type>.modeling_<type>``
SUPPORTED = {"llama": "LlamaRotaryEmbedding", "qwen2": "Qwen2RotaryEmbedding", "qwen3": "Qwen3RotaryEmbedding"}


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)``, computed in float32 then cast back (as transformers)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(b kvh s d) -> (b kvh*groups s d), each kv head repeated for its query heads."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


@dataclass
class _DecodeState:
    """Everything one decode step reads and writes, preallocated so the step is shape-static."""

    tokens: torch.Tensor  # (b) long, last sampled token (the next step's input)
    step: torch.Tensor  # () long, index of the token the next step samples
    prompt_width: int  # p: cache slot of the first generated token
    prompt_lengths: torch.Tensor  # (b) long, real prompt tokens per row
    key_valid: torch.Tensor  # (b S) bool, which cache slots hold real tokens
    k_cache: list[torch.Tensor]  # per layer (b kvh S d)
    v_cache: list[torch.Tensor]
    out_tokens: torch.Tensor  # (b T) long
    out_mask: torch.Tensor  # (b T) bool
    out_logprobs: torch.Tensor  # (b T) f32
    finished: torch.Tensor  # (b) bool
    stop_ids: torch.Tensor  # (s) long
    pad_id: int


class TorchEngine:
    """Batched sampling for Llama / Qwen2 / Qwen3 decoders (see the module docstring).

    Implements :class:`rlkit.engines.base.Engine`. Build with :meth:`from_model` (shares the
    model's parameter storage) or ``TorchEngine(config, weights)`` (weights: HF names -> tensors;
    the engine uses the given tensors as they are). Runs on the device of the weights.
    """

    def __init__(
        self,
        config,
        weights: Mapping[str, torch.Tensor],
        *,
        rotary: nn.Module | None = None,
        pad_token_id: int | None = None,
        sync_every: int = 8,
    ):
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED:
            raise ValueError(
                f"TorchEngine supports model_type in {sorted(SUPPORTED)}, got {model_type!r} "
                f"({getattr(config, 'architectures', None)}); use rlkit.engines.HFEngine(model, tokenizer) for other "
                "architectures"
            )
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
            raise ValueError(
                f"TorchEngine does not implement sliding-window attention (layer_types={layer_types}); "
                "use rlkit.engines.HFEngine for this model"
            )
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.config = config
        self.weights: dict[str, torch.Tensor] = {}
        for name, tensor in dict(weights).items():
            if _is_dtensor(tensor):
                raise ValueError(
                    f"weight {name!r} is a DTensor (sharded); build the engine from full tensors, e.g. "
                    "TorchEngine(config, {n: t.full_tensor() for n, t in ...}) or call load_weights with gathered tensors"
                )
            self.weights[name] = tensor.detach()
        embed = self.weights.get("model.embed_tokens.weight")
        if embed is None:
            raise ValueError(
                "weights have no 'model.embed_tokens.weight'; pass Hugging Face parameter names "
                f"(got e.g. {sorted(self.weights)[:3]})"
            )
        if "lm_head.weight" not in self.weights:
            if not getattr(config, "tie_word_embeddings", False):
                raise ValueError("weights have no 'lm_head.weight' and the config does not tie word embeddings")
            self.weights["lm_head.weight"] = embed
        self.device = embed.device
        self.dtype = embed.dtype
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        from transformers.activations import ACT2FN

        self.act = ACT2FN[config.hidden_act]
        self.layers = []
        for i in range(self.num_layers):
            prefix = f"model.layers.{i}."
            layer = {k[len(prefix) :]: v for k, v in self.weights.items() if k.startswith(prefix)}
            if "self_attn.q_proj.weight" not in layer:
                raise ValueError(f"weights have no {prefix}self_attn.q_proj.weight (config has {self.num_layers} layers)")
            self.layers.append(layer)
        self.rotary = rotary if rotary is not None else self._build_rotary(config)
        self.pad_token_id = self._pick_pad(config, pad_token_id)
        self.sync_every = sync_every
        self.policy_version = 0
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ construction / weights
    @classmethod
    def from_model(cls, model: nn.Module, **kwargs) -> "TorchEngine":
        """An engine reading ``model``'s own parameters (same storage: no copy, always current)."""
        weights = dict(model.named_parameters(remove_duplicate=False))
        rotary = getattr(getattr(model, "base_model", model), "rotary_emb", None)
        return cls(model.config, weights, rotary=rotary, **kwargs)

    @staticmethod
    def _build_rotary(config) -> nn.Module:
        module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
        return getattr(module, SUPPORTED[config.model_type])(config=config)

    @staticmethod
    def _pick_pad(config, pad_token_id: int | None) -> int:
        if pad_token_id is not None:
            return int(pad_token_id)
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(config, name, None)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
        return 0

    @torch.no_grad()
    def load_weights(
        self, weights: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]], *, version: int
    ) -> dict[str, float]:
        """Copy new weights (HF names) into the engine's tensors; tensors already shared are skipped.

        Accepts DTensors (gathered with ``full_tensor()``). Returns ``{"bytes", "seconds"}``.
        """
        start = time.perf_counter()
        copied = 0
        items = weights.items() if isinstance(weights, Mapping) else weights
        for name, tensor in items:
            if _is_dtensor(tensor):
                tensor = tensor.full_tensor()
            dst = self.weights.get(name)
            if dst is None:
                if "rotary_emb" in name:  # buffers some state dicts carry; the engine derives them
                    continue
                raise KeyError(
                    f"load_weights: unknown parameter {name!r}; the engine has Hugging Face names such as "
                    f"{sorted(self.weights)[:3]}"
                )
            if dst.shape != tensor.shape:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the engine's is {tuple(dst.shape)}")
            if dst.data_ptr() == tensor.data_ptr() and dst.device == tensor.device and dst.dtype == tensor.dtype:
                continue
            dst.copy_(tensor)
            copied += dst.numel() * dst.element_size()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.policy_version = int(version)
        return {"bytes": float(copied), "seconds": time.perf_counter() - start}

    # ------------------------------------------------------------------ model math
    def _rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (length d) for positions 0..length-1, from the model's rotary module."""
        if self._cos_sin is None or self._cos_sin[0].shape[0] < length:
            rotary = self.rotary.to(self.device)
            positions = torch.arange(max(length, 256), device=self.device)[None]
            dummy = torch.empty(0, device=self.device, dtype=self.dtype)
            cos, sin = rotary(dummy, positions)
            self._cos_sin = (cos[0], sin[0])
        return self._cos_sin

    def _attention(self, layer: dict, x: torch.Tensor, cos, sin, write, keys, mask) -> torch.Tensor:
        """One attention block. ``x (b s h)``; ``cos, sin (b s d)``; ``write(i, k, v)`` stores the new
        keys/values and ``keys()`` returns the cached ``(k, v)`` to attend over with ``mask (b 1 s S)``."""
        b, s, _ = x.shape
        q = _linear(x, layer, "self_attn.q_proj").view(b, s, self.num_heads, self.head_dim)
        k = _linear(x, layer, "self_attn.k_proj").view(b, s, self.num_kv_heads, self.head_dim)
        v = _linear(x, layer, "self_attn.v_proj").view(b, s, self.num_kv_heads, self.head_dim)
        if "self_attn.q_norm.weight" in layer:  # Qwen3: RMSNorm over each head before rotary
            q = _rms_norm(q, layer["self_attn.q_norm.weight"], self.eps)
            k = _rms_norm(k, layer["self_attn.k_norm.weight"], self.eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        write(k, v)
        k_all, v_all = keys()
        groups = self.num_heads // self.num_kv_heads
        # Masked GQA in SDPA falls back to the math kernel on CUDA; repeating kv heads keeps the fast ones.
        out = F.scaled_dot_product_attention(
            q, _repeat_kv(k_all, groups), _repeat_kv(v_all, groups), attn_mask=mask, scale=self.head_dim**-0.5
        )
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return _linear(out, layer, "self_attn.o_proj")

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        return _linear(self.act(_linear(x, layer, "mlp.gate_proj")) * _linear(x, layer, "mlp.up_proj"), layer, "mlp.down_proj")

    def _forward(self, ids: torch.Tensor, cos, sin, writes, keys, mask) -> torch.Tensor:
        """Decoder over ``ids (b s)`` -> final-normed hidden ``(b s h)``."""
        x = F.embedding(ids, self.weights["model.embed_tokens.weight"])
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer["input_layernorm.weight"], self.eps)
            x = x + self._attention(layer, h, cos, sin, writes[i], keys[i], mask)
            h = _rms_norm(x, layer["post_attention_layernorm.weight"], self.eps)
            x = x + self._mlp(layer, h)
        return _rms_norm(x, self.weights["model.norm.weight"], self.eps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weights["lm_head.weight"]).float()

    # ------------------------------------------------------------------ sampling
    def _noise(self, shape, generator: torch.Generator | None) -> torch.Tensor:
        if generator is None or generator.device == self.device:
            return torch.empty(shape, device=self.device).exponential_(generator=generator)
        return torch.empty(shape, device=generator.device).exponential_(generator=generator).to(self.device)

    def _sample(self, logits: torch.Tensor, params: SamplingParams, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(b v) f32 logits -> sampled tokens (b) and their log-probs under the processed distribution."""
        if params.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            tokens = logits.argmax(-1)
            return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
        z = logits / params.temperature
        if params.top_k > 0 and params.top_k < z.shape[-1]:
            kth = torch.topk(z, params.top_k, dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if params.top_p < 1.0:
            # keep the smallest prefix of tokens (by descending prob) whose mass reaches top_p
            sorted_z, order = torch.sort(z, dim=-1, descending=True)
            probs = torch.softmax(sorted_z, dim=-1)
            mass_before = probs.cumsum(-1) - probs
            drop_sorted = mass_before >= params.top_p
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            z = z.masked_fill(drop, float("-inf"))
        logp = torch.log_softmax(z, dim=-1)
        tokens = (logp - self._noise(logp.shape, generator).log()).argmax(-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    def _record(self, state: _DecodeState, tokens: torch.Tensor, logprobs: torch.Tensor, params: SamplingParams) -> None:
        """Write the sampled tokens at ``state.step`` (finished rows get pad, mask False, log-prob 0)."""
        alive = ~state.finished
        tokens = torch.where(alive, tokens, torch.full_like(tokens, state.pad_id))
        index = state.step.view(1)
        state.out_tokens.index_copy_(1, index, tokens[:, None])
        state.out_mask.index_copy_(1, index, alive[:, None])
        state.out_logprobs.index_copy_(1, index, torch.where(alive, logprobs, torch.zeros_like(logprobs))[:, None])
        if not params.ignore_stop and state.stop_ids.numel():
            state.finished |= torch.isin(tokens, state.stop_ids) & alive
        state.tokens.copy_(tokens)
        state.step += 1

    def _decode_step(self, state: _DecodeState, params: SamplingParams, generator) -> None:
        """Feed the last sampled token, sample the next one. Fixed shapes, no host sync."""
        slot = (state.step - 1 + state.prompt_width).view(1)
        positions = state.prompt_lengths + state.step - 1  # (b)
        cos_table, sin_table = self._cos_sin
        cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]  # (b 1 d)
        state.key_valid.index_fill_(1, slot, True)
        mask = state.key_valid[:, None, None, :]

        def writer(i):
            def write(k, v):
                state.k_cache[i].index_copy_(2, slot, k)
                state.v_cache[i].index_copy_(2, slot, v)

            return write

        writes = [writer(i) for i in range(self.num_layers)]
        keys = [lambda i=i: (state.k_cache[i], state.v_cache[i]) for i in range(self.num_layers)]
        hidden = self._forward(state.tokens[:, None], cos, sin, writes, keys, mask)
        tokens, logprobs = self._sample(self._logits(hidden[:, -1]), params, generator)
        self._record(state, tokens, logprobs, params)

    # ------------------------------------------------------------------ generate
    def _left_pad(self, prompts: Sequence[Sequence[int]], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if len(prompts) == 0:
            raise ValueError("generate: prompt_ids is empty; pass at least one prompt")
        vocab = self.weights["model.embed_tokens.weight"].shape[0]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.bool)
        for i, prompt in enumerate(prompts):
            row = list(prompt)
            if not row:
                raise ValueError(f"generate: prompt {i} is empty; every prompt needs at least one token (e.g. a BOS token)")
            if min(row) < 0 or max(row) >= vocab:
                raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab}): {row[:10]}...")
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = True
        ids = ids.repeat_interleave(n, dim=0).to(self.device)
        mask = mask.repeat_interleave(n, dim=0).to(self.device)
        return ids, mask

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
    ) -> Generation:
        """Sample ``params.n`` responses per prompt (rows prompt-major). See :class:`Generation`."""
        start = time.perf_counter()
        ids, prompt_mask = self._left_pad(prompt_ids, params.n)
        b, p = ids.shape
        steps = params.max_new_tokens
        total = p + steps
        cos_table, sin_table = self._rope_table(total)
        kv_shape = (b, self.num_kv_heads, total, self.head_dim)
        state = _DecodeState(
            tokens=torch.zeros(b, dtype=torch.long, device=self.device),
            step=torch.zeros((), dtype=torch.long, device=self.device),
            prompt_width=p,
            prompt_lengths=prompt_mask.sum(-1),
            key_valid=torch.cat([prompt_mask, torch.zeros(b, steps, dtype=torch.bool, device=self.device)], dim=1),
            k_cache=[torch.zeros(kv_shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)],
            v_cache=[torch.zeros(kv_shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)],
            out_tokens=torch.full((b, steps), self.pad_token_id, dtype=torch.long, device=self.device),
            out_mask=torch.zeros((b, steps), dtype=torch.bool, device=self.device),
            out_logprobs=torch.zeros((b, steps), dtype=torch.float32, device=self.device),
            finished=torch.zeros(b, dtype=torch.bool, device=self.device),
            stop_ids=torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=self.device),
            pad_id=self.pad_token_id,
        )

        # Prefill: causal attention among real prompt tokens; a pad query attends to itself only,
        # so no softmax row is empty (its output is never used).
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(p, p, dtype=torch.bool, device=self.device).tril()
        eye = torch.eye(p, dtype=torch.bool, device=self.device)
        mask = (causal & (prompt_mask[:, None, :] | eye))[:, None]  # (b 1 p p)

        def writer(i):
            def write(k, v):
                state.k_cache[i][:, :, :p] = k
                state.v_cache[i][:, :, :p] = v

            return write

        writes = [writer(i) for i in range(self.num_layers)]
        keys = [lambda i=i: (state.k_cache[i][:, :, :p], state.v_cache[i][:, :, :p]) for i in range(self.num_layers)]
        hidden = self._forward(ids, cos_table[positions], sin_table[positions], writes, keys, mask)
        tokens, logprobs = self._sample(self._logits(hidden[:, -1]), params, generator)
        self._record(state, tokens, logprobs, params)
        prefill_seconds = time.perf_counter() - start

        done = 1
        while done < steps:
            self._decode_step(state, params, generator)
            done += 1
            if done % self.sync_every == 0 and bool(state.finished.all()):
                break

        lengths = state.out_mask.sum(-1)
        width = max(int(lengths.max()), 1)
        seconds = time.perf_counter() - start
        generated = int(lengths.sum())
        return Generation(
            response_ids=state.out_tokens[:, :width].clone(),
            response_mask=state.out_mask[:, :width].clone(),
            logprobs=state.out_logprobs[:, :width].clone(),
            truncated=~state.finished,
            prompt_index=torch.arange(len(prompt_ids), device=self.device).repeat_interleave(params.n),
            metrics={
                "seconds": seconds,
                "prefill_seconds": prefill_seconds,
                "tokens": float(generated),
                "tokens_per_second": generated / max(seconds, 1e-9),
                "decode_steps": float(done),
            },
        )
