"""Per-token log-probs, entropies and values of responses under a model (the training forward).

Alignment (as verl): the log-prob of response token ``j`` comes from the logits at the position
of the token before it (the last prompt token for ``j = 0``). Prompts are LEFT-padded and
responses RIGHT-padded (the Batch layout); outputs are ``(b t)`` float32, 0 where
``response_mask`` is False.

Memory: the backbone runs to hidden states once; the vocabulary projection runs only on the
``m = response_mask.sum()`` predicting positions, ``chunk_tokens`` rows at a time, in float32
per chunk. Under autograd each chunk is checkpointed (recomputed in backward), so neither the
forward nor the saved activations ever hold ``(m, vocab)`` float32 logits.

FSDP2: ``fully_shard`` unshards parameters in module forward hooks, so all the work happens
inside :class:`LogprobModule.forward` / :class:`ValueModule.forward`. Shard the wrapper (the
root), e.g. ``fully_shard(layer) for each layer; fully_shard(LogprobModule(model))``; calling
``model.model`` / ``model.lm_head`` from outside a module call would see sharded parameters.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlkit.batch import packed

LAYOUTS = ("packed", "padded")
#: attention implementations whose masks transformers derives from packed ``position_ids``
PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
#: config fields that change logits after ``lm_head``; this module does not reproduce them
_UNSUPPORTED_LOGIT_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _check_inputs(prompt_ids, prompt_mask, response_ids, response_mask) -> None:
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


def response_hidden(
    backbone: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    layout: str = "packed",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states at the positions that predict response tokens.

    Returns ``hidden (m d)`` and ``targets (m)`` (the response tokens, row-major over
    ``response_mask``). ``layout="packed"``: padding dropped, rows concatenated into one ``(1 n)``
    sequence with ``position_ids`` restarting per row; transformers turns restarting positions
    into a block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``) when no
    attention mask is given. ``layout="padded"``: the ``(b p+t)`` batch with its attention mask
    and ``position_ids = cumsum(mask) - 1``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    prompt_mask, response_mask = prompt_mask.bool(), response_mask.bool()
    if layout == "packed":
        attn = getattr(getattr(backbone, "config", None), "_attn_implementation", "sdpa")
        if attn not in PACKED_ATTENTION:
            raise ValueError(
                f"layout='packed' needs an attention implementation that reads packed position_ids "
                f"({', '.join(PACKED_ATTENTION)}); the model uses {attn!r}: pass layout='padded'"
            )
        view = packed(
            {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids, "response_mask": response_mask}
        )
        out = backbone(
            input_ids=view.input_ids[None], position_ids=view.position_ids[None], attention_mask=None, use_cache=False
        )
        hidden = out.last_hidden_state[0]
        return hidden[view.response_index - 1], view.input_ids[view.response_index]
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = backbone(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids, use_cache=False)
    p, t = prompt_ids.shape[1], response_ids.shape[1]
    hidden = out.last_hidden_state[:, p - 1 : p + t - 1]
    return hidden[response_mask], response_ids[response_mask]


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[target] and the entropy, in float32.

    ``logits (m v)``, ``targets (m)``. Entropy (verl): ``H = logsumexp(z) - sum_v softmax(z)_v z_v``.
    """
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None
    return logprobs, entropy


def _chunked(fn: Callable, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> list:
    """Apply ``fn(hidden_chunk, target_chunk)`` over row chunks; checkpoint each under autograd."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    grad = torch.is_grad_enabled() and hidden.requires_grad
    outs = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        outs.append(checkpoint(fn, h, y, use_reentrant=False) if grad else fn(h, y))
    return outs


def _scatter(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=values.device)
    return out.masked_scatter(response_mask, values.float())


class LogprobModule(nn.Module):
    """``forward(prompt_ids, prompt_mask, response_ids, response_mask) -> (logprobs (b t), entropy (b t) | None)``.

    ``logprobs[i, j] = log softmax(lm_head(h[i, pos(j) - 1]) / temperature)[response_ids[i, j]]``,
    0 where masked. Wraps a transformers causal LM (``model.base_model`` is the backbone,
    ``model.get_output_embeddings()`` the head) so the whole computation is one module call.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        config = getattr(model, "config", None)
        for name in _UNSUPPORTED_LOGIT_FIELDS:
            if getattr(config, name, None) not in (None, 1.0):
                raise ValueError(
                    f"LogprobModule: the model's config sets {name}={getattr(config, name)!r}, which changes logits "
                    "after lm_head; rlkit's chunked log-probs do not apply it yet"
                )
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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not temperature > 0:
            raise ValueError(
                f"temperature must be > 0 for log-probs, got {temperature}; greedy rollouts report temperature-1 "
                "log-probs, so pass temperature=1.0"
            )
        _check_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
        hidden, targets = response_hidden(
            self.model.base_model, prompt_ids, prompt_mask, response_ids, response_mask, layout
        )
        head = self.model.get_output_embeddings()

        def fn(h: torch.Tensor, y: torch.Tensor):
            logprobs, entropy = token_logprobs(head(h), y, temperature=temperature, with_entropy=with_entropy)
            return (logprobs, entropy) if with_entropy else (logprobs,)

        chunks = _chunked(fn, hidden, targets, chunk_tokens)
        mask = response_mask.bool()
        if not chunks:  # no response token at all
            zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
            return zeros, (zeros.clone() if with_entropy else None)
        logprobs = _scatter(torch.cat([c[0] for c in chunks]), mask)
        entropy = _scatter(torch.cat([c[1] for c in chunks]), mask) if with_entropy else None
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
    ) -> torch.Tensor:
        _check_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
        hidden, _ = response_hidden(self.critic.base_model, prompt_ids, prompt_mask, response_ids, response_mask, layout)
        dropout = getattr(self.critic, "dropout", None)
        if isinstance(dropout, nn.Module):
            hidden = dropout(hidden)
        values = self.critic.score(hidden).squeeze(-1)
        return _scatter(values, response_mask.bool())


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``(b t)`` f32 of the response tokens under ``model`` (and entropies if asked).

    ``model``: a causal LM, or a :class:`LogprobModule` (possibly FSDP-wrapped) to call as is.
    Gradients flow to the model's parameters. See :class:`LogprobModule` for the formula.
    """
    module = model if isinstance(model, LogprobModule) else LogprobModule(model)
    return module(
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        temperature=temperature,
        with_entropy=with_entropy,
        chunk_tokens=chunk_tokens,
        layout=layout,
    )


def values_for_response(
    critic: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    layout: str = "packed",
) -> torch.Tensor:
    """Critic values ``(b t)`` f32 aligned with the response tokens (0 where masked)."""
    module = critic if isinstance(critic, ValueModule) else ValueModule(critic)
    return module(prompt_ids, prompt_mask, response_ids, response_mask, layout=layout)
