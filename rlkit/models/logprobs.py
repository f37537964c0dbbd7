"""Per-token log-probs, entropies and values of responses under a model (the training forward).

Alignment (as verl): the log-prob of response token ``j`` comes from the logits at the position
of the token before it (the last prompt token for ``j = 0``). Prompts are LEFT-padded and
responses RIGHT-padded (the Batch layout); outputs are ``(b t)`` float32, 0 where
``response_mask`` is False.

Memory: the backbone runs to hidden states once; the vocabulary projection runs only on the
``m = response_mask.sum()`` predicting positions, ``chunk_tokens`` rows at a time, in float32
per chunk. Under autograd each chunk is checkpointed (recomputed in backward), so neither the
forward nor the saved activations ever hold ``(m, vocab)`` float32 logits; a chunk with fewer
than ``CHECKPOINT_MIN_LOGITS`` logits (a small vocabulary) keeps them instead, which costs at
most a few of those tensors and saves recomputing the head (the same values and gradients). On
CUDA a call whose logits fit in a quarter of the memory the device has left keeps every chunk's
(``KEEP_LOGITS``, :func:`keeps_logits`): one vocabulary projection less, bit-identical results.

On CUDA (bf16/fp16) two paths replace the generic ones:

- packed layout: attention runs through torch's varlen flash attention
  (``torch.nn.attention.varlen.varlen_attn``, ``cu_seqlens`` from the packing) instead of
  transformers' block-diagonal mask, which is an ``(n n)`` boolean tensor and ``O(n^2)`` work
  for ``n`` packed tokens. It is registered as a transformers attention function and switched
  on only for the duration of the call (not under gradient checkpointing, whose recompute
  would see the model's own attention).
- log-probs and entropy of each chunk come from one Triton pass over the bf16 logits (online
  log-sum-exp and ``sum p z``), and the backward writes ``dL/dlogits`` in one more pass:
  ``d lp / dz_j = 1[j = y] - p_j`` and ``dH / dz_j = -p_j (z_j - sum_i p_i z_i)``; no float32
  copy of the chunk's logits exists.

On CPU, packed batches longer than ``CPU_DENSE_MASK_MAX_TOKENS`` use the same attention hook
with each row scattered into a padded batch (``O(b L^2)`` work instead of the dense mask's
``O(n^2)``); shorter ones keep transformers' path. A padded batch attends through SDPA, except
on CPU, where two batched products are faster at these sizes (:data:`CPU_MATH_ATTENTION`).

Shared prompts (:class:`SharedPrefix`, ``SHARE_PROMPTS``): GRPO-style batches hold n responses
per prompt in consecutive rows; the packed layout can keep one copy of each prompt, with every
response attending to it, so the prompt's layers run once per group instead of n times. Same
log-probs, values and gradients; on by default. On CUDA both attention calls of the layout are
varlen flash attention: prompts causal among themselves, and each response's queries against
``[prompt; response]`` keys, which flash's bottom-right-aligned causal mask gets exactly right.
Without flash (CPU, float32) the two calls attend over zero-padded batches of the prompts and
of the responses, gathered by one index per tensor from a plan built once per layout
(:func:`_shared_padded`).

``USE_VARLEN_ATTENTION`` / ``USE_FUSED_LOGPROBS`` (module flags) turn either off.

Logit maps: a model whose forward maps ``lm_head``'s logits elementwise (Gemma 2's
``final_logit_softcapping``, Granite's ``logits_scaling``, Cohere's ``logit_scale``) gets the same
map on each chunk before the log-softmax (:data:`LOGIT_TRANSFORMS`); a model type not checked
there that sets one of those fields is refused.

Architectures: the packed layouts (shared prompts, transformers' packed mask, varlen) run only
for the model types checked to honour packed rows (:data:`PACKED_MODEL_TYPES`); any other causal
LM (OPT, BLOOM, MPT, Falcon, ...) gets the padded layout, which is exact for all of them. rlkit's
own attention functions further need full causal attention: no attention dropout while
training, no logit soft-capping, and no sliding window shorter than the batch's longest row
(:func:`_full_attention_packed`); otherwise the packed rows attend through transformers.

FSDP2: ``fully_shard`` unshards parameters in module forward hooks, so all the work happens
inside :class:`LogprobModule.forward` / :class:`ValueModule.forward`. Shard the wrapper (the
root), e.g. ``fully_shard(layer) for each layer; fully_shard(LogprobModule(model))``; calling
``model.model`` / ``model.lm_head`` from outside a module call would see sharded parameters.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlkit._checks import input_vocab, is_int, is_real
from rlkit._triton import lazy_kernels
from rlkit.batch import input_response_mask, packed
from rlkit.engines.torch_engine import _additive_mask, _small_attention

#: Triton and ``triton.language``, put here by :func:`rlkit._triton.lazy_kernels` when the kernels
#: are first built (None before that, and on machines without Triton)
triton: Any = None
tl: Any = None

LAYOUTS = ("packed", "padded")
#: attention implementations whose masks transformers derives from packed ``position_ids``
PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
#: ``config.model_type``s whose transformers implementation honours packed rows: positions from
#: the restarting ``position_ids``, the block-diagonal causal mask transformers derives from them,
#: and attention through the interface that rlkit's shared-prompt / varlen functions plug into
#: (every kwarg they need passed down). Each was checked (transformers 5.x, tiny random models)
#: against the plain model run one unpadded row at a time, in all three packed layouts (shared
#: prompts, transformers' packed mask, varlen). Any other model type runs ``layout="packed"`` as
#: the padded layout, which is exact for every causal LM: OPT (positions from the attention mask,
#: not ``position_ids``), BLOOM and MPT (ALiBi, no ``position_ids``) gave log-probs off by 0.6 to
#: 3.6 packed, and Falcon, MPT and StableLM crashed in rlkit's attention
#: (``tests/models/test_arch_variants.py``). Only add a model type after checking it the same
#: way. A string lookup: no cost per call.
PACKED_MODEL_TYPES = frozenset({
    "llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "gpt_neox", "gptj", "phi", "olmo", "olmo2",
    "starcoder2", "mixtral", "qwen2_moe", "mistral", "gpt2", "gpt_bigcode",
})
#: config fields holding the attention-probability dropout of the model types above (rlkit's
#: attention functions apply none, so a training model with one runs transformers' attention)
_ATTENTION_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attn_dropout", "attention_probs_dropout_prob")
#: config fields that change logits after ``lm_head`` in some model types' forward
_LOGIT_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
#: model_type -> (config field, map) of the elementwise map its ``*ForCausalLM.forward`` applies to
#: ``lm_head``'s output, in the logits' dtype, before anything reads them (generate's temperature
#: included): ``"softcap"`` ``c * tanh(z / c)`` (Gemma 2 and 3, NanoChat: ``final_logit_softcapping``),
#: ``"divide"`` ``z / s`` (Granite: ``logits_scaling``), ``"multiply"`` ``z * s`` (Cohere:
#: ``logit_scale``). Read off each model's transformers 5.x forward and checked against it
#: (``tests/models/test_interop_fixes.py``). The same field name means other maps in other models
#: (HyperCLOVA X multiplies by ``logits_scaling``, MiniCPM3 divides the hidden states by it), so a
#: model type not listed here that sets one is refused (:func:`logit_transform`).
LOGIT_TRANSFORMS = {
    "gemma2": ("final_logit_softcapping", "softcap"),
    "gemma3_text": ("final_logit_softcapping", "softcap"),
    "nanochat": ("final_logit_softcapping", "softcap"),
    "granite": ("logits_scaling", "divide"),
    "granitemoe": ("logits_scaling", "divide"),
    "granitemoeshared": ("logits_scaling", "divide"),
    "cohere": ("logit_scale", "multiply"),
    "cohere2": ("logit_scale", "multiply"),
}
#: CUDA fast paths (see the module docstring); set False to measure or debug the generic ones
USE_VARLEN_ATTENTION = True
USE_FUSED_LOGPROBS = True
_VARLEN_NAME = "rlkit_varlen"


# ---------------------------------------------------------------------------------------------
# varlen flash attention for the packed layout (CUDA)


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_VARLEN_OPTIONS: frozenset | None = None  # parameter names of this torch's varlen_attn


def _varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None, **kwargs):
    """A transformers attention function: ``query (1 H n d)``, ``key/value (1 kvh n d)`` of packed
    rows with boundaries ``kwargs["cu_seq_lens_q"]`` -> ``(1 n H d)``, causal within each row.

    Flash attention needs bf16/fp16 inputs; otherwise (e.g. FSDP without mixed precision) each
    row is scattered into a padded batch (:func:`_attend_segments`)."""
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None or max_len is None:
        raise RuntimeError("rlkit varlen attention needs cu_seq_lens_q / max_length_q (call through rlkit.models.response_hidden)")
    _check_attention_options("varlen", dropout, sliding_window, max_len, kwargs)
    groups = query.shape[1] // key.shape[1]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (n heads d)
    return _attend_segments(q, k, v, cu, cu, max_len, max_len, scaling, groups)[None], None


def _check_attention_options(name: str, dropout, sliding_window, longest: int, kwargs: dict) -> None:
    """Refuse what rlkit's attention functions do not compute: attention dropout, logit
    soft-capping, and a sliding window that can hide a key, i.e. one smaller than the layout's
    longest row ``longest`` (a window at least that long hides nothing: full causal attention).
    :func:`response_view` picks these layouts only when none applies (:func:`_full_attention_packed`)."""
    if dropout:
        raise RuntimeError(f"rlkit {name} attention applies no attention dropout ({dropout})")
    if sliding_window is not None and sliding_window < longest:
        raise RuntimeError(f"rlkit {name} attention supports no sliding window ({sliding_window}) shorter than the "
                           f"layout's longest row ({longest} tokens)")
    if kwargs.get("softcap") is not None:
        raise RuntimeError(f"rlkit {name} attention applies no attention logit soft-capping ({kwargs['softcap']})")


def _varlen_options() -> frozenset:
    global _VARLEN_OPTIONS
    if _VARLEN_OPTIONS is None:
        fn = _varlen_fn()
        _VARLEN_OPTIONS = frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()
    return _VARLEN_OPTIONS


def _flash_ok(query: torch.Tensor) -> bool:
    return (USE_VARLEN_ATTENTION and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
            and query.shape[-1] <= 256 and _varlen_fn() is not None)


def _flash_segments(q, k, v, q_cu, k_cu, q_max: int, k_max: int, scaling, groups: int) -> torch.Tensor:
    """:func:`_attend_segments` through torch's varlen flash attention, whose causal mask is
    aligned to the bottom right when a segment has more keys than queries."""
    options = _varlen_options()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kw = {}
    if "window_size" in options:  # torch >= 2.11: causal is a (-1, 0) window
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    if scaling is not None:
        if "scale" in options:
            kw["scale"] = scaling
        elif abs(scaling - q.shape[-1] ** -0.5) > 1e-12:
            raise RuntimeError(f"this torch's varlen_attn takes no scale and the model uses {scaling}")
    if groups > 1:
        if "enable_gqa" in options:
            kw["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return _varlen_fn()(q, k, v, q_cu.to(torch.int32), k_cu.to(torch.int32), q_max, k_max, **kw)


def _attend_segments(q, k, v, q_cu, k_cu, q_max: int, k_max: int, scaling, groups: int) -> torch.Tensor:
    """Attention of query segments against key segments: ``q (nq H d)``, ``k, v (nk kvh d)``
    concatenated segments with boundaries ``q_cu`` / ``k_cu`` -> ``(nq H d)``. Causal, aligned to
    the bottom right: query ``i`` of a segment with ``Lq`` queries and ``Lk`` keys sees keys
    ``j <= Lk - Lq + i``, so equal lengths are plain causal attention (packed rows) and a
    response's queries against ``[prompt; response]`` keys see the whole prompt and the response
    up to themselves (:class:`SharedPrefix`). Varlen flash attention where it runs (CUDA, half
    precision), else :func:`_padded_segments`."""
    if _flash_ok(q):
        return _flash_segments(q, k, v, q_cu, k_cu, q_max, k_max, scaling, groups)
    return _padded_segments(q, k, v, q_cu, k_cu, q_max, k_max, scaling, groups)


def _causal_mask(q_len: torch.Tensor, k_len: torch.Tensor, lq: int, lk: int) -> torch.Tensor:
    """``(s 1 lq lk)``: query ``i`` of a segment sees keys ``j <= k_len - q_len + i`` that exist;
    key 0 always exists, so padded query slots keep a non-empty softmax row (never read)."""
    i = torch.arange(lq, device=q_len.device)
    j = torch.arange(lk, device=q_len.device)
    offset = k_len - q_len
    return ((j[None, None, :] <= offset[:, None, None] + i[None, :, None]) & (j[None, None, :] < k_len[:, None, None]))[:, None]


@torch.compiler.disable
def _padded_segments(q, k, v, q_cu, k_cu, q_max: int, k_max: int, scaling, groups: int) -> torch.Tensor:
    """:func:`_attend_segments` without flash: each segment zero-padded into a batch that attends
    under a causal + key-padding mask (:func:`_slots`, :func:`_padded_attention`), gathered back
    (:func:`_unpad_index`). Work ``O(s L^2)``, not ``O(n^2)``.

    Kept out of compiled blocks (a graph break): inductor once fused this function's indexing
    into the rotary kernel of a compiled block on CUDA, and that kernel failed a device-side
    bounds assert on the segment index (float32 model, where flash does not run), while eager
    gives the right values."""
    same = k_cu is q_cu and k_max == q_max  # packed rows: each segment attends to itself
    q_cu, k_cu = q_cu.long(), k_cu.long()
    nq, nk = q.shape[0], k.shape[0]
    q_slots, q_len = _slots(torch.arange(nq, device=q.device), q_cu, q_max, nq)
    k_slots, k_len = (q_slots, q_len) if same else _slots(torch.arange(nk, device=k.device), k_cu, k_max, nk)
    out = _padded_attention(_zero_row(q), _zero_row(k), _zero_row(v), q_slots, k_slots,
                            _causal_mask(q_len, k_len, q_max, k_max), scaling, groups)
    return _take_rows(out, _unpad_index([q_slots], nq))


def _slots(index: torch.Tensor, cu: torch.Tensor, width: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(segments, width)`` table of ``index``'s entries per segment (``n`` past a segment's
    end) and the segment lengths."""
    lengths = cu[1:] - cu[:-1]
    j = torch.arange(width, device=index.device)
    valid = j[None, :] < lengths[:, None]
    flat = (cu[:-1, None] + j[None, :]).clamp(max=max(index.numel() - 1, 0))
    return torch.where(valid, index[flat] if index.numel() else flat, n), lengths


#: CPU: gather rows with ``index_select``, whose backward is ``index_add_``, instead of advanced
#: indexing, whose backward (``index_put_(accumulate=True)``) runs serially on CPU: 0.2 against
#: 1.1 ms for the backward of one layer's response-key gather on the CPU benchmark
#: (``benchmarks/HISTORY.md``, twelfth session). The two sum a row's gradient in different orders,
#: so they round differently. CUDA keeps indexing (its ``index_add_`` is nondeterministic).
CPU_INDEX_SELECT = True


def _take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` for an integer ``index`` of any shape over ``t``'s first dimension."""
    if t.device.type == "cpu" and CPU_INDEX_SELECT:
        return t.index_select(0, index.reshape(-1)).view(*index.shape, *t.shape[1:])
    return t[index]


def _zero_row(t: torch.Tensor) -> torch.Tensor:
    """``t (n h d)`` with one zero row appended, ``(n+1 h d)``: what padding slots (value ``n``) read."""
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])])


def _padded_attention(qz, kz, vz, q_slots, k_slots, mask, scaling, groups: int) -> torch.Tensor:
    """Attention over zero-padded segment batches: ``qz (nq+1 H d)``, ``kz, vz (nk+1 kvh d)``
    (:func:`_zero_row`) are gathered by the slot tables ``q_slots (s Lq)``, ``k_slots (s Lk)``
    (one gather per tensor; padding slots read the zero row, no index-put, no host sync) and
    attend under ``mask (s 1 Lq Lk)``, through SDPA, or on CPU :func:`_math_attention`.
    Returns ``(s * Lq, H, d)``, one row per query slot."""
    qs, ks, vs = (_take_rows(t, i).transpose(1, 2) for t, i in ((qz, q_slots), (kz, k_slots), (vz, k_slots)))  # (s h L d)
    if qs.device.type == "cpu" and CPU_MATH_ATTENTION:
        o = _math_attention(qs, ks, vs, mask, scaling, groups)
    else:
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling)  # (s H L d)
    return o.transpose(1, 2).reshape(-1, qz.shape[1], qz.shape[2])


#: CPU: the padded-segment attention as two batched products (:func:`_math_attention`) instead
#: of SDPA, whose CPU kernel spends most of its time in per-call set-up at these sizes (a few
#: dozen keys per segment): 2.5 against 4.7 ms forward+backward per layer at the CPU
#: benchmark's response segments (``benchmarks/HISTORY.md``, twelfth session). False: SDPA.
CPU_MATH_ATTENTION = True


def _math_attention(q, k, v, mask, scaling, groups: int) -> torch.Tensor:
    """``softmax(q k^T * scale | mask) v`` for ``q (s H Lq d)``, ``k, v (s kvh Lk d)`` and a
    boolean ``mask (s 1 Lq Lk)`` (True: attend; every query row has at least one key), through
    the rollout engine's CPU decode attention (:func:`rlkit.engines.torch_engine._small_attention`:
    two products, float32 at least). The ``g = H / kvh`` query heads of a key/value head are
    stacked as ``g * Lq`` query rows against that head, so keys and values are never repeated.
    The same values as SDPA up to float rounding (``tests/models/test_logprobs.py``)."""
    s, h, lq, d = q.shape
    kvh = k.shape[1]
    scale = d**-0.5 if scaling is None else scaling
    bias = _additive_mask(mask, q.dtype)
    if groups > 1:  # one copy of a row's mask per stacked query head: (s 1 g*Lq Lk)
        bias = bias.repeat(1, 1, groups, 1)
    return _small_attention(q.reshape(s, kvh, groups * lq, d), k, v, bias, scale).view(s, h, lq, d)


def _unpad_index(slot_tables: list[torch.Tensor], n: int) -> torch.Tensor:
    """The inverse of :func:`_slots` tables: for each of the ``n`` packed tokens, its row in the
    concatenation of the flattened tables (the padded outputs, one row per slot, are gathered by
    it). The padding slots all land in an extra entry ``n``, dropped (no boolean indexing: that
    would wait for the GPU)."""
    flat = torch.cat([t.flatten() for t in slot_tables])
    inverse = torch.zeros(n + 1, dtype=torch.long, device=flat.device)
    inverse.index_copy_(0, flat, torch.arange(flat.numel(), device=flat.device))
    return inverse[:n]


# ---------------------------------------------------------------------------------------------
# shared prompts: the n responses of a prompt attend to ONE copy of it


@dataclass
class SharedPrefix:
    """Packed layout where consecutive rows with the same prompt share one copy of it.

    The sequence is ``[prompt_g, response_g1, ..., response_gn]`` per group ``g``, each response
    without its last token (its output predicts nothing: :func:`rlkit.batch.input_response_mask`);
    position ids continue the prompt in every response. Attention: prompt tokens are causal among their
    prompt; a response token sees its group's prompt and its own response up to itself. Every
    token's computation is the unshared one's, so log-probs, values and gradients are equal (the
    prompt's gradient is the sum over its responses, which autograd accumulates); only the
    prompt's linear layers and MLPs run once per group instead of once per row.
    """

    input_ids: torch.Tensor  # (n)
    position_ids: torch.Tensor  # (n)
    prompt_index: torch.Tensor  # (n_p) packed positions of the prompt tokens (contiguous per group)
    prompt_cu: torch.Tensor  # (groups + 1) prompt segment boundaries within prompt_index
    prompt_max: int
    response_index: torch.Tensor  # (n_r) packed positions of the response tokens in the input, row-major
    response_cu: torch.Tensor  # (rows' + 1) query segments (rows with >= 1 response token in the input)
    key_index: torch.Tensor  # (n_k) packed positions of each response row's keys: its prompt, then itself
    key_cu: torch.Tensor  # (rows' + 1)
    response_max: int
    key_max: int
    predict_index: torch.Tensor  # (m) position whose hidden state predicts each response token


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=lengths.device)
    cu[1:] = lengths.cumsum(0)
    return cu


def shared_prefix(prompt_ids, prompt_mask, response_ids, response_mask) -> SharedPrefix | None:
    """The :class:`SharedPrefix` layout of a left-padded batch, or None when no two consecutive
    rows share a prompt (then sharing saves nothing)."""
    prompt_mask, response_mask = prompt_mask.bool(), response_mask.bool()
    b = prompt_ids.shape[0]
    if b < 2:
        return None
    key = torch.where(prompt_mask, prompt_ids, torch.full_like(prompt_ids, -1))
    same = (key[1:] == key[:-1]).all(-1)
    if not bool(same.any()):
        return None
    device = prompt_ids.device
    starts = torch.ones(b, dtype=torch.bool, device=device)
    starts[1:] = ~same
    group = starts.long().cumsum(0) - 1  # (b) group of each row
    p_len, r_len = prompt_mask.sum(1), response_mask.sum(1)
    # keep a row's prompt only at its group's first row: row-major order is then
    # prompt_g, response_g1, response_g2, ... for every group
    # and of each response all but its last token, whose output predicts nothing (input_response_mask)
    r_in = input_response_mask(response_mask)
    keep = torch.cat([prompt_mask & starts[:, None], r_in], dim=1)
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    pos = torch.cat([prompt_mask, response_mask], dim=1).long().cumsum(1) - 1
    flat = keep.flatten()
    input_ids, position_ids = ids.flatten()[flat], pos.flatten()[flat]
    row_len = keep.sum(1)  # tokens each row contributes
    row_start = _cu(row_len)[:-1]  # packed position of each row's first kept token
    first_row = torch.nonzero(starts).flatten()  # (groups)
    group_prompt_start = row_start[first_row]  # the prompt is the first thing its group's first row keeps
    prompt_start = group_prompt_start[group]  # (b)
    response_start = row_start + torch.where(starts, p_len, torch.zeros_like(p_len))  # (b)

    def ranges(begin: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """concatenated aranges: begin[i] .. begin[i] + lengths[i] - 1"""
        cu = _cu(lengths)
        owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        return begin[owner] + torch.arange(int(cu[-1]), device=device) - cu[owner]

    g_plen = p_len[first_row]
    prompt_index = ranges(group_prompt_start, g_plen)
    predicted_len = r_len  # response tokens to predict; r_len below: those in the input
    r_len = r_in.sum(1)
    rows = torch.nonzero(r_len > 0).flatten()
    rl, pl = r_len[rows], p_len[rows]
    response_index = ranges(response_start[rows], rl)
    # keys of row r: its group's prompt [prompt_start, +P) then its response [response_start, +R)
    k_len = pl + rl
    k_cu = _cu(k_len)
    owner = torch.repeat_interleave(torch.arange(rows.numel(), device=device), k_len)
    k_pos = torch.arange(int(k_cu[-1]), device=device) - k_cu[owner]
    key_index = torch.where(
        k_pos < pl[owner], prompt_start[rows][owner] + k_pos, response_start[rows][owner] + k_pos - pl[owner]
    )
    # response token t of row r is predicted by the hidden state before it: the group's last
    # prompt token for t = 0, response token t - 1 otherwise
    prows = torch.nonzero(predicted_len > 0).flatten()
    prl = predicted_len[prows]
    owner_r = torch.repeat_interleave(torch.arange(prows.numel(), device=device), prl)
    t = torch.arange(int(prl.sum()), device=device) - _cu(prl)[owner_r]
    predict_index = torch.where(
        t == 0, prompt_start[prows][owner_r] + p_len[prows][owner_r] - 1, response_start[prows][owner_r] + t - 1
    )
    return SharedPrefix(
        input_ids=input_ids, position_ids=position_ids, prompt_index=prompt_index, prompt_cu=_cu(g_plen),
        prompt_max=int(g_plen.max()), response_index=response_index, response_cu=_cu(rl), key_index=key_index,
        key_cu=k_cu, response_max=int(rl.max()) if rl.numel() else 0,
        key_max=int(k_len.max()) if k_len.numel() else 0, predict_index=predict_index,
    )


def _shared_prefix_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None, **kwargs):
    """A transformers attention function for the :class:`SharedPrefix` layout:
    ``query (1 H n d)``, ``key/value (1 kvh n d)`` -> ``(1 n H d)``: prompts causal among
    themselves, each response over its prompt then itself (:func:`_attend_segments`)."""
    layout: SharedPrefix | None = kwargs.get("rlkit_shared_prefix")
    if layout is None:
        raise RuntimeError("rlkit shared-prefix attention needs rlkit_shared_prefix (call through rlkit.models.response_hidden)")
    _check_attention_options("shared-prefix", dropout, sliding_window, max(layout.prompt_max, layout.key_max), kwargs)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (n h d)
    groups = q.shape[1] // k.shape[1]
    attend = _shared_segments if _flash_ok(q) else _shared_padded
    return attend(q, k, v, layout, scaling, groups)[None], None


def _shared_segments(q, k, v, layout: SharedPrefix, scaling, groups: int) -> torch.Tensor:
    """The shared-prompt attention as two :func:`_attend_segments` calls on the gathered prompt
    and response segments: ``q (n H d)``, ``k, v (n kvh d)`` -> ``(n H d)``. What runs with flash;
    without it, :func:`_shared_padded` computes the same, bit for bit, with fewer small ops."""
    p, r, kk = layout.prompt_index, layout.response_index, layout.key_index
    out = q.new_zeros(q.shape).index_copy(
        0, p, _attend_segments(q[p], k[p], v[p], layout.prompt_cu, layout.prompt_cu, layout.prompt_max, layout.prompt_max, scaling, groups)
    )
    if r.numel():
        out = out.index_copy(0, r, _attend_segments(q[r], k[kk], v[kk], layout.response_cu, layout.key_cu,
                                                    layout.response_max, layout.key_max, scaling, groups))
    return out


@dataclass
class _PaddedPlan:
    """Where every token of a :class:`SharedPrefix` layout sits in the padded batches that
    :func:`_shared_padded` attends over: gather indices into the packed tokens (``n`` points at
    an appended zero row), the attention masks, and each packed token's place in the padded
    outputs. Depends only on the layout, so it is built once per forward, not once per layer."""

    prompt_q: torch.Tensor  # (groups, Lp) packed position of each prompt slot (n: padding)
    prompt_mask: torch.Tensor  # (groups, 1, Lp, Lp) causal within the prompt
    response_q: torch.Tensor  # (rows', Lr) packed position of each response query slot
    response_k: torch.Tensor  # (rows', Lk) packed position of each key slot: prompt, then response
    response_mask: torch.Tensor  # (rows', 1, Lr, Lk) bottom-right-aligned causal
    gather_out: torch.Tensor  # (n) each packed token's row in cat(prompt outputs, response outputs)


def _padded_plan(layout: SharedPrefix) -> _PaddedPlan:
    """The layout's :class:`_PaddedPlan`, cached on the layout object (one forward's layers share
    it; a layout lives for one micro-batch, on one device). Built on the layout's device without
    a host sync."""
    plan = layout.__dict__.get("_padded_plan")
    if plan is None:
        n = layout.input_ids.numel()
        pq, p_len = _slots(layout.prompt_index, layout.prompt_cu, layout.prompt_max, n)
        rq, r_len = _slots(layout.response_index, layout.response_cu, layout.response_max, n)
        rk, k_len = _slots(layout.key_index, layout.key_cu, layout.key_max, n)
        plan = layout.__dict__["_padded_plan"] = _PaddedPlan(
            prompt_q=pq, prompt_mask=_causal_mask(p_len, p_len, layout.prompt_max, layout.prompt_max),
            response_q=rq, response_k=rk, response_mask=_causal_mask(r_len, k_len, layout.response_max, layout.key_max),
            gather_out=_unpad_index([pq, rq], n),
        )
    return plan


@torch.compiler.disable
def _shared_padded(q, k, v, layout: SharedPrefix, scaling, groups: int) -> torch.Tensor:
    """The shared-prompt attention without flash (CPU, float32): prompts and responses each
    gathered into a zero-padded batch by one index per tensor (:class:`_PaddedPlan`, built once
    per layout), two attention calls, one gather back to ``(n h d)``. The same attention inputs
    as :func:`_shared_segments` (equal values and gradients, bit for bit:
    ``tests/models/test_shared_prefix.py``) with a fraction of its small ops.

    Kept out of compiled blocks for the reason :func:`_padded_segments` is."""
    plan = _padded_plan(layout)
    qz, kz, vz = _zero_row(q), _zero_row(k), _zero_row(v)
    parts = [_padded_attention(qz, kz, vz, plan.prompt_q, plan.prompt_q, plan.prompt_mask, scaling, groups)]
    if plan.response_q.numel():
        parts.append(_padded_attention(qz, kz, vz, plan.response_q, plan.response_k, plan.response_mask, scaling, groups))
    return _take_rows(torch.cat(parts), plan.gather_out)


_SHARED_NAME = "rlkit_shared_prefix"

#: compute each prompt once per group of consecutive rows sharing it, in the training forward:
#: "auto" does it on CPU and, with varlen flash attention, on CUDA (measured faster on both:
#: benchmarks/HISTORY.md; :func:`shares_prompts`). True / False force it.
SHARE_PROMPTS: bool | str = "auto"


#: on CPU, packed sequences shorter than this keep transformers' dense block-diagonal mask (cheap
#: at that size); longer ones use the padded-rows attention, O(b L^2) instead of O(n^2)
CPU_DENSE_MASK_MAX_TOKENS = 512


def shares_prompts(device: torch.device | str) -> bool:
    """What :data:`SHARE_PROMPTS` means on ``device``: the flag itself unless it is "auto"; "auto"
    shares on CPU and, where varlen flash attention exists, on CUDA (measured faster on both:
    benchmarks/HISTORY.md)."""
    if SHARE_PROMPTS != "auto":
        return bool(SHARE_PROMPTS)
    device = torch.device(device)
    if device.type == "cpu":
        return True
    return device.type == "cuda" and USE_VARLEN_ATTENTION and _varlen_fn() is not None


def _checkpointing(backbone: nn.Module) -> bool:
    """Whether transformers' activation (gradient) checkpointing is on in ``backbone``. Asks for
    ``is_activation_checkpointing`` where the class has it: transformers 5.2x renamed the property,
    and reading the old name there prints a FutureWarning (it showed twice in ``rlkit run
    arithmetic``'s output). Older versions have only ``is_gradient_checkpointing``."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(backbone), name):
            return bool(getattr(backbone, name))
    return False


def packs_rows(backbone: nn.Module) -> bool:
    """Whether ``backbone``'s model type is known to honour packed rows (:data:`PACKED_MODEL_TYPES`):
    only then does :func:`response_view` build a packed layout; any other model runs
    ``layout="packed"`` as the padded layout (exact for every causal LM, only slower)."""
    return getattr(getattr(backbone, "config", None), "model_type", None) in PACKED_MODEL_TYPES


def _attention_dropout(config) -> float:
    """The attention-probability dropout the config sets under any of the usual names
    (:data:`_ATTENTION_DROPOUT_FIELDS`: Llama's ``attention_dropout``, GPT-2's ``attn_pdrop``, ...)."""
    rates = [getattr(config, name, None) for name in _ATTENTION_DROPOUT_FIELDS]
    return max([float(r) for r in rates if is_real(r)] or [0.0])


def _sliding_window(config) -> int | None:
    """The attention window some layer of the model may apply: None when every layer attends to
    all earlier tokens; 0 when a layer slides (or attends otherwise than fully) over a window
    this cannot tell. Qwen2/3 and Gemma name the sliding layers in ``layer_types`` (Qwen2's
    ``use_sliding_window`` builds them) and leave ``sliding_window`` unused otherwise; Mistral,
    Mixtral, Phi-3 and Starcoder2 have no ``layer_types`` and apply ``sliding_window`` in every layer."""
    window = getattr(config, "sliding_window", None)
    window = int(window) if is_int(window) else None
    layer_types = getattr(config, "layer_types", None)
    kinds = set(layer_types or ()) - {"full_attention"}
    if getattr(config, "use_sliding_window", False) or kinds:
        return window if kinds <= {"sliding_attention"} and window is not None and window > 0 else 0
    return None if layer_types else window


def _longest_row(prompt_mask: torch.Tensor, response_mask: torch.Tensor, window: int | None) -> int | None:
    """The longest row (prompt + response tokens) of the batch, or None when no ``window`` applies.
    Without reading the masks (a host sync on a device) when the padded width is within the window:
    no row is longer than that."""
    if window is None:
        return None
    width = prompt_mask.shape[1] + response_mask.shape[1]
    if window >= width:
        return width
    return int((prompt_mask.sum(1) + response_mask.sum(1)).max()) if prompt_mask.shape[0] else 0


def _full_attention_packed(backbone: nn.Module, longest: int | None = None) -> bool:
    """The model can run a custom packed layout (shared prompts, varlen attention): a model type
    known to honour packed rows (:data:`PACKED_MODEL_TYPES`), no gradient checkpointing, no
    attention dropout while training (under any of :data:`_ATTENTION_DROPOUT_FIELDS`), no
    attention logit soft-capping, and full causal attention in every layer over rows of up to
    ``longest`` tokens: a sliding window (:func:`_sliding_window`) counts only when it is shorter
    than ``longest`` (None: rows of any length, so any window counts), as a window at least as
    long as every row hides no key. Through an implementation that reads packed positions.
    Without it the packed layout runs through transformers' own attention (for the model types
    of :data:`PACKED_MODEL_TYPES`; others run padded)."""
    config = getattr(backbone, "config", None)
    if config is None or getattr(config, "model_type", None) not in PACKED_MODEL_TYPES or _checkpointing(backbone):
        return False
    if backbone.training and _attention_dropout(config) > 0:
        return False  # rlkit's attention functions apply no dropout
    if getattr(config, "attn_logit_softcapping", None):
        return False  # nor soft-capping (Gemma 2)
    window = _sliding_window(config)
    if window is not None and (longest is None or window < longest):
        return False
    return getattr(config, "_attn_implementation", None) in PACKED_ATTENTION


def _can_use_varlen(backbone: nn.Module, device: torch.device, tokens: int = 0, longest: int | None = None) -> bool:
    if not USE_VARLEN_ATTENTION or device.type not in ("cuda", "cpu") or not _full_attention_packed(backbone, longest):
        return False
    if device.type == "cpu" and tokens <= CPU_DENSE_MASK_MAX_TOKENS:
        return False
    _varlen_options()
    config = backbone.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # the dtype is checked per call: under FSDP mixed precision parameters are float32 but compute is bf16
    return head_dim <= 256


@contextlib.contextmanager
def _attention_implementation(config, name: str):
    from transformers import AttentionInterface

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _shared_prefix_attention if name == _SHARED_NAME else _varlen_attention)
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


# ---------------------------------------------------------------------------------------------
# fused log-softmax / entropy over the vocabulary (Triton, CUDA)

@lazy_kernels
def _logprob_kernels() -> dict:
    """``{"forward", "backward"}`` Triton kernels; None when Triton is not importable."""

    @triton.jit
    def forward_kernel(logits_ptr, row_stride, vocab, targets_ptr, inv_temp, lp_ptr, ent_ptr, lse_ptr, BLOCK: tl.constexpr):
        # one row: online max / sum e^(z-max) / sum e^(z-max) z over the vocabulary
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        lanes = tl.arange(0, BLOCK)
        run_max = tl.full([], float("-inf"), tl.float32)
        run_sum = tl.full([], 0.0, tl.float32)
        run_dot = tl.full([], 0.0, tl.float32)
        for off in range(0, vocab, BLOCK):
            cols = off + lanes
            valid = cols < vocab
            z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
            new_max = tl.maximum(run_max, tl.max(z, 0))
            scale = tl.exp(run_max - new_max)
            e = tl.exp(z - new_max)
            run_sum = run_sum * scale + tl.sum(e, 0)
            run_dot = run_dot * scale + tl.sum(tl.where(valid, e * z, 0.0), 0)
            run_max = new_max
        lse = run_max + tl.log(run_sum)
        target = tl.load(targets_ptr + row)
        z_target = tl.load(base + target).to(tl.float32) * inv_temp
        tl.store(lp_ptr + row, z_target - lse)
        tl.store(ent_ptr + row, lse - run_dot / run_sum)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def backward_kernel(
        logits_ptr, row_stride, vocab, targets_ptr, inv_temp, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, grad_ptr, grad_stride,
        WITH_ENT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        out = grad_ptr + row.to(tl.int64) * grad_stride
        lanes = tl.arange(0, BLOCK)
        lse = tl.load(lse_ptr + row)
        g_lp = tl.load(g_lp_ptr + row)
        target = tl.load(targets_ptr + row)
        if WITH_ENT:
            g_ent = tl.load(g_ent_ptr + row)
            mean_z = lse - tl.load(ent_ptr + row)  # sum_i p_i z_i
        for off in range(0, vocab, BLOCK):
            cols = off + lanes
            valid = cols < vocab
            z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp
            p = tl.exp(z - lse)
            g = tl.where(cols == target, g_lp, 0.0) - g_lp * p
            if WITH_ENT:
                g = g - g_ent * p * (z - mean_z)
            tl.store(out + cols, (g * inv_temp).to(grad_ptr.dtype.element_ty), mask=valid)

    return {"forward": forward_kernel, "backward": backward_kernel}


class _FusedTokenLogprobs(torch.autograd.Function):
    """``(logits (m v), targets (m), temperature) -> (logprobs (m), entropy (m))`` in float32."""

    BLOCK = 4096

    @staticmethod
    def forward(ctx, logits, targets, temperature):
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        m, vocab = logits.shape
        kernels = _logprob_kernels()
        lp, ent, lse = (torch.empty(m, dtype=torch.float32, device=logits.device) for _ in range(3))
        if m:
            kernels["forward"][(m,)](logits, logits.stride(0), vocab, targets, 1.0 / temperature, lp, ent, lse, BLOCK=_FusedTokenLogprobs.BLOCK, num_warps=8)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature = temperature
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        m, vocab = logits.shape
        grad = torch.empty_like(logits)
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
        with_ent = g_ent is not None
        g_ent = g_ent.float().contiguous() if with_ent else g_lp
        if m:
            _logprob_kernels()["backward"][(m,)](
                logits, logits.stride(0), vocab, targets, 1.0 / ctx.temperature, lse, ent, g_lp, g_ent, grad, grad.stride(0),
                WITH_ENT=with_ent, BLOCK=_FusedTokenLogprobs.BLOCK, num_warps=8,
            )
        return grad, None, None


def _fast_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """:func:`token_logprobs` through the Triton kernels when they apply, else the torch one."""
    if USE_FUSED_LOGPROBS and logits.is_cuda and logits.dim() == 2 and _logprob_kernels() is not None:
        lp, ent = _FusedTokenLogprobs.apply(logits, targets.contiguous(), float(temperature))
        return lp, (ent if with_entropy else None)
    return token_logprobs(logits, targets, temperature=temperature, with_entropy=with_entropy)


def _check_inputs(prompt_ids, prompt_mask, response_ids, response_mask, vocab: int | None = None) -> None:
    """Check the batch layout the forward relies on: ``(b p)`` / ``(b t)`` shapes, at least one
    prompt token per row, left-padded prompt masks, right-padded response masks and, when
    ``vocab`` (the model's embedding rows) is given, every prompt and response id under its mask
    in ``[0, vocab)``. Each row's last response token is only a target (the drop-last layout
    never embeds it), so the embedding would not catch a bad one there: on CUDA the fused
    log-prob kernel would read past the logits row. All of it is one stacked reduction and one
    host sync; the error paths read more."""
    if prompt_ids.shape != prompt_mask.shape or prompt_ids.dim() != 2:
        raise ValueError(
            f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} must both be (b p)"
        )
    if response_ids.shape != response_mask.shape or response_ids.dim() != 2:
        raise ValueError(
            f"response_ids {tuple(response_ids.shape)} and response_mask {tuple(response_mask.shape)} must both be (b t)"
        )
    if prompt_ids.shape[0] != response_ids.shape[0]:
        raise ValueError(f"prompt_ids has {prompt_ids.shape[0]} rows but response_ids has {response_ids.shape[0]}")
    prompt_mask, response_mask = prompt_mask.bool(), response_mask.bool()
    # One host sync per call: cheap next to a forward, and a wrong layout silently misaligns tokens.
    bad = torch.stack(
        [
            (~prompt_mask[:, -1]).any() if prompt_mask.shape[1] else torch.tensor(True, device=prompt_mask.device),
            (prompt_mask[:, :-1] & ~prompt_mask[:, 1:]).any(),
            (response_mask[:, 1:] & ~response_mask[:, :-1]).any(),
            *(((ids < 0) | (ids >= vocab)).logical_and_(mask).any() for ids, mask in ((prompt_ids, prompt_mask), (response_ids, response_mask)) if vocab is not None),
        ]
    ).tolist()
    if bad[0]:
        raise ValueError(
            "prompt_mask: every row needs at least one prompt token, LEFT-padded (prompt_mask[:, -1] all True); "
            "the first response token is predicted from the last prompt token"
        )
    if bad[1]:
        raise ValueError("prompt_mask is not left-padded (a pad follows a real token); build batches with rlkit.make_batch")
    if bad[2]:
        raise ValueError("response_mask is not right-padded (a real token follows a pad); build batches with rlkit.make_batch")
    for name, ids, mask, flagged in zip(("prompt_ids", "response_ids"), (prompt_ids, response_ids), (prompt_mask, response_mask), bad[3:]):
        if flagged:
            where = (((ids < 0) | (ids >= vocab)) & mask).nonzero()[0].tolist()
            raise ValueError(
                f"{name} holds token id {int(ids[where[0], where[1]])} at row {where[0]}, column {where[1]}, outside the model's "
                f"vocabulary [0, {vocab}) (its input embedding rows); were the ids made by another tokenizer than the model's?"
            )


@dataclass
class ResponseView:
    """Where a batch's response tokens sit in the model input: the packing (or shared-prompt)
    layout, the response tokens in row-major order (``targets``) and their flat positions in the
    ``(b t)`` output (``scatter_index``).

    Built by :func:`response_view` from the masks alone. Built from CPU tensors (a Batch lives on
    the CPU) it costs the device nothing: every size the layout needs is read on the host, and
    :meth:`to` moves its tensors through pinned memory without waiting for the device. A
    log-prob pass given a view therefore never synchronises with the GPU, so the host can queue
    the next pass, or score rewards, while the GPU works."""

    kind: str  # "shared", "packed" (varlen attention or transformers' packed mask), "padded"
    view: Any  # SharedPrefix | rlkit.batch.Packed | None (padded)
    varlen: bool  # packed: through varlen flash attention
    targets: torch.Tensor  # (m) response tokens, row-major over response_mask
    scatter_index: torch.Tensor  # (m) their flat positions in (b t)
    shape: tuple[int, int]  # (b, t)

    def to(self, device: torch.device | str) -> "ResponseView":
        device = torch.device(device)

        def move(x):
            return to_device(x, device) if isinstance(x, torch.Tensor) else x

        view = self.view
        if view is not None:
            view = type(view)(**{f: move(getattr(view, f)) for f in view.__dataclass_fields__})
        return ResponseView(self.kind, view, self.varlen, move(self.targets), move(self.scatter_index), self.shape)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; from the CPU to CUDA through pinned memory without a host sync (a
    plain ``.to`` from pageable memory waits for the whole stream)."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def response_view(
    backbone: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    device: torch.device | str | None = None,
    layout: str = "packed",
    share_prompts: bool | str | None = None,
) -> ResponseView:
    """The :class:`ResponseView` of a batch for ``backbone`` computing on ``device`` (default:
    where the tensors are). Checks the masks (left-padded prompts, right-padded responses) and
    picks the layout the way :func:`response_hidden` does; built where the tensors are, then
    moved to ``device``. Also checks that the ids under the masks lie in the backbone's
    vocabulary (its input embedding rows).

    ``layout="packed"`` packs only model types known to honour packed rows
    (:data:`PACKED_MODEL_TYPES`); for any other the view is the padded one (``kind="padded"``),
    which gives every causal LM its exact log-probs, so the choice is silently correct. Shared
    prompts and varlen attention further need :func:`_full_attention_packed` (e.g. a sliding
    window no shorter than the batch's longest row)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _check_inputs(prompt_ids, prompt_mask, response_ids, response_mask, input_vocab(backbone))
    device = torch.device(device) if device is not None else prompt_ids.device
    prompt_mask, response_mask = prompt_mask.bool(), response_mask.bool()
    targets = response_ids[response_mask]
    scatter_index = response_mask.flatten().nonzero().flatten()
    shape = tuple(response_mask.shape)
    out = ResponseView("padded", None, False, targets, scatter_index, shape)
    if layout == "packed" and packs_rows(backbone):
        config = getattr(backbone, "config", None)
        attn = getattr(config, "_attn_implementation", "sdpa")
        if attn not in PACKED_ATTENTION:
            raise ValueError(
                f"layout='packed' needs an attention implementation that reads packed position_ids "
                f"({', '.join(PACKED_ATTENTION)}); the model uses {attn!r}: pass layout='padded'"
            )
        share = SHARE_PROMPTS if share_prompts is None else share_prompts
        if share == "auto":
            share = shares_prompts(device)
        # a sliding window blocks rlkit's attention only where it is shorter than a row: read the
        # rows' lengths only for a model with a window (no host sync otherwise)
        longest = _longest_row(prompt_mask, response_mask, _sliding_window(config))
        view = shared_prefix(prompt_ids, prompt_mask, response_ids, response_mask) if share and _full_attention_packed(backbone, longest) else None
        if view is not None:
            out = ResponseView("shared", view, True, targets, scatter_index, shape)
        else:
            view = packed({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids, "response_mask": response_mask}, drop_last=True)
            varlen = _can_use_varlen(backbone, device, view.input_ids.numel(), longest)
            out = ResponseView("packed", view, varlen, targets, scatter_index, shape)
    return out.to(device)


def response_hidden(
    backbone: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    layout: str = "packed",
    share_prompts: bool | str | None = None,
    view: ResponseView | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states at the positions that predict response tokens.

    ``share_prompts`` (None: the module flag :data:`SHARE_PROMPTS`): in the packed layout,
    consecutive rows with the same prompt share one copy of it (:class:`SharedPrefix`).

    Returns ``hidden (m d)`` and ``targets (m)`` (the response tokens, row-major over
    ``response_mask``). ``layout="packed"``: padding dropped, rows concatenated into one ``(1 n)``
    sequence with ``position_ids`` restarting per row; transformers turns restarting positions
    into a block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``) when no
    attention mask is given; on CUDA varlen flash attention over ``cu_seqlens`` is used instead
    (no ``(n n)`` mask, see the module docstring). Only for the model types of
    :data:`PACKED_MODEL_TYPES`: any other model gets the padded layout instead (exact, silently;
    :func:`response_view`). ``layout="padded"``: the ``(b p+t)`` batch with its attention mask,
    ``position_ids = cumsum(mask) - 1`` and id 0 at the pads (whatever the pad id).

    ``view``: the batch's :class:`ResponseView`, built beforehand (e.g. on the CPU, see
    :func:`response_view`); ``layout`` and ``share_prompts`` are then the view's.
    """
    if view is None:
        view = response_view(backbone, prompt_ids, prompt_mask, response_ids, response_mask, layout=layout, share_prompts=share_prompts)
    if view.kind == "shared":
        v = view.view
        inputs = dict(input_ids=v.input_ids[None], position_ids=v.position_ids[None], attention_mask=None, use_cache=False)
        with _attention_implementation(backbone.config, _SHARED_NAME):
            out = backbone(**inputs, rlkit_shared_prefix=v)
        return _take_rows(out.last_hidden_state[0], v.predict_index), view.targets
    if view.kind == "packed":
        v = view.view
        inputs = dict(input_ids=v.input_ids[None], position_ids=v.position_ids[None], attention_mask=None, use_cache=False)
        if view.varlen:
            cu = v.cu_seqlens.to(torch.int32)
            lengths = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=v.max_seqlen, max_length_k=v.max_seqlen)
            with _attention_implementation(backbone.config, _VARLEN_NAME):
                out = backbone(**inputs, **lengths)
        else:
            out = backbone(**inputs)
        hidden = out.last_hidden_state[0]
        return _take_rows(hidden, v.predict_index), view.targets
    prompt_mask, response_mask = prompt_mask.bool(), response_mask.bool()
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    # pads are embedded too (masked out of attention): id 0 there, whatever the pad id (make_batch
    # takes any, e.g. -1, which the embedding would index out of range)
    ids = torch.cat([prompt_ids, response_ids], dim=1).masked_fill(~mask, 0)
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = backbone(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids, use_cache=False)
    p, t = prompt_ids.shape[1], response_ids.shape[1]
    hidden = out.last_hidden_state[:, p - 1 : p + t - 1]
    return hidden[response_mask], view.targets


def _check_temperature(temperature) -> None:
    """Raise ``ValueError`` unless ``temperature`` is a number > 0 (NaN fails); a tensor passes
    unread (its value would cost a host sync)."""
    if isinstance(temperature, torch.Tensor):
        return
    if not (is_real(temperature) and temperature > 0):
        raise ValueError(
            f"temperature must be > 0 for log-probs, got {temperature!r}; greedy rollouts report temperature-1 "
            "log-probs, so pass temperature=1.0"
        )


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[target] and the entropy, in float32.

    ``logits (m v)``, ``targets (m)``. Entropy (verl): ``H = logsumexp(z) - sum_v softmax(z)_v z_v``.
    ``temperature``: a number > 0 (``ValueError`` otherwise; a tensor is taken as given, reading
    it would wait for its device).
    """
    _check_temperature(temperature)
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if with_entropy:
        p = torch.softmax(z, dim=-1)
        # a -inf logit (a masked vocabulary entry) has p = 0: its term is 0, not 0 * -inf = NaN
        entropy = lse - (p * torch.where(p > 0, z, torch.zeros_like(z))).sum(-1)
    else:
        entropy = None
    return logprobs, entropy


#: chunks with at least this many logits (rows x vocabulary) are checkpointed under autograd;
#: smaller ones keep their logits for the backward (4M: 16 MB in float32)
CHECKPOINT_MIN_LOGITS = 1 << 22

#: whether a forward under autograd keeps every chunk's logits for the backward instead of
#: checkpointing the large chunks (recomputing the head in the backward). Both give the same values
#: and gradients, bit for bit; keeping trades memory for one vocabulary projection less.
#: ``"auto"`` keeps them on CUDA when the call's logits (``m x vocab`` in the head's dtype) take at
#: most :data:`KEEP_LOGITS_FRACTION` of the memory the device has left (free plus what the
#: caching allocator holds unused), and follows :data:`CHECKPOINT_MIN_LOGITS` elsewhere; ``True``
#: / ``False`` force it. Under FSDP2 each rank decides for itself: the head belongs to the root
#: unit, whose parameters stay gathered through the backward, so ranks that decide differently
#: issue the same collectives (``tests/test_pipeline.py``).
KEEP_LOGITS: bool | str = "auto"
KEEP_LOGITS_FRACTION = 0.25


def _device_bytes_left(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can still get: the driver's free memory plus what
    torch's caching allocator has reserved and not handed out. None off CUDA. A driver query and
    the allocator's counters: no wait for the GPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def keeps_logits(tokens: int, vocab: int | None, itemsize: int, device: torch.device) -> bool:
    """What :data:`KEEP_LOGITS` decides for a forward under autograd over ``tokens`` predicting
    positions: True keeps every chunk's logits for the backward, False checkpoints the chunks of
    at least :data:`CHECKPOINT_MIN_LOGITS` logits."""
    if KEEP_LOGITS != "auto":
        return bool(KEEP_LOGITS)
    if vocab is None:
        return False
    left = _device_bytes_left(torch.device(device))
    return left is not None and tokens * vocab * itemsize <= KEEP_LOGITS_FRACTION * left


def _chunked(fn: Callable, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, vocab: int | None = None,
             itemsize: int | None = None) -> list:
    """Apply ``fn(hidden_chunk, target_chunk)`` over row chunks; under autograd checkpoint each
    chunk of at least :data:`CHECKPOINT_MIN_LOGITS` logits (every chunk when ``vocab`` is None),
    unless :func:`keeps_logits` says the call keeps them all (``itemsize``: bytes per logit,
    default the hidden states')."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    grad = torch.is_grad_enabled() and hidden.requires_grad
    keep = grad and keeps_logits(hidden.shape[0], vocab, itemsize or hidden.element_size(), hidden.device)
    outs = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        big = vocab is None or h.shape[0] * vocab >= CHECKPOINT_MIN_LOGITS
        outs.append(checkpoint(fn, h, y, use_reentrant=False) if grad and big and not keep else fn(h, y))
    return outs


def _scatter(values: torch.Tensor, view: ResponseView) -> torch.Tensor:
    """``(m)`` per-response-token values -> ``(b t)`` float32, 0 elsewhere (an index copy: a
    boolean-mask scatter would read the mask's count on the host)."""
    b, t = view.shape
    # copied into the (b t) tensor's flat view, so the result is no view itself: FSDP2 warns at every
    # forward whose module returns a view (an in-place op on one would skip its pre-backward hook)
    out = torch.zeros(b, t, dtype=torch.float32, device=values.device)
    out.view(-1).index_copy_(0, view.scatter_index, values.float())
    return out


def logit_transform(config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The elementwise map the model's forward applies to ``lm_head``'s logits
    (:data:`LOGIT_TRANSFORMS`), as a function of a logits chunk, or None where there is none
    (a scale of 1.0 is none). The same operations in the same order and dtype as transformers'
    forward, so the log-probs are those of ``log_softmax(model(ids).logits / temperature)``.

    ``ValueError`` for a model type not in :data:`LOGIT_TRANSFORMS` that sets one of the fields
    (what its forward does with it is not known here), and for a value that is not a positive
    finite number."""
    model_type = getattr(config, "model_type", None)
    known = LOGIT_TRANSFORMS.get(model_type)
    cap_field = "final_logit_softcapping"
    found = None
    for name in _LOGIT_FIELDS:
        value = getattr(config, name, None)
        if value is None or (name != cap_field and is_real(value) and float(value) == 1.0):
            continue  # transformers' forward: no cap where None; a scale of 1 changes nothing
        if known is None or known[0] != name:
            checked = sorted(t for t, (field, _) in LOGIT_TRANSFORMS.items() if field == name)
            raise ValueError(
                f"LogprobModule: the model's config (model_type {model_type!r}) sets {name}={value!r}, which its "
                f"forward applies around lm_head; rlkit applies {name} for the model types whose forward it has "
                f"checked ({', '.join(checked)}), not for {model_type!r} (the same field means different maps in "
                "different models). Fix: if this model's forward maps lm_head's logits z elementwise, add "
                f"{model_type!r}: ({name!r}, 'softcap' | 'divide' | 'multiply') to "
                "rlkit.models.logprobs.LOGIT_TRANSFORMS after checking it against the model's own logits"
            )
        if not (is_real(value) and 0 < value < float("inf")):
            none = "None" if name == cap_field else "1.0"
            raise ValueError(
                f"LogprobModule: the model's config sets {name}={value!r}, which rlkit applies only as a positive "
                f"finite number; set config.{name} to the checkpoint's value (or {none} for none)"
            )
        found = float(value)
    if found is None:
        return None
    kind = known[1]
    if kind == "softcap":
        def softcap(z: torch.Tensor, cap: float = found) -> torch.Tensor:
            return torch.tanh(z / cap) * cap  # the forward's order (z / cap, tanh, * cap): its logits bit for bit
        return softcap
    if kind == "divide":
        return lambda z, s=found: z / s
    return lambda z, s=found: z * s


class LogprobModule(nn.Module):
    """``forward(prompt_ids, prompt_mask, response_ids, response_mask) -> (logprobs (b t), entropy (b t) | None)``.

    ``logprobs[i, j] = log softmax(f(lm_head(h[i, pos(j) - 1])) / temperature)[response_ids[i, j]]``,
    0 where masked, where ``f`` is the elementwise map the model's own forward applies to its
    logits (Gemma 2's soft-capping, Granite's and Cohere's scales: :func:`logit_transform`; the
    identity for most models), applied per chunk before the log-softmax on every path. Wraps a
    transformers causal LM (``model.base_model`` is the backbone, ``model.get_output_embeddings()``
    the head) so the whole computation is one module call.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        # checked before the head: a model refused here names its logit field, not a missing head
        self.logit_transform = logit_transform(getattr(model, "config", None))
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None:
            raise ValueError(
                f"LogprobModule: {type(model).__name__} has no output embedding (lm_head); pass a causal LM "
                "(e.g. from rlkit.models.tiny or load_model)"
            )
        self.model = model

    def forward(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        chunk_tokens: int = 4096,
        layout: str = "packed",
        view: ResponseView | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _check_temperature(temperature)
        backbone = self.model.base_model
        if view is None:
            view = response_view(backbone, prompt_ids, prompt_mask, response_ids, response_mask, layout=layout)
        hidden, targets = response_hidden(backbone, prompt_ids, prompt_mask, response_ids, response_mask, view=view)
        head = self.model.get_output_embeddings()
        transform = self.logit_transform

        def fn(h: torch.Tensor, y: torch.Tensor):
            logits = head(h)
            if transform is not None:  # inside the chunk: checkpointed and recomputed with it
                logits = transform(logits)
            logprobs, entropy = _fast_token_logprobs(logits, y, temperature, with_entropy)
            return (logprobs, entropy) if with_entropy else (logprobs,)

        weight = getattr(head, "weight", None)
        chunks = _chunked(fn, hidden, targets, chunk_tokens, vocab=getattr(head, "out_features", None),
                          itemsize=weight.element_size() if isinstance(weight, torch.Tensor) else None)
        if not chunks:  # no response token at all
            zeros = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
            if torch.is_grad_enabled() and hidden.requires_grad:
                # still part of the model's graph (zero gradients): an update's micro-batch of rows
                # without response tokens must run its backward like the others, or its loss has no
                # grad_fn, and under FSDP the other ranks would wait in their gradient collectives
                zeros = zeros + head(hidden).sum().float() * 0.0
            return zeros, (zeros.clone() if with_entropy else None)
        logprobs = _scatter(torch.cat([c[0] for c in chunks]), view)
        entropy = _scatter(torch.cat([c[1] for c in chunks]), view) if with_entropy else None
        return logprobs, entropy


class ValueModule(nn.Module):
    """``forward(prompt_ids, prompt_mask, response_ids, response_mask) -> values (b t)`` for a critic.

    ``values[i, j] = score(dropout(h[i, pos(j) - 1]))``: the value at the position that
    predicts response token ``j`` (verl's ``values = logits[:, -t - 1 : -1]``), 0 where masked.
    The critic is a ``*ForTokenClassification`` model with ``num_labels=1`` (see
    :func:`rlkit.models.critic`).
    """

    def __init__(self, critic: nn.Module):
        super().__init__()
        if not isinstance(getattr(critic, "score", None), nn.Module):
            raise ValueError(
                f"ValueModule: {type(critic).__name__} has no 'score' head; build the value model with rlkit.models.critic(actor)"
            )
        if critic.score.out_features != 1:
            raise ValueError(f"ValueModule: the critic's score head has {critic.score.out_features} outputs; a value model needs num_labels=1")
        self.critic = critic

    def forward(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        layout: str = "packed",
        view: ResponseView | None = None,
    ) -> torch.Tensor:
        backbone = self.critic.base_model
        if view is None:
            view = response_view(backbone, prompt_ids, prompt_mask, response_ids, response_mask, layout=layout)
        hidden, _ = response_hidden(backbone, prompt_ids, prompt_mask, response_ids, response_mask, view=view)
        dropout = getattr(self.critic, "dropout", None)
        if isinstance(dropout, nn.Module):
            hidden = dropout(hidden)
        values = self.critic.score(hidden).squeeze(-1)
        return _scatter(values, view)


def response_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 4096,
    layout: str = "packed",
    view: ResponseView | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``(b t)`` f32 of the response tokens under ``model`` (and entropies if asked).

    ``model``: a causal LM, or a :class:`LogprobModule` (possibly FSDP-wrapped) to call as is.
    Gradients flow to the model's parameters. See :class:`LogprobModule` for the formula.
    ``view``: the batch's :class:`ResponseView` built beforehand (:func:`response_view`, e.g.
    from the CPU copy of the masks: then the call never waits for the GPU).
    """
    from rlkit.models.compile import eager_fallback

    module = model if isinstance(model, LogprobModule) else LogprobModule(model)
    return eager_fallback(module, lambda: module(
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        temperature=temperature,
        with_entropy=with_entropy,
        chunk_tokens=chunk_tokens,
        layout=layout,
        view=view,
    ))


def values_for_response(
    critic: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    layout: str = "packed",
    view: ResponseView | None = None,
) -> torch.Tensor:
    """Critic values ``(b t)`` f32 aligned with the response tokens (0 where masked)."""
    from rlkit.models.compile import eager_fallback

    module = critic if isinstance(critic, ValueModule) else ValueModule(critic)
    return eager_fallback(module, lambda: module(prompt_ids, prompt_mask, response_ids, response_mask, layout=layout, view=view))


def backbone_of(model: nn.Module) -> nn.Module:
    """The transformer body that :func:`response_view` decides a layout for: of a causal LM, a
    critic, or their :class:`LogprobModule` / :class:`ValueModule` wrappers."""
    if isinstance(model, LogprobModule):
        model = model.model
    elif isinstance(model, ValueModule):
        model = model.critic
    return model.base_model
