"""The built-in rollout engine: a functional Llama/Qwen2/Qwen3 decoder over Hugging Face weights.

The model is a dict ``name -> tensor`` with Hugging Face parameter names
(``model.layers.0.self_attn.q_proj.weight``, ...). :meth:`TorchEngine.from_model` takes the
model's own parameter storage (``detach()``, no copy), so an in-place optimizer step is seen by
the next ``generate`` and weight sync costs nothing when training and rollout share a device.

Generation: left-padded prompts, one prefill over the prompt, then one decode step per token
against a static, preallocated KV cache of ``p + max_new_tokens`` slots. A decode step has fixed
shapes and reads its position from a device tensor, so it does no host synchronisation; the host
checks "all rows finished" only every ``sync_every`` tokens (never with ``ignore_stop``).
On the CPU, where that check costs no synchronisation, the eager decode checks every step and
drops finished rows from the step once an eighth of them have finished
(``COMPACT_FINISHED_ROWS``): later steps compute only the rows still decoding, with the same
samples and log-probs as the full batch (the noise is drawn for every row, as the full step draws
it). Compiled steps and CUDA graphs keep their fixed shapes.
Numerics follow transformers: RMSNorm in float32, the model's own rotary embedding module for
cos/sin (``rope_theta`` and rope scaling from the config), SDPA attention with GQA.

On CUDA (all three are on by default there and off on CPU; each can be turned off):

- ``cuda_graphs``: each decode step is captured once in a CUDA graph and replayed, one graph per
  *bucket* of filled cache length (``cache_bucket`` slots): step ``s`` attends over the first
  ``ceil((p + s) / cache_bucket) * cache_bucket`` slots only, not the whole cache. Graphs and
  the KV cache are kept between calls with the same shapes (``release()`` frees them). So that
  calls whose longest prompts differ by a few tokens share them, prompts are left-padded to a
  multiple of ``prompt_bucket`` tokens (default ``cache_bucket``) when graphs are used; without
  it every new prompt width would capture the graphs again.
- ``fuse``: q/k/v and gate/up projections run as one matrix product each, over concatenated
  copies of the weights. The copies no longer share the training storage, so they are
  re-concatenated by ``load_weights`` and at the start of every ``generate`` (version counters
  cannot tell: a fused AdamW step does not bump them). The cost is one extra copy of those
  weights (about 75% of a decoder's non-embedding parameters; 0.47 GB for Qwen2.5-0.5B) and
  one device copy per call (well under a millisecond there); on CPU the shared-storage path
  stays and sync is free.
- ``fused_sampling``: temperature/greedy sampling (no top-k/top-p) as two Triton kernels that
  read the bf16 logits once: a split-vocabulary pass computing the running log-sum-exp and the
  Gumbel-max argmax with counter-based (Philox) noise keyed by ``(seed, step, row, column)``,
  in base 2 with the hardware's ``lg2``/``ex2`` and all state per lane, and a combine pass per
  row. The seed is drawn from the caller's generator once per call.

``compile_decode`` (on by default on CUDA for models of at least
:data:`rlkit.models.compile.AUTO_MIN_PARAMS` parameters, as ``rk.init``'s ``compile="auto"``;
off on CPU and for smaller models, which earn back the compilation slowly or never): on CUDA the
elementwise work of each layer runs through ``torch.compile``d pieces between the matrix
products and the attention kernel (``"pieces"``; the CUDA graphs capture them). On CPU, where
there are no graphs to remove the per-operator cost, ``compile_decode=True`` compiles the whole
decode step as one graph
(``"step"``: every layer, the sampler and the bookkeeping; the sampling noise is drawn outside it
from the caller's generator, so the same seed samples the same tokens as the eager step). It
attends over ``cache_bucket``-sized buckets of the cache, so a call compiles a few graphs, not
one per token. It costs seconds of compilation on the first call and pays on long runs
(figures: ``benchmarks/HISTORY.md``, "CPU (eighth session)"). ``compile_decode="step"`` also
runs on CUDA (the graphs capture the compiled step), but there it measured slower than the
pieces on an H200 (141,789 against 154,182 and 150,341 against 157,181 tokens/s on the standard
workload, two machines), so ``True`` means pieces there. A compiler failure, including dynamo's
recompile limit (each engine and bucket is another variant of one code object), makes the engine
warn, record the error in ``engine.compile_error`` and continue eagerly with the noise already
drawn.

Decode attention on CUDA (``decode_attention="triton"``, the default there): one Triton kernel
per layer applies rotary to the new token's query and key, writes its key and value into the
cache and attends over the valid cache slots (:func:`decode_attention`); the compiled layer
entry before it is the RMSNorm and the q|k|v product only.

GQA decode attention never repeats key/value heads: the ``g = heads / kv_heads`` query heads of
one kv head are laid out as ``g`` query rows against that head's cache, ``(b kvh g d)``.

Tensor parallelism (``tp_group``): the weights are this rank's Megatron-LM shards (column
slices of q/k/v and gate/up, row slices of o and down; :func:`rlkit.parallel.tensor_parallel`
builds them), each rank attends over its own heads, and the two row-parallel partial sums of a
layer are all-reduced over the group. Fusion, the compiled pieces (the all-reduces run between
them) and CUDA graphs (NCCL collectives are captured with the step) apply as without TP. The
ranks of a group sample the same tokens: they compute the same full logits and draw the same
noise from the same generator state.

Sampling: logits -> / temperature -> top-k -> top-p -> sample with the exponential-race trick
(``argmax(log p - log E)``, ``E ~ Exp(1)``, i.e. Gumbel-max), which samples exactly from
``p``. The behaviour log-prob is ``log p(token)`` under that processed distribution; greedy
decoding (temperature 0) reports the plain log-softmax.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rlkit._triton import lazy_kernels
from rlkit.engines.base import Generation, SamplingParams, check_engine_context, left_pad_prompts, pick_pad_token_id

#: Triton and ``triton.language``, put here by :func:`rlkit._triton.lazy_kernels` when the kernels
#: are first built (None before that, and on machines without Triton)
triton: Any = None
tl: Any = None

#: model_type -> name of its rotary-embedding class in ``transformers.models.<type>.modeling_<type>``
SUPPORTED = {"llama": "LlamaRotaryEmbedding", "qwen2": "Qwen2RotaryEmbedding", "qwen3": "Qwen3RotaryEmbedding"}


def _fail_on_recompile_limit():
    """A context in which dynamo raises at its recompile limit instead of silently running eagerly."""
    config = torch._dynamo.config
    if "fail_on_recompile_limit_hit" in getattr(config, "_config", {}):
        return config.patch(fail_on_recompile_limit_hit=True)
    return contextlib.nullcontext()


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


def _additive_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: attend) as the additive one :func:`_small_attention` takes:
    0 where ``valid``, ``-inf`` elsewhere."""
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))


def _small_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` as two matmuls, in float32 at least. On CPU, at one
    query token per row, SDPA's kernels spend several times the arithmetic in per-call set-up
    (measured at the CPU benchmark's decode sizes: ~270 us per call against ~75 us for this)."""
    dtype = q.dtype
    if dtype not in (torch.float32, torch.float64):
        q, k, v, mask = q.float(), k.float(), v.float(), mask.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(mask)
    return torch.matmul(scores.softmax(-1), v).to(dtype)


def _linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(b kvh s d) -> (b kvh*groups s d), each kv head repeated for its query heads."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def _qkv(layer: dict, x: torch.Tensor, shape: tuple):
    """input RMSNorm -> q, k, v projections -> (Qwen3 q/k norms): ``x (b s h)`` -> ``q (b s H d)``,
    ``k, v (b s kvh d)``, before rotary."""
    heads, kv_heads, head_dim, eps, _ = shape
    x = _rms_norm(x, layer["input_layernorm.weight"], eps)
    b, s, _ = x.shape
    if "self_attn.qkv_proj.weight" in layer:
        q, k, v = _linear(x, layer, "self_attn.qkv_proj").split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    else:
        q, k, v = (_linear(x, layer, f"self_attn.{n}_proj") for n in "qkv")
    q = q.reshape(b, s, heads, head_dim)
    k = k.reshape(b, s, kv_heads, head_dim)
    v = v.reshape(b, s, kv_heads, head_dim)
    if "self_attn.q_norm.weight" in layer:  # Qwen3: RMSNorm over each head before rotary
        q = _rms_norm(q, layer["self_attn.q_norm.weight"], eps)
        k = _rms_norm(k, layer["self_attn.k_norm.weight"], eps)
    return q, k, v


def _pre_attention(layer: dict, x: torch.Tensor, cos, sin, shape: tuple):
    """:func:`_qkv` -> rotary.

    ``x (b s h)``, ``cos, sin (b s d)`` -> ``q (b H s d)``, ``k, v (b kvh s d)``. ``shape`` is
    ``(heads, kv_heads, head_dim, eps, activation)``: plain values, so one ``torch.compile`` of
    this function serves every layer and every engine of the same config."""
    q, k, v = _qkv(layer, x, shape)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = cos[:, None], sin[:, None]
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q, k, v


def _post_attention(layer: dict, x: torch.Tensor, attn: torch.Tensor, shape: tuple) -> torch.Tensor:
    """o projection + residual -> post-attention RMSNorm -> MLP (act(gate) * up -> down) + residual."""
    x, mlp_out = _layer_out(layer, x, attn, shape)
    return x + mlp_out


def _post_attention_tp(layer: dict, x: torch.Tensor, attn: torch.Tensor, shape: tuple, group) -> torch.Tensor:
    """Tensor-parallel :func:`_post_attention`: this rank holds a column slice of q/k/v/gate/up and
    the matching row slice of o/down, so the two row-parallel products are partial sums that an
    all-reduce over the TP group completes (Megatron-LM's layout, Shoeybi et al. 2019)."""
    x, mlp_out = _layer_out_tp(layer, x, attn, shape, group)
    return x + mlp_out


def _layer_in(layer: dict, x: torch.Tensor, delta: torch.Tensor | None, cos, sin, shape: tuple, k_cache, v_cache, slot):
    """Decode-step layer entry: ``x + delta`` (the previous layer's MLP output, deferred so the add
    fuses with this RMSNorm) -> :func:`_pre_attention` -> write ``k, v`` into the caches at ``slot``.

    Returns ``(x, q)``. Compiled, the cache writes fuse into the rotary kernel and land in the
    cache buffers in place (inductor re-inplaces the ``index_copy_`` on the graph input)."""
    if delta is not None:
        x = x + delta
    q, k, v = _pre_attention(layer, x, cos, sin, shape)
    k_cache.index_copy_(2, slot, k)
    v_cache.index_copy_(2, slot, v)
    return x, q


def _layer_qkv(layer: dict, x: torch.Tensor, delta: torch.Tensor | None, shape: tuple):
    """Decode-step layer entry for the Triton attention kernel, which applies rotary and writes
    the cache itself: ``x + delta`` -> :func:`_qkv`. Returns ``(x, q, k, v)``; for Llama/Qwen2
    the three are views of the one q|k|v product (no kernel between the matmul and attention)."""
    if delta is not None:
        x = x + delta
    return (x, *_qkv(layer, x, shape))


def _mlp(layer: dict, x: torch.Tensor, shape: tuple) -> torch.Tensor:
    """post-attention RMSNorm -> act(gate) * up -> down (no residual). Under tensor parallelism the
    result is this rank's partial sum (row-parallel down projection)."""
    from transformers.activations import ACT2FN

    eps, activation = shape[3], shape[4]
    h = _rms_norm(x, layer["post_attention_layernorm.weight"], eps)
    if "mlp.gate_up_proj.weight" in layer:
        gate, up = _linear(h, layer, "mlp.gate_up_proj").chunk(2, dim=-1)
    else:
        gate, up = _linear(h, layer, "mlp.gate_proj"), _linear(h, layer, "mlp.up_proj")
    act = F.silu(gate) if activation == "silu" else ACT2FN[activation](gate)
    return _linear(act * up, layer, "mlp.down_proj")


def _layer_mlp(layer: dict, x: torch.Tensor, attn_out: torch.Tensor, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + attn_out`` (the o projection's output) -> :func:`_mlp`; returns ``(x, mlp_out)``.
    The tensor-parallel decode step calls it after the o projection's all-reduce, so there
    ``mlp_out`` is this rank's partial sum."""
    x = x + attn_out
    return x, _mlp(layer, x, shape)


def _layer_out(layer: dict, x: torch.Tensor, attn: torch.Tensor, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_post_attention` without its last residual add: returns ``(x, mlp_out)``; the next
    :func:`_layer_in` (or the final norm) adds them."""
    return _layer_mlp(layer, x, _linear(attn, layer, "self_attn.o_proj"), shape)


def _layer_out_tp(layer: dict, x: torch.Tensor, attn: torch.Tensor, shape: tuple, group, layer_mlp=None):
    """Tensor-parallel :func:`_layer_out`: o projection -> all-reduce -> ``layer_mlp`` (default
    :func:`_layer_mlp`; the decode step passes its compiled copy) -> all-reduce of the MLP's partial
    sum. Returns ``(x, mlp_out)``; the collectives stay outside compiled code."""
    import torch.distributed as dist

    out = _linear(attn, layer, "self_attn.o_proj")
    dist.all_reduce(out, group=group)
    x, mlp_out = (layer_mlp or _layer_mlp)(layer, x, out, shape)
    dist.all_reduce(mlp_out, group=group)
    return x, mlp_out


def _final_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x + delta, weight, eps)


#: decode steps through :func:`_layer_in` / :func:`_layer_out` (cache writes and residual adds
#: inside the compiled kernels) rather than the two compiled halves of each layer plus separate
#: cache copies; a module flag so benchmarks can time both
FUSE_DECODE_EPILOGUES = True
#: with the Triton decode attention, compiled decode steps leave rotary and the cache writes to
#: the attention kernel (:func:`decode_attention`) instead of inductor's kernels; a module flag
#: so benchmarks can time both
FUSE_ROTARY_ATTENTION = True
#: CPU, eager decode with stop tokens: once at most this fraction of the rows being decoded is
#: still unfinished, the finished ones are dropped from the step (the others' caches copied once),
#: so later steps compute only the rows still decoding. 0 turns it off. On one thread a step's
#: cost grows with its rows (32 rows of the CPU benchmark's rollout took 69% of the time of 64, and
#: dropping rows took the rollout to 0.875x); on two it depends little on them (0.98x). Graphs
#: (CUDA) and compiled steps keep their fixed shapes.
COMPACT_FINISHED_ROWS = 0.875

#: the functions :func:`_compiled_layer_pieces` compiles, in the order of ``TorchEngine._compiled``
_DECODE_PIECES = (_pre_attention, _post_attention, _layer_in, _layer_out, _final_norm, _layer_qkv, _layer_mlp)
_COMPILED: tuple | None = None


def _compiled_layer_pieces() -> tuple:
    """``(pre, post, layer_in, layer_out, final_norm, layer_qkv, layer_mlp)`` compiled once per process. The weights are
    inputs, so one graph serves every layer of every engine of the same config; shapes start
    static and the first new shape (another batch size or cache length) recompiles them as
    dynamic, so a process never runs into dynamo's recompile limit and silently goes eager."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = tuple(torch.compile(fn, dynamic=None) for fn in _DECODE_PIECES)
    return _COMPILED


# ---------------------------------------------------------------------------------------------
# Fused sampling kernels (Triton, CUDA only; built on first use so CPU never imports Triton)

@lazy_kernels
def _triton_kernels() -> dict[str, Any]:
    """The Triton kernels (sampler partial/combine, decode attention); None when Triton is not importable."""
    global libdevice, _log2  # module globals: the kernels (and Triton's interpreter) look them up there
    libdevice = _libdevice()

    @triton.jit
    def _log2(x, FAST: tl.constexpr):
        if FAST:  # the hardware's lg2.approx (see _libdevice)
            y = libdevice.fast_log2f(x)
        else:
            y = tl.log2(x)
        return y

    @triton.jit
    def partial_kernel(
        logits_ptr, row_stride, vocab, split_size, seed_ptr, step_ptr, n_rows, scale,
        out_m, out_s, out_score, out_idx, out_z, n_splits,
        GREEDY: tl.constexpr, QUARTER: tl.constexpr, FAST_LOG: tl.constexpr,
    ):
        # program (row, split): log-sum-exp and Gumbel-max argmax over vocab[start:start + split_size]
        # of one row, in base 2 (y = z log2(e) / T, so exp2/log2 map to the hardware's ex2/lg2).
        # Each iteration reads 4 x QUARTER columns. All state is per lane (running max, sum,
        # best key): no block-wide reduction until the end. One Philox call (tl.rand4x) gives
        # the noise of 4 columns.
        row = tl.program_id(0)
        split = tl.program_id(1)
        scale = tl.cast(scale, tl.float32)  # a Python float arrives as float64 from a torch.compile'd caller
        start = split * split_size  # a multiple of 4 * QUARTER
        base = logits_ptr + row.to(tl.int64) * row_stride
        seed = tl.load(seed_ptr) + tl.load(step_ptr) * n_rows + row
        lanes = tl.arange(0, QUARTER)
        run_max = tl.full([QUARTER], float("-inf"), tl.float32)
        sums = tl.zeros([QUARTER], tl.float32)
        best = tl.full([QUARTER], float("-inf"), tl.float32)
        best_idx = tl.full([QUARTER], -1, tl.int32)
        best_y = tl.zeros([QUARTER], tl.float32)
        for off in range(0, split_size, 4 * QUARTER):
            c0 = start + off + lanes
            c1 = c0 + QUARTER
            c2 = c1 + QUARTER
            c3 = c2 + QUARTER
            y0 = tl.load(base + c0, mask=c0 < vocab, other=float("-inf")).to(tl.float32) * scale
            y1 = tl.load(base + c1, mask=c1 < vocab, other=float("-inf")).to(tl.float32) * scale
            y2 = tl.load(base + c2, mask=c2 < vocab, other=float("-inf")).to(tl.float32) * scale
            y3 = tl.load(base + c3, mask=c3 < vocab, other=float("-inf")).to(tl.float32) * scale
            new_max = tl.maximum(run_max, tl.maximum(tl.maximum(y0, y1), tl.maximum(y2, y3)))
            ref = tl.where(new_max == float("-inf"), 0.0, new_max)  # lanes with no valid column yet
            sums = sums * tl.exp2(run_max - ref) + (
                tl.exp2(y0 - ref) + tl.exp2(y1 - ref) + tl.exp2(y2 - ref) + tl.exp2(y3 - ref)
            )
            run_max = new_max
            if GREEDY:
                s0, s1, s2, s3 = y0, y1, y2, y3
            else:
                # exponential race: argmax(y - log2 E), E = -ln U ~ Exp(1); log2 E = log2(-log2 U)
                # + log2(ln 2), a constant dropped from every key. Column c = start + off + j *
                # QUARTER + lane takes output j of Philox counter (start + off) / 4 + lane.
                u0, u1, u2, u3 = tl.rand4x(seed, (start + off) // 4 + lanes)
                s0 = y0 - _log2(-_log2(u0, FAST_LOG), FAST_LOG)
                s1 = y1 - _log2(-_log2(u1, FAST_LOG), FAST_LOG)
                s2 = y2 - _log2(-_log2(u2, FAST_LOG), FAST_LOG)
                s3 = y3 - _log2(-_log2(u3, FAST_LOG), FAST_LOG)
            # columns in increasing order, strict '>': each lane keeps its lowest index among ties
            take = s0 > best
            best, best_idx, best_y = tl.where(take, s0, best), tl.where(take, c0, best_idx), tl.where(take, y0, best_y)
            take = s1 > best
            best, best_idx, best_y = tl.where(take, s1, best), tl.where(take, c1, best_idx), tl.where(take, y1, best_y)
            take = s2 > best
            best, best_idx, best_y = tl.where(take, s2, best), tl.where(take, c2, best_idx), tl.where(take, y2, best_y)
            take = s3 > best
            best, best_idx, best_y = tl.where(take, s3, best), tl.where(take, c3, best_idx), tl.where(take, y3, best_y)
        m = tl.max(run_max, 0)  # finite: every split holds a valid column
        top = tl.max(best, 0)
        idx = tl.min(tl.where(best == top, best_idx, 2147483647), 0)  # ties: the lowest column
        y = tl.sum(tl.where(best_idx == idx, best_y, 0.0), 0)
        o = row * n_splits + split
        tl.store(out_m + o, m)
        tl.store(out_s + o, tl.sum(sums * tl.exp2(run_max - m), 0))
        tl.store(out_score + o, top)
        tl.store(out_idx + o, idx)
        tl.store(out_z + o, y)

    @triton.jit
    def combine_kernel(out_m, out_s, out_score, out_idx, out_z, n_splits, tokens_ptr, logprobs_ptr, SPLITS: tl.constexpr):
        row = tl.program_id(0)
        k = tl.arange(0, SPLITS)
        valid = k < n_splits
        o = row * n_splits + k
        m = tl.load(out_m + o, mask=valid, other=float("-inf"))
        s = tl.load(out_s + o, mask=valid, other=0.0)
        top = tl.max(m, 0)
        total = tl.sum(tl.where(valid, s * tl.exp2(m - top), 0.0), 0)
        score = tl.load(out_score + o, mask=valid, other=float("-inf"))
        arg = tl.argmax(score, 0)  # first maximum: ties go to the lowest vocabulary index
        idx = tl.sum(tl.where(k == arg, tl.load(out_idx + o, mask=valid, other=0), 0), 0)
        y = tl.sum(tl.where(k == arg, tl.load(out_z + o, mask=valid, other=0.0), 0.0), 0)
        tl.store(tokens_ptr + row, idx.to(tl.int64))
        tl.store(logprobs_ptr + row, (y - top - tl.log2(total)) * 0.6931471805599453)

    @triton.jit
    def decode_attention_kernel(
        q_ptr, kn_ptr, vn_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, valid_ptr, slot_ptr, out_ptr, scale,
        q_sb, q_sh, q_sg, kn_sb, kn_sh, vn_sb, vn_sh, cs_sb, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, valid_sb, o_sb, o_sh, o_sg,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, ROTARY: tl.constexpr,
    ):
        # program (row, kv head): rotary on the new token's G query heads and key, the new key and
        # value written into the cache at `slot`, then flash attention (one query token, online
        # softmax over BLOCK_N slots at a time) over the valid slots before `slot`, and last over
        # the new token itself, from registers
        b = tl.program_id(0)
        h = tl.program_id(1)
        scale = tl.cast(scale, tl.float32)  # a Python float arrives as float64 from a torch.compile'd caller
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        rows = g[:, None] < G
        q_rows = q_ptr + b * q_sb + h * q_sh + g[:, None] * q_sg
        kn_row = kn_ptr + b * kn_sb + h * kn_sh
        q = tl.load(q_rows + d[None, :], mask=rows, other=0.0).to(tl.float32)
        kn = tl.load(kn_row + d).to(tl.float32)
        if ROTARY:  # x cos + rotate_half(x) sin, rotate_half(x) = (-x[D/2:], x[:D/2])
            partner = (d + D // 2) % D
            sign = tl.where(d < D // 2, -1.0, 1.0)
            c = tl.load(cos_ptr + b * cs_sb + d).to(tl.float32)
            s = tl.load(sin_ptr + b * cs_sb + d).to(tl.float32) * sign
            q = q * c[None, :] + tl.load(q_rows + partner[None, :], mask=rows, other=0.0).to(tl.float32) * s[None, :]
            kn = kn * c + tl.load(kn_row + partner).to(tl.float32) * s
        slot = tl.load(slot_ptr)
        kn = kn.to(k_ptr.dtype.element_ty)
        vn = tl.load(vn_ptr + b * vn_sb + h * vn_sh + d).to(v_ptr.dtype.element_ty)
        k_base = k_ptr + b.to(tl.int64) * k_sb + h * k_sh
        v_base = v_ptr + b.to(tl.int64) * v_sb + h * v_sh
        tl.store(k_base + slot * k_ss + d, kn)
        tl.store(v_base + slot * v_ss + d, vn)
        q = q.to(k_ptr.dtype.element_ty)
        m = tl.full([GP], float("-inf"), tl.float32)
        den = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for start in range(0, slot, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            inside = n < slot
            valid = tl.load(valid_ptr + b * valid_sb + n, mask=inside, other=0) != 0
            k = tl.load(k_base + n[:, None] * k_ss + d[None, :], mask=inside[:, None], other=0.0)
            if IEEE:  # float32 caches: full-precision products (tl.dot would round to TF32)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale  # (GP BLOCK_N) float32 accumulation
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no valid slot yet
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            den = den * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * v_ss + d[None, :], mask=inside[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        # the new token: always attended (a row's first decode step may see nothing else)
        own = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * scale
        m_new = tl.maximum(m, own)
        p = tl.exp(own - m_new)
        alpha = tl.exp(m - m_new)
        den = den * alpha + p
        acc = acc * alpha[:, None] + p.to(vn.dtype).to(tl.float32)[:, None] * vn.to(tl.float32)[None, :]
        out = acc / den[:, None]
        tl.store(out_ptr + b * o_sb + h * o_sh + g[:, None] * o_sg + d[None, :], out.to(out_ptr.dtype.element_ty), mask=rows)

    return {"partial": partial_kernel, "combine": combine_kernel, "decode_attention": decode_attention_kernel}


def _libdevice():
    """libdevice, whose ``fast_log2f`` (the hardware's ``lg2.approx``, relative error about 2^-22)
    the sampler uses; None under Triton's interpreter, which has no libdevice, or where it is
    missing (then ``tl.log2``). ``tl.log`` compiles to libdevice's exact ``logf``, two dozen
    instructions; the sampler takes two logs per vocabulary column per step, so this is most of
    its arithmetic."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None
    try:
        from triton.language.extra import libdevice

        return libdevice if hasattr(libdevice, "fast_log2f") else None
    except ImportError:
        return None


def decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_valid: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token's GQA attention layer step, as one Triton kernel.

    ``q (b kvh g d)`` (the ``g`` query heads of each kv head), ``k_new, v_new (b kvh d)`` the new
    token's key and value, caches ``(b kvh S d)``, ``key_valid (b S)`` bool, ``slot (1)`` long
    (a device tensor: CUDA graphs replay it). With ``cos, sin (b d)`` the rotary embedding is
    applied to ``q`` and ``k_new`` first (transformers' ``rotate_half`` convention); without,
    they are taken as rotated. Writes the new key and value into the caches at ``slot``, then
    attends over the valid slots before ``slot`` and the new token. Returns ``(b kvh g d)``.

    Equals writing the cache and ``F.scaled_dot_product_attention(q, k[:, :, :slot + 1],
    v[:, :, :slot + 1], attn_mask)`` (float32 softmax, probabilities rounded to the cache dtype
    for the value product, as flash attention does). At decode sizes SDPA's kernels are
    latency-bound (tiles sized for long queries); this kernel reads each row's cache once with
    ``g`` query rows, and folds the rotary and cache-write kernels of each layer into it."""
    kernels = _triton_kernels()
    b, kvh, g, d = q.shape
    if any(t.stride(-1) != 1 for t in (q, k_new, v_new, k_cache, v_cache)):
        raise ValueError("decode_attention needs the head dimension contiguous")
    rotary = cos is not None
    if rotary and (cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        raise ValueError("decode_attention needs cos and sin (b d) with the same strides, last one 1")
    cos = cos if rotary else q
    sin = sin if rotary else q
    out = torch.empty((b, kvh, g, d), dtype=q.dtype, device=q.device)
    args = (
        q, k_new, v_new, cos, sin, k_cache, v_cache, key_valid, slot, out, scale,
        q.stride(0), q.stride(1), q.stride(2), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), key_valid.stride(0), out.stride(0), out.stride(1), out.stride(2),
    )
    shape = dict(G=g, GP=max(16, triton.next_power_of_2(g)), D=d, IEEE=k_cache.dtype == torch.float32, ROTARY=rotary)
    kernels["decode_attention"][(b, kvh)](*args, **shape, BLOCK_N=64, num_warps=4)
    return out


@dataclass
class _Sampler:
    """Buffers of the fused sampler for ``b`` rows (fixed addresses: CUDA graphs read them)."""

    seed: torch.Tensor  # (1) long
    n_splits: int
    split_size: int
    partial: list[torch.Tensor]  # m, s, score (f32), idx (i32), z (f32), each (b n_splits)
    tokens: torch.Tensor  # (b) long
    logprobs: torch.Tensor  # (b) f32
    #: rows of the whole batch under ``generate(rows=(start, total))`` (0: this call's b); the
    #: call's ``start`` is added to ``seed``, so row r's noise is keyed as the whole batch's row start + r
    total_rows: int = 0


def fused_sample(logits: torch.Tensor, sampler: _Sampler, step: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``(b)`` and their log-probs under ``softmax(logits / T)`` (greedy when ``T == 0``).

    ``logits (b v)`` in any float dtype, read once. The noise of row ``r`` at decode step ``s``
    is Philox keyed by ``seed + s * b + r`` (``b``: ``sampler.total_rows`` when set, the rows of
    the whole batch this call samples a share of, its offset already in ``seed``); vocabulary column ``c`` takes output ``(c // Q) % 4``
    of counter ``(c // 4Q) * Q + c % Q`` (``Q = _SAMPLER_BLOCK / 4``), so the draw does not depend
    on how the vocabulary is split across programs.
    """
    kernels = _triton_kernels()
    b, vocab = logits.shape
    greedy = temperature == 0
    m, s, score, idx, z = sampler.partial
    args = (logits, logits.stride(0), vocab, sampler.split_size, sampler.seed, step, sampler.total_rows or b,
            _LOG2E if greedy else _LOG2E / temperature, m, s, score, idx, z, sampler.n_splits)
    kernels["partial"][(b, sampler.n_splits)](
        *args, GREEDY=greedy, QUARTER=_SAMPLER_BLOCK // 4, FAST_LOG=libdevice is not None, num_warps=8
    )
    kernels["combine"][(b,)](
        m, s, score, idx, z, sampler.n_splits, sampler.tokens, sampler.logprobs,
        SPLITS=max(2, triton.next_power_of_2(sampler.n_splits)), num_warps=1,
    )
    return sampler.tokens, sampler.logprobs


_LOG2E = 1.4426950408889634

#: vocabulary columns one sampler program reads per iteration (4 quarters)
_SAMPLER_BLOCK = 2048


def _make_sampler(b: int, vocab: int, device: torch.device) -> _Sampler:
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    block = _SAMPLER_BLOCK
    wanted = max(1, min(64, math.ceil(8 * sms / b)))  # several programs per SM: latency hiding
    split_size = math.ceil(math.ceil(vocab / wanted) / block) * block
    n_splits = math.ceil(vocab / split_size)
    f32 = dict(dtype=torch.float32, device=device)
    return _Sampler(
        seed=torch.zeros(1, dtype=torch.long, device=device),
        n_splits=n_splits,
        split_size=split_size,
        partial=[torch.empty(b, n_splits, **f32) for _ in range(3)]
        + [torch.empty(b, n_splits, dtype=torch.int32, device=device), torch.empty(b, n_splits, **f32)],
        tokens=torch.zeros(b, dtype=torch.long, device=device),
        logprobs=torch.zeros(b, **f32),
    )


def _checked_rows(rows, b: int) -> tuple[int, int] | None:
    """``generate``'s ``rows=(start, total)`` for a call of ``b`` rows, checked (None: the whole batch)."""
    given = rows
    if rows is None:
        return None
    import operator

    try:  # ints of any kind: Python, numpy, 0-d integer tensors (not bools, not floats)
        rows = tuple(operator.index(v) for v in rows if not isinstance(v, bool))
    except TypeError:
        rows = ()
    if not (len(rows) == 2 and 0 <= rows[0] and rows[0] + b <= rows[1]):
        raise ValueError(f"TorchEngine.generate: rows must be (start, total) with 0 <= start and start + {b} <= total "
                         f"(this call's {b} rows are rows start..start+{b - 1} of a batch of total rows), got {given!r}")
    return rows if rows[1] != b else None


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
    cos: torch.Tensor | None = None  # (S d) rotary table this state's graphs read
    sin: torch.Tensor | None = None
    # the output rows this state's rows write (None: row i writes row i); set on the compacted
    # states of :meth:`TorchEngine._compact`, which keep only the rows still decoding
    rows: torch.Tensor | None = None


def _compile_by_default(on_cuda: bool, weights: Mapping[str, torch.Tensor]) -> bool:
    """``compile_decode=None``: compile on CUDA for models of at least
    :data:`rlkit.models.compile.AUTO_MIN_PARAMS` parameters (tied weights counted once). Every rank
    of a TP group holds shards of the same sizes, so all of them decide alike."""
    from rlkit.models.compile import large_enough

    return on_cuda and large_enough(weights.values())


@dataclass
class _Plan:
    """A decode state kept between ``generate`` calls of the same shape, with its CUDA graphs."""

    key: tuple
    state: _DecodeState
    sampler: _Sampler | None
    graphs: dict[int, Any] = field(default_factory=dict)  # cache length -> torch.cuda.CUDAGraph
    warmed: set = field(default_factory=set)
    pool: Any = None
    graph_failed: bool = False
    compiled: bool = False  # decode through the engine's torch.compile'd layer pieces


class TorchEngine:
    """Batched sampling for Llama / Qwen2 / Qwen3 decoders (see the module docstring).

    Implements :class:`rlkit.engines.base.Engine`. Build with :meth:`from_model` (shares the
    model's parameter storage) or ``TorchEngine(config, weights)`` (weights: HF names -> tensors;
    the engine uses the given tensors as they are). Runs on the device of the weights.

    ``cuda_graphs``, ``fuse`` and ``fused_sampling`` default to True on CUDA and False on CPU
    (see the module docstring); ``cache_bucket`` is the cache-length granularity of the graphs,
    and ``prompt_bucket`` (default ``cache_bucket``) the prompt-width granularity of the kept
    graphs and cache (1: pad only to the longest prompt).

    ``generate(..., rows=(start, total))`` samples rows ``[start, start + b)`` of a batch of
    ``total`` rows: the sampling noise is what one call over the whole batch would draw for them
    from the same generator state, so prompts split over several generation replicas, each with
    the same generator, sample what one process samples (:attr:`samples_batch_rows`). The cost:
    the torch sampler (CPU, top-k/top-p) draws the noise of all ``total`` rows at every step, N
    times one share's on N replicas; the fused GPU sampler keys each row's counter-based noise by
    its row in the whole batch and draws nothing more.
    """

    #: ``generate`` takes ``rows=(start, total)`` (read by :func:`rlkit.rollout` to split a batch
    #: over replicas without changing what each row samples)
    samples_batch_rows = True
    _rows: tuple[int, int] | None = None  # the current generate call's rows, see _noise
    #: the keys of load_weights' report (a rollout that moves no weights logs them as zeros)
    sync_keys = ("bytes", "seconds", "fused_bytes")

    def __init__(
        self,
        config,
        weights: Mapping[str, torch.Tensor],
        *,
        rotary: nn.Module | None = None,
        pad_token_id: int | None = None,
        sync_every: int = 8,
        cuda_graphs: bool | None = None,
        fuse: bool | None = None,
        fused_sampling: bool | None = None,
        cache_bucket: int = 64,
        prompt_bucket: int | None = None,
        compile_decode: bool | str | None = None,
        decode_attention: str | None = None,
        tp_group=None,
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
        if cache_bucket < 1:
            raise ValueError(f"cache_bucket must be >= 1, got {cache_bucket}")
        if prompt_bucket is not None and prompt_bucket < 1:
            raise ValueError(f"prompt_bucket must be >= 1 (or None for cache_bucket), got {prompt_bucket}")
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
        self.tp_group = tp_group
        self.tp_size = 1
        if tp_group is not None:
            import torch.distributed as dist

            self.tp_size = dist.get_world_size(tp_group)
        if self.tp_size > 1:
            # weights are this rank's tensor-parallel shards: heads split evenly across the group
            if self.num_heads % self.tp_size or self.num_kv_heads % self.tp_size:
                raise ValueError(
                    f"tensor parallelism {self.tp_size} must divide the attention heads ({self.num_heads}) and the "
                    f"key/value heads ({self.num_kv_heads}) of this model"
                )
            if any(f"model.layers.0.{n}.bias" in self.weights for n in ("self_attn.o_proj", "mlp.down_proj")):
                raise ValueError("tensor-parallel generation does not support biases on o_proj/down_proj")
            self.num_heads //= self.tp_size
            self.num_kv_heads //= self.tp_size
            # fusion, compiled pieces and CUDA graphs work on this rank's shards as they do on full
            # weights: q|k|v and gate|up concatenate the local column slices, the all-reduces run
            # between the compiled pieces, and NCCL collectives are captured in the decode graphs
        self._shape = (self.num_heads, self.num_kv_heads, self.head_dim, float(self.eps), str(config.hidden_act))
        self.layers = []
        for i in range(self.num_layers):
            prefix = f"model.layers.{i}."
            layer = {k[len(prefix) :]: v for k, v in self.weights.items() if k.startswith(prefix)}
            if "self_attn.q_proj.weight" not in layer:
                raise ValueError(f"weights have no {prefix}self_attn.q_proj.weight (config has {self.num_layers} layers)")
            self.layers.append(layer)
        self.rotary = rotary if rotary is not None else self._build_rotary(config)
        self.pad_token_id = self._pick_pad(config, pad_token_id, embed.shape[0])
        self.sync_every = sync_every
        self.policy_version = 0
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cos_sin_regime: bool | None = None  # longrope: whether the cached table holds the long factors
        on_cuda = self.device.type == "cuda"
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs) and on_cuda
        self.fused_sampling = (on_cuda if fused_sampling is None else bool(fused_sampling)) and on_cuda
        if self.fused_sampling and _triton_kernels() is None:
            self.fused_sampling = False
        self.cache_bucket = cache_bucket
        self.prompt_bucket = cache_bucket if prompt_bucket is None else prompt_bucket
        if decode_attention not in (None, "sdpa", "triton"):
            raise ValueError(f"decode_attention must be None, 'sdpa' or 'triton', got {decode_attention!r}")
        if decode_attention is None:
            decode_attention = "triton" if on_cuda and self.head_dim in (16, 32, 64, 128, 256) and _triton_kernels() is not None else "sdpa"
        elif decode_attention == "triton" and _triton_kernels() is None:
            raise ValueError("decode_attention='triton' needs Triton (pip install triton); use 'sdpa'")
        self.decode_attention = decode_attention
        self._compiled = None
        self._whole_step = None
        self.compile_error: str | None = None
        if compile_decode not in (None, True, False, "pieces", "step"):
            raise ValueError(f"compile_decode must be None, True, False, 'pieces' or 'step', got {compile_decode!r}")
        if compile_decode is None:
            compile_decode = _compile_by_default(on_cuda, self.weights)
        if compile_decode is True:
            # CUDA graphs already remove the per-operator host cost, so pieces; on CPU the step
            if on_cuda or self.tp_size > 1:
                compile_decode = "pieces"
            else:
                compile_decode = "step"
        if compile_decode == "step" and self.tp_size > 1:
            raise ValueError("compile_decode='step' does not support tensor parallelism (the all-reduces stay outside "
                             "compiled code); use compile_decode='pieces'")
        self.compile_mode = compile_decode or None
        if compile_decode == "pieces":
            # elementwise work between the matmuls (RMSNorm in float32, rotary, SiLU, residuals) is
            # dozens of tiny kernels per layer; at decode batch sizes their launch latency, not
            # bandwidth, sets the step time, and inductor fuses them into a few
            self._compiled = _compiled_layer_pieces()
        elif compile_decode == "step":
            from rlkit.models.compile import RECOMPILE_LIMIT, _raise_recompile_limit

            # one code object for every engine: each engine and each bucket length is a variant
            _raise_recompile_limit(RECOMPILE_LIMIT)
            self._whole_step = torch.compile(self._decode_step_impl, dynamic=None)
        self._plan: _Plan | None = None
        self._fused: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        if on_cuda if fuse is None else fuse:
            self._build_fused()

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
    def _pick_pad(config, pad_token_id: int | None, vocab: int | None = None) -> int:
        """:func:`rlkit.engines.base.pick_pad_token_id` over the embedding's ``vocab`` rows: a
        config pad outside them (e.g. -1) is skipped, a ``pad_token_id`` argument outside them refused."""
        return pick_pad_token_id(config, pad_token_id, vocab)

    @property
    def fused(self) -> bool:
        """True when q/k/v and gate/up run from concatenated copies of the weights."""
        return bool(self._fused)

    def _build_fused(self) -> None:
        """Allocate the concatenated q|k|v and gate|up weights (and biases) and fill them."""
        groups = {
            "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        }
        for layer in self.layers:
            for fused_name, parts in groups.items():
                for suffix in (".weight", ".bias"):
                    srcs = [layer.get(p + suffix) for p in parts]
                    if any(s is None for s in srcs):
                        continue
                    dst = torch.empty((sum(s.shape[0] for s in srcs), *srcs[0].shape[1:]), dtype=srcs[0].dtype, device=srcs[0].device)
                    layer[fused_name + suffix] = dst
                    self._fused.append((dst, srcs))
        self._refresh_fused()

    @torch.no_grad()
    def _refresh_fused(self) -> int:
        """Re-concatenate the fused weights from their sources; returns the bytes written."""
        written = 0
        for dst, srcs in self._fused:
            torch.cat(srcs, dim=0, out=dst)
            written += dst.numel() * dst.element_size()
        return written

    def release(self) -> None:
        """Free the kept KV cache and CUDA graphs (they are rebuilt by the next ``generate``)."""
        self._plan = None

    @torch.no_grad()
    def load_weights(
        self, weights: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]], *, version: int
    ) -> dict[str, float]:
        """Copy new weights (HF names) into the engine's tensors; tensors already shared are skipped.

        Accepts DTensors (gathered with ``full_tensor()``). Fused weights are re-concatenated.
        Returns ``{"bytes", "seconds", "fused_bytes"}`` (``bytes`` counts the copies from
        ``weights``, ``fused_bytes`` the re-concatenation).
        """
        start = time.perf_counter()
        copied = 0
        written: set[int] = set()  # tied weights (embed / lm_head) arrive twice: copy once
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
            if dst.data_ptr() in written:
                continue
            written.add(dst.data_ptr())
            dst.copy_(tensor)
            copied += dst.numel() * dst.element_size()
        fused_bytes = self._refresh_fused() if self._fused else 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.policy_version = int(version)
        return {"bytes": float(copied), "seconds": time.perf_counter() - start, "fused_bytes": float(fused_bytes)}

    # ------------------------------------------------------------------ model math
    def _longrope_limit(self) -> int | None:
        """``original_max_position_embeddings`` of a "longrope" rotary (None for any other type):
        transformers' longrope rotates every position with its short factors while a sequence
        has at most that many tokens and with its long factors otherwise
        (``modeling_rope_utils.dynamic_rope_update``)."""
        if getattr(self.rotary, "rope_type", None) != "longrope":
            return None
        config = getattr(self.rotary, "config", None) or self.config
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        limit = params.get("original_max_position_embeddings") if isinstance(params, Mapping) else None
        limit = limit or getattr(config, "original_max_position_embeddings", None)
        return int(limit) if limit else None

    def _rope_regime(self, length: int) -> bool | None:
        """For a longrope rotary, whether a sequence of ``length`` tokens takes the long factors
        (None for other rotaries: their values at a position do not depend on ``length`` here)."""
        limit = self._longrope_limit()
        return None if limit is None else length > limit

    def _rope_table(self, length: int, longest: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (length d, or more rows) for positions 0..length-1, from the model's rotary
        module, as the model computes them for a sequence of ``longest`` tokens (default
        ``length``; the rollout's longest prompt plus ``max_new_tokens``): a longrope rotary
        takes its short factors for every position while ``longest`` is within
        ``original_max_position_embeddings`` and its long ones otherwise (``modeling_rope_utils``).
        In the short regime the table stops at that limit: no row reads a position past ``longest``."""
        context = getattr(self.config, "max_position_embeddings", None) or 256
        limit = self._longrope_limit()
        regime = self._rope_regime(length if longest is None else longest)
        if regime is False:
            length = min(length, limit)
        # a cached table is reused only within the longrope regime it was built for
        if self._cos_sin is None or self._cos_sin[0].shape[0] < length or self._cos_sin_regime != regime:
            rotary = self.rotary.to(self.device)
            # rounded up to 256 positions for reuse, but never past the model's context: a dynamic
            # rotary (rope_scaling "dynamic") rescales its frequencies for a longer sequence, and
            # every position of a model with a context under 256 got the wrong rotation; nor, in
            # longrope's short regime, past its original context (a longer table takes the long
            # factors for every position: log-probs up to 1.5 off the model's)
            cap = min(context, limit) if regime is False else context
            positions = torch.arange(max(length, min(256, cap)), device=self.device)[None]
            dummy = torch.empty(0, device=self.device, dtype=self.dtype)
            cos, sin = rotary(dummy, positions)
            self._cos_sin = (cos[0], sin[0])
            self._cos_sin_regime = regime
        return self._cos_sin

    def _pre_attention(self, layer: dict, x: torch.Tensor, cos, sin):
        return _pre_attention(layer, x, cos, sin, self._shape)

    def _post_attention(self, layer: dict, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            return _post_attention_tp(layer, x, attn, self._shape, self.tp_group)
        return _post_attention(layer, x, attn, self._shape)

    def _forward(self, ids: torch.Tensor, cos, sin, attend, compiled: bool = False) -> torch.Tensor:
        """Decoder over ``ids (b s)`` -> final-normed hidden ``(b s h)``.

        ``attend(i, q, k, v) -> (b s H*d)`` stores layer ``i``'s new keys/values in the cache
        and attends over it. ``compiled``: run the per-layer pieces through ``torch.compile``
        (one compiled graph serves every layer: the weights are its inputs)."""
        pre, post = self._pre_attention, self._post_attention
        if compiled and self._compiled is not None:
            shape = self._shape
            pre = lambda layer, x, cos, sin: self._compiled[0](layer, x, cos, sin, shape)  # noqa: E731
            if self.tp_size == 1:  # the tensor-parallel half keeps its all-reduces outside compiled code
                post = lambda layer, x, attn: self._compiled[1](layer, x, attn, shape)  # noqa: E731
        x = F.embedding(ids, self.weights["model.embed_tokens.weight"])
        for i, layer in enumerate(self.layers):
            q, k, v = pre(layer, x, cos, sin)
            x = post(layer, x, attend(i, q, k, v))
        return _rms_norm(x, self.weights["model.norm.weight"], self.eps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weights["lm_head.weight"]).float()

    # ------------------------------------------------------------------ sampling
    def _noise(self, shape, generator: torch.Generator | None) -> torch.Tensor:
        """``Exp(1)`` draws for this call's ``shape[0]`` rows. Under ``generate(rows=(start, total))``
        the draws are those of the whole batch of ``total`` rows, of which this call keeps its own:
        row ``start + i`` gets what one call over the whole batch would give it."""
        start, total = self._rows if self._rows is not None else (0, shape[0])
        full = (total, *shape[1:])
        if generator is None or generator.device == self.device:
            noise = torch.empty(full, device=self.device).exponential_(generator=generator)
        else:
            noise = torch.empty(full, device=generator.device).exponential_(generator=generator).to(self.device)
        return noise if total == shape[0] else noise[start : start + shape[0]]

    def _sample(self, logits: torch.Tensor, params: SamplingParams, generator, noise=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(b v) f32 logits -> sampled tokens (b) and their log-probs under the processed distribution
        (``noise``: ``Exp(1)`` draws of the logits' shape, else drawn from ``generator``)."""
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
        if noise is None:
            noise = self._noise(logp.shape, generator)
        tokens = (logp - noise.log()).argmax(-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    def _uses_fused_sampler(self, params: SamplingParams) -> bool:
        vocab = self.weights["lm_head.weight"].shape[0]
        plain = params.temperature == 0 or ((params.top_k <= 0 or params.top_k >= vocab) and params.top_p >= 1.0)
        return self.fused_sampling and plain

    def _sample_logits(self, hidden_last: torch.Tensor, params, generator, plan: _Plan, noise=None) -> tuple[torch.Tensor, torch.Tensor]:
        if plan.sampler is not None:
            logits = F.linear(hidden_last, self.weights["lm_head.weight"])
            return fused_sample(logits, plan.sampler, plan.state.step, params.temperature)
        return self._sample(self._logits(hidden_last), params, generator, noise)

    def _record(self, state: _DecodeState, tokens: torch.Tensor, logprobs: torch.Tensor, params: SamplingParams) -> None:
        """Write the sampled tokens at ``state.step`` (finished rows get pad, mask False, log-prob 0)."""
        alive = ~state.finished
        tokens = torch.where(alive, tokens, torch.full_like(tokens, state.pad_id))
        logprobs = torch.where(alive, logprobs, torch.zeros_like(logprobs))
        if state.rows is None:
            index = state.step.view(1)
            state.out_tokens.index_copy_(1, index, tokens[:, None])
            state.out_mask.index_copy_(1, index, alive[:, None])
            state.out_logprobs.index_copy_(1, index, logprobs[:, None])
        else:  # a compacted state (CPU): its rows write their own output rows
            state.out_tokens[state.rows, state.step] = tokens
            state.out_mask[state.rows, state.step] = alive
            state.out_logprobs[state.rows, state.step] = logprobs
        if not params.ignore_stop and state.stop_ids.numel():
            state.finished |= torch.isin(tokens, state.stop_ids) & alive
        state.tokens.copy_(tokens)
        state.step += 1

    @staticmethod
    def _compact(view: _DecodeState, state: _DecodeState) -> _DecodeState:
        """A decode state of ``view``'s rows that are still decoding: their tokens, prompt lengths,
        valid slots and caches, copied; the step counter and the outputs stay ``state``'s (its rows
        record where each row writes). The dropped rows' ``finished`` flags go back to ``state``
        first. Each kept row computes what it would have in the full batch, up to the rounding of
        a matrix product over fewer rows."""
        if view is not state:
            state.finished[view.rows] = view.finished
        keep = (~view.finished).nonzero().squeeze(1)
        return replace(
            view,
            tokens=view.tokens[keep],
            prompt_lengths=view.prompt_lengths[keep],
            key_valid=view.key_valid[keep],
            k_cache=[c[keep] for c in view.k_cache],
            v_cache=[c[keep] for c in view.v_cache],
            finished=view.finished[keep],
            rows=keep if view.rows is None else view.rows[keep],
        )

    def _decode_step(self, plan: _Plan, length: int, params: SamplingParams, generator) -> None:
        if not plan.compiled:
            return self._decode_step_impl(plan, length, params, generator)
        noise = None
        if self._whole_step is None:  # compile_decode="pieces": they run inside the eager step's code
            def call():
                return self._decode_step_impl(plan, length, params, generator)
        else:
            # the whole step as one graph (compile_decode="step"). The noise is drawn here, from the
            # caller's generator, as the eager step draws it (a generator inside the graph is a
            # graph break, and inductor's own random numbers another stream); the cache length is
            # rounded up to a bucket, so a call meets a few lengths, not one per token
            state = plan.state
            if params.temperature != 0 and plan.sampler is None:
                noise = self._noise((state.tokens.shape[0], self.weights["lm_head.weight"].shape[0]), generator)
            bucket = min(state.key_valid.shape[1], math.ceil(length / self.cache_bucket) * self.cache_bucket)

            def call():
                # every engine and bucket is another variant of one code object; past dynamo's
                # recompile limit it would run the step eagerly without a word; make that an error,
                # so the fallback below names it
                with _fail_on_recompile_limit():
                    return self._whole_step(plan, bucket, params, None, noise)
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not stop generation
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            # the failed step wrote only cache slots it rewrites and did not advance ``step``; the
            # eager retry uses the noise already drawn, so it samples what the compiled step would have
            self.compile_error, self._compiled, self._whole_step, plan.compiled = repr(exc), None, None, False
            warnings.warn(
                f"rlkit TorchEngine: the compiled decode step failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); this engine continues eagerly "
                "(engine.compile_error has the error)",
                RuntimeWarning, stacklevel=2,
            )
            return self._decode_step_impl(plan, length, params, generator, noise)

    def _decode_step_impl(self, plan: _Plan, length: int, params: SamplingParams, generator, noise=None) -> None:
        """Feed the last sampled token, sample the next one, attending over cache slots ``[0, length)``.

        Fixed shapes and no host sync (capturable in a CUDA graph). ``noise``: the sampler's
        ``Exp(1)`` draws ``(b vocab)``, else drawn from ``generator`` here."""
        state = plan.state
        slot = (state.step - 1 + state.prompt_width).view(1)
        positions = state.prompt_lengths + state.step - 1  # (b)
        cos, sin = state.cos[positions], state.sin[positions]  # (b d)
        state.key_valid.index_fill_(1, slot, True)
        b, kvh, d = state.tokens.shape[0], self.num_kv_heads, self.head_dim
        groups = self.num_heads // kvh
        triton_attention = self.decode_attention == "triton"
        on_cpu = self.device.type == "cpu"
        if not triton_attention:
            # one additive mask per step, shared by every layer (a boolean one is converted per call)
            valid = state.key_valid[:, None, None, :length]  # (b 1 1 L)
            mask = _additive_mask(valid, self.dtype)

        def attention(i, q, k=None, v=None, rotary=False):
            """``q (b H 1 d)``; with ``k, v`` the Triton kernel writes them into the cache itself."""
            if triton_attention:
                out = decode_attention(
                    q.reshape(b, kvh, groups, d), k.reshape(b, kvh, d), v.reshape(b, kvh, d), state.k_cache[i],
                    state.v_cache[i], state.key_valid, slot, d**-0.5, *((cos, sin) if rotary else ()),
                )
                return out.reshape(b, 1, kvh * groups * d)
            # GQA without repeating the cache: the query heads of one kv head become its query rows
            q4, k4, v4 = q.reshape(b, kvh, groups, d), state.k_cache[i][:, :, :length], state.v_cache[i][:, :, :length]
            if on_cpu:
                out = _small_attention(q4, k4, v4, mask, d**-0.5)
            else:
                out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=d**-0.5)
            return out.reshape(b, 1, kvh * groups * d)

        if plan.compiled and self._compiled is not None and FUSE_DECODE_EPILOGUES:
            layer_in, layer_out, final_norm, layer_qkv, layer_mlp = self._compiled[2:]
            if self.tp_size > 1:
                def layer_out(layer, x, attn, shape):
                    return _layer_out_tp(layer, x, attn, shape, self.tp_group, layer_mlp)

            x, delta = F.embedding(state.tokens[:, None], self.weights["model.embed_tokens.weight"]), None
            for i, layer in enumerate(self.layers):
                if triton_attention and FUSE_ROTARY_ATTENTION:
                    x, q, k, v = layer_qkv(layer, x, delta, self._shape)
                    attn = attention(i, q, k, v, rotary=True)
                else:
                    x, q = layer_in(layer, x, delta, cos[:, None], sin[:, None], self._shape, state.k_cache[i], state.v_cache[i], slot)
                    attn = attention(i, q, state.k_cache[i][:, :, slot], state.v_cache[i][:, :, slot]) if triton_attention else attention(i, q)
                x, delta = layer_out(layer, x, attn, self._shape)
            hidden = final_norm(x, delta, self.weights["model.norm.weight"], float(self.eps))
            tokens, logprobs = self._sample_logits(hidden[:, -1], params, generator, plan, noise)
            self._record(state, tokens, logprobs, params)
            return

        def attend(i, q, k, v):
            if triton_attention:
                return attention(i, q, k, v)
            state.k_cache[i].index_copy_(2, slot, k)
            state.v_cache[i].index_copy_(2, slot, v)
            return attention(i, q)

        hidden = self._forward(state.tokens[:, None], cos[:, None], sin[:, None], attend, compiled=plan.compiled)
        tokens, logprobs = self._sample_logits(hidden[:, -1], params, generator, plan, noise)
        self._record(state, tokens, logprobs, params)

    # ------------------------------------------------------------------ CUDA graphs
    def _graph_step(self, plan: _Plan, length: int, params, generator) -> None:
        """Run one decode step through the graph for ``length`` (capturing it on its second use:
        the first, eager, run warms up kernels and allocators).

        A capture that fails must not break generation: the step runs eagerly, and so do the
        plan's later steps of lengths not captured yet, with a warning naming the error. Under
        tensor parallelism the ranks of the group agree first (one all-reduce of a flag per
        capture): if any rank's capture failed, every rank drops its new graph and runs eagerly,
        so all ranks stay on the same code path and their collectives stay matched."""
        graph = plan.graphs.get(length)
        if graph is None:
            if length not in plan.warmed or plan.graph_failed:
                plan.warmed.add(length)
                self._decode_step(plan, length, params, generator)
                return
            error = None
            try:
                graph = self._capture(plan, lambda: self._decode_step(plan, length, params, generator))
            except Exception as exc:  # noqa: BLE001 - reported below, then the step runs eagerly
                graph, error = None, f"{type(exc).__name__}: {exc}"
            failed_ranks = self._failed_ranks(error is not None)
            if failed_ranks:
                plan.graph_failed = True
                message = "TorchEngine: capturing the decode step in a CUDA graph failed"
                if self.tp_size > 1:
                    message += f" on rank(s) {failed_ranks} of its tensor-parallel group"
                if error is not None:
                    message += f" ({error})"
                warnings.warn(
                    message + ". Decoding continues eagerly (slower) for the lengths not captured yet; "
                    "pass cuda_graphs=False to skip capturing.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self._decode_step(plan, length, params, generator)
                return
            plan.graphs[length] = graph
        graph.replay()

    def _capture(self, plan: _Plan, step) -> Any:
        """Record ``step()`` in a new CUDA graph of the plan's memory pool (nothing runs until
        the graph is replayed)."""
        graph = torch.cuda.CUDAGraph()
        if plan.pool is None:
            plan.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=plan.pool):
            step()
        return graph

    def _failed_ranks(self, failed: bool) -> list[int]:
        """The ranks of the tensor-parallel group whose capture failed (``[0]`` or ``[]`` without
        TP); every rank of the group gets the same list."""
        if self.tp_size == 1:
            return [0] if failed else []
        import torch.distributed as dist

        flags = torch.zeros(self.tp_size, dtype=torch.int32, device=self.device)
        flags[dist.get_group_rank(self.tp_group, dist.get_rank())] = int(failed)
        dist.all_reduce(flags, group=self.tp_group)
        return [i for i, f in enumerate(flags.tolist()) if f]

    def _can_graph(self, params: SamplingParams, generator) -> bool:
        if not self.cuda_graphs:
            return False
        if self._uses_fused_sampler(params) or params.temperature == 0:
            return True
        # torch sampling draws noise inside the step; only the default generator is graph-safe
        # without registering a caller's generator with each graph
        return generator is None

    # ------------------------------------------------------------------ generate
    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return left_pad_prompts(prompts, self.pad_token_id, self.weights["model.embed_tokens.weight"].shape[0])

    def _new_plan(self, key: tuple, b: int, p: int, steps: int, params: SamplingParams, fused_sampler: bool,
                  rope_length: int | None = None) -> _Plan:
        """``rope_length``: the longest sequence the rows can reach (longest real prompt plus
        ``steps``; default ``p + steps``), which picks a longrope rotary's factors (prompts
        bucketed to a wider ``p`` keep the model's short factors; see :meth:`_rope_table`)."""
        total = p + steps
        kv_shape = (b, self.num_kv_heads, total, self.head_dim)
        dev = self.device
        cos, sin = self._rope_table(total, rope_length)
        state = _DecodeState(
            tokens=torch.zeros(b, dtype=torch.long, device=dev),
            step=torch.zeros((), dtype=torch.long, device=dev),
            prompt_width=p,
            prompt_lengths=torch.zeros(b, dtype=torch.long, device=dev),
            key_valid=torch.zeros(b, total, dtype=torch.bool, device=dev),
            k_cache=[torch.zeros(kv_shape, dtype=self.dtype, device=dev) for _ in range(self.num_layers)],
            v_cache=[torch.zeros(kv_shape, dtype=self.dtype, device=dev) for _ in range(self.num_layers)],
            out_tokens=torch.full((b, steps), self.pad_token_id, dtype=torch.long, device=dev),
            out_mask=torch.zeros((b, steps), dtype=torch.bool, device=dev),
            out_logprobs=torch.zeros((b, steps), dtype=torch.float32, device=dev),
            finished=torch.zeros(b, dtype=torch.bool, device=dev),
            stop_ids=torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=dev),
            pad_id=self.pad_token_id,
            cos=cos,
            sin=sin,
        )
        vocab = self.weights["lm_head.weight"].shape[0]
        sampler = _make_sampler(b, vocab, dev) if fused_sampler else None
        if sampler is not None and self._rows is not None:
            sampler.total_rows = self._rows[1]
        return _Plan(key=key, state=state, sampler=sampler, compiled=self._compiled is not None or self._whole_step is not None)

    def _reset(self, plan: _Plan, prompt_mask: torch.Tensor) -> None:
        """Put a kept plan back to step 0 in place (graphs hold these addresses)."""
        state = plan.state
        p = state.prompt_width
        state.tokens.zero_()
        state.step.zero_()
        state.prompt_lengths.copy_(prompt_mask.sum(-1))
        state.key_valid.zero_()
        state.key_valid[:, :p] = prompt_mask
        state.out_tokens.fill_(self.pad_token_id)
        state.out_mask.zero_()
        state.out_logprobs.zero_()
        state.finished.zero_()

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        rows: tuple[int, int] | None = None,
    ) -> Generation:
        """Sample ``params.n`` responses per prompt (rows prompt-major). See :class:`Generation`.

        ``rows=(start, total)``: these ``len(prompt_ids) * n`` rows are rows ``[start, start + b)``
        of a batch of ``total`` rows, and each samples what it would in one call over that whole
        batch with the same ``generator`` (the noise of the whole batch is drawn, this call's rows
        kept; the fused sampler keys row ``r``'s noise as row ``start + r``). None: the rows are the
        whole batch.

        Decoding runs under ``torch.inference_mode`` (no version counters or view tracking per
        operator: on a 2-core CPU the tiny preset's rollout took 0.91x the time it took under
        ``no_grad``). Everything it allocates stays inside the engine; the returned tensors are
        copied out after it, so they are ordinary tensors that training code may use freely."""
        start = time.perf_counter()
        check_engine_context(self, prompt_ids, params, "TorchEngine.generate")
        self._rows = _checked_rows(rows, len(prompt_ids) * params.n)
        try:
            with torch.inference_mode():
                state, metrics = self._generate(prompt_ids, params, generator, start)
        finally:
            self._rows = None
        lengths = state.out_mask.sum(-1)
        width = max(int(lengths.max()), 1)
        generated = int(lengths.sum())
        seconds = time.perf_counter() - start
        return Generation(
            response_ids=state.out_tokens[:, :width].clone(),
            response_mask=state.out_mask[:, :width].clone(),
            logprobs=state.out_logprobs[:, :width].clone(),
            truncated=~state.finished,
            prompt_index=torch.arange(len(prompt_ids), device=self.device).repeat_interleave(params.n),
            metrics={
                "seconds": seconds,
                "prefill_seconds": metrics["prefill_seconds"],
                "tokens": float(generated),
                "tokens_per_second": generated / max(seconds, 1e-9),
                "decode_steps": metrics["decode_steps"],
                "graphs": metrics["graphs"],
            },
        )

    def _generate(self, prompt_ids, params: SamplingParams, generator, start: float) -> tuple[_DecodeState, dict]:
        """Prefill and decode; returns the decode state (its outputs filled) and timing metrics."""
        # the n samples of a prompt share its prefill: run it once per prompt, then copy the
        # keys/values (and the last hidden state) to the prompt's n rows
        ids, unique_mask = self._left_pad(prompt_ids)
        # positions run up to the longest prompt plus max_new_tokens, whatever the bucketed width
        rope_length = ids.shape[1] + params.max_new_tokens
        graphs = self._can_graph(params, generator)
        if graphs and ids.shape[1] % self.prompt_bucket:
            # a kept plan (cache and graphs) serves one prompt width: round it up, so that the next
            # call's prompts, a few tokens longer or shorter, reuse it instead of capturing again
            extra = self.prompt_bucket - ids.shape[1] % self.prompt_bucket
            ids = F.pad(ids, (extra, 0), value=self.pad_token_id)
            unique_mask = F.pad(unique_mask, (extra, 0), value=False)
        no_padding = bool(unique_mask.all())
        ids, unique_mask = ids.to(self.device), unique_mask.to(self.device)
        prompt_mask = unique_mask.repeat_interleave(params.n, dim=0)
        b0, p = ids.shape
        b = b0 * params.n
        steps = params.max_new_tokens
        if self._fused:
            self._refresh_fused()
        fused_sampler = self._uses_fused_sampler(params)
        stop_ids = () if params.ignore_stop else tuple(sorted(set(params.stop_token_ids)))
        # a kept plan's rotary table serves one longrope regime (short or long factors)
        # the whole batch's row count keys the fused sampler's noise (baked into captured graphs)
        total_rows = self._rows[1] if self._rows is not None else 0
        key = (b, p, steps, params.temperature, params.top_k, params.top_p, stop_ids, params.ignore_stop, fused_sampler, graphs,
               self._rope_regime(rope_length), total_rows)
        plan = self._plan
        if plan is None or plan.key != key or not graphs:
            self._plan = None  # free the old cache before allocating the new one
            plan = self._new_plan(key, b, p, steps, params, fused_sampler, rope_length)
            if graphs:
                self._plan = plan
        self._reset(plan, prompt_mask)
        state = plan.state
        if plan.sampler is not None:
            # one draw from the caller's generator keys all of this call's noise
            seed = torch.randint(0, 2**62, (1,), generator=generator, device=generator.device if generator is not None else self.device)
            plan.sampler.seed.copy_(seed + (self._rows[0] if self._rows is not None else 0))

        with torch.profiler.record_function("rlkit.engine.prefill"):  # names the range in a profiler trace
            # Prefill: causal attention among real prompt tokens; a pad query attends to itself only,
            # so no softmax row is empty (its output is never used).
            positions = (unique_mask.long().cumsum(-1) - 1).clamp(min=0)
            groups = self.num_heads // self.num_kv_heads
            if no_padding:
                mask = None
            else:
                causal = torch.ones(p, p, dtype=torch.bool, device=self.device).tril()
                eye = torch.eye(p, dtype=torch.bool, device=self.device)
                mask = (causal & (unique_mask[:, None, :] | eye))[:, None]  # (b0 1 p p)

            def attend(i, q, k, v):
                state.k_cache[i][:, :, :p] = k.repeat_interleave(params.n, dim=0) if params.n > 1 else k
                state.v_cache[i][:, :, :p] = v.repeat_interleave(params.n, dim=0) if params.n > 1 else v
                return F.scaled_dot_product_attention(
                    q, _repeat_kv(k, groups), _repeat_kv(v, groups), attn_mask=mask, is_causal=mask is None, scale=self.head_dim**-0.5
                ).transpose(1, 2).reshape(b0, p, self.num_heads * self.head_dim)

            hidden = self._forward(ids, state.cos[positions], state.sin[positions], attend)
            last = hidden[:, -1].repeat_interleave(params.n, dim=0) if params.n > 1 else hidden[:, -1]
            tokens, logprobs = self._sample_logits(last, params, generator, plan)
            self._record(state, tokens, logprobs, params)
        prefill_seconds = time.perf_counter() - start

        check_stops = not params.ignore_stop and len(stop_ids) > 0
        # on the CPU reading how many rows still decode costs no device sync, so the eager step
        # can leave the finished ones out (see _compact and COMPACT_FINISHED_ROWS)
        compact = (COMPACT_FINISHED_ROWS and check_stops and self.device.type == "cpu" and not graphs
                   and not plan.compiled and plan.sampler is None and self.tp_size == 1)
        view, view_plan = state, plan
        done = 1
        with torch.profiler.record_function("rlkit.engine.decode"):
            while done < steps:
                filled = p + done  # cache slots in use once this step has written its token
                if compact:
                    live = int((~view.finished).sum())
                    if live == 0:
                        break
                    if live <= COMPACT_FINISHED_ROWS * view.tokens.shape[0]:
                        view = self._compact(view, state)
                        view_plan = replace(plan, state=view)
                if graphs:
                    length = min(p + steps, math.ceil(filled / self.cache_bucket) * self.cache_bucket)
                    self._graph_step(plan, length, params, generator)
                elif view is not state:
                    noise = None
                    if params.temperature != 0:
                        # the draws the full batch's step would make, so a seed samples the same tokens
                        noise = self._noise((b, self.weights["lm_head.weight"].shape[0]), generator)[view.rows]
                    self._decode_step_impl(view_plan, filled, params, generator, noise)
                else:
                    self._decode_step(plan, filled, params, generator)
                done += 1
                if check_stops and not compact and done % self.sync_every == 0 and bool(state.finished.all()):
                    break
        if view is not state:
            state.finished[view.rows] = view.finished

        return state, {"prefill_seconds": prefill_seconds, "decode_steps": float(done), "graphs": float(len(plan.graphs))}
