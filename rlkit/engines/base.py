"""The rollout-engine interface: token ids in, token ids + behaviour log-probs out.

Every engine (the built-in torch engine, transformers' ``generate``, vLLM) returns the same
:class:`Generation`, so ``rollout()`` and everything downstream never care which one ran.

Row order is prompt-major: row ``i * n + j`` is the ``j``-th sample of prompt ``i``.
"""
from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

import torch

from rlkit._checks import check_context, check_switch, int_at_least, is_int, is_real


#: the smallest temperature > 0 SamplingParams takes (0 is greedy)
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding.

    ``top_k <= 0`` and ``top_p = 1`` disable those filters (``top_p`` is in ``(0, 1]``).
    ``stop_token_ids``: generation of a row ends after it samples one of them (the stop token is
    part of the response and of its mask). ``ignore_stop`` forces exactly ``max_new_tokens``
    tokens (benchmarks).
    """

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_stop: bool = False

    def __post_init__(self):
        int_at_least(self.n, "SamplingParams.n")
        int_at_least(self.max_new_tokens, "SamplingParams.max_new_tokens")
        if not is_int(self.top_k):
            raise ValueError(f"SamplingParams.top_k must be an int (<= 0: no top-k filter), got {self.top_k!r}")
        if not is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # logits / 1e-38 overflow float32: NaN log-probs and tokens that were not the argmax
            raise ValueError(f"SamplingParams.temperature={self.temperature!r} is below {MIN_TEMPERATURE} (the logits would "
                             "overflow when divided by it); use temperature=0 for greedy decoding")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be a number in (0, 1] (1: no top-p filter), got {self.top_p!r}")
        # a truthy string such as "no" ignored every stop token silently; a numpy bool (a config read
        # with numpy) is one, stored as a plain bool
        object.__setattr__(self, "ignore_stop", check_switch(self.ignore_stop, "SamplingParams.ignore_stop",
                                                             "True: exactly max_new_tokens per response, stop tokens ignored"))
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable) or not all(is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"SamplingParams.stop_token_ids must be a sequence of token ids (ints >= 0), got {stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))


@dataclass
class Generation:
    """What an engine returns, for ``B`` prompts x ``n`` samples = ``b`` rows.

    Shapes (einops names): ``b = B * n``, ``t`` = longest response in this call.
    - response_ids   (b t) long, right-padded with ``pad_token_id``
    - response_mask  (b t) bool, True on generated tokens (including the stop token)
    - logprobs       (b t) float32, log-prob of each sampled token under the distribution it
                     was sampled from (after temperature / top-k / top-p); 0 where masked.
                     Greedy decoding reports the plain log-softmax (temperature 1).
    - truncated      (b)   bool, True where the row hit ``max_new_tokens`` without a stop token
    - prompt_index   (b)   long, which input prompt the row came from
    """

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    truncated: torch.Tensor
    prompt_index: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """A rollout engine. Implementations: ``TorchEngine``, ``HFEngine``, ``VLLMEngine``.

    An engine may also name the keys its ``load_weights`` report has, as a class attribute
    ``sync_keys`` (not part of the protocol; default ``("bytes", "seconds")``): a rollout that
    moves no weights logs zeros under them, so every step carries the same ``sync/*`` keys.
    """

    #: incremented by ``load_weights``; reported in every Batch as ``policy_version``
    policy_version: int

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
    ) -> Generation:
        """Sample ``params.n`` responses per prompt. ``prompt_ids``: unpadded token ids."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]], *, version: int) -> dict[str, float]:
        """Take new weights (Hugging Face parameter names); returns ``{"bytes": .., "seconds": ..}``.

        Engines that read the training parameters' own storage may make this a no-op apart from
        bumping ``policy_version``.
        """
        ...


def pick_pad_token_id(config, pad_token_id: int | None = None, vocab: int | None = None) -> int:
    """The id engines pad with: the given one, else the config's pad, else its (first) eos, else 0.

    ``vocab``: the model's input vocabulary (embedding rows; default ``config.vocab_size``). A
    config id outside ``[0, vocab)`` is skipped: e.g. ``pad_token_id=-1``, as early Llama
    conversions ship, crashed the engine's embedding with a bare ``IndexError``; pads are masked,
    so any id in the vocabulary does. An explicitly given ``pad_token_id`` outside it is refused
    with a ``ValueError`` naming the argument."""
    if vocab is None:
        vocab = getattr(config, "vocab_size", None)
        vocab = vocab if is_int(vocab) and vocab > 0 else None

    def usable(value) -> bool:
        return is_int(value) and value >= 0 and (vocab is None or value < vocab)

    if pad_token_id is not None:
        if not is_int(pad_token_id) and not isinstance(pad_token_id, bool):
            with contextlib.suppress(TypeError):
                pad_token_id = operator.index(pad_token_id)  # e.g. a 0-d integer tensor
        if not usable(pad_token_id):
            where = f"[0, {vocab})" if vocab is not None else "the ids >= 0"
            raise ValueError(
                f"pad_token_id={pad_token_id!r} is not a token id of the model's vocabulary {where}; pass an id in it "
                "(pads are masked, so any id works, e.g. the tokenizer's pad or eos id) or None to take the config's"
            )
        return int(pad_token_id)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        for candidate in value if isinstance(value, (list, tuple)) else (value,):
            if usable(candidate):
                return int(candidate)
    return 0


def check_engine_context(model, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, where: str) -> None:
    """Refuse a call whose longest prompt plus ``max_new_tokens`` passes ``model``'s context
    (``config.max_position_embeddings``), as :func:`rlkit.rollout` does: an engine called directly
    had generated from positions the model never learned without a word."""
    if not prompt_ids:
        return
    i = max(range(len(prompt_ids)), key=lambda k: len(prompt_ids[k]))
    check_context(model, len(prompt_ids[i]) + params.max_new_tokens,
                  f"{where}: prompt {i} ({len(prompt_ids[i])} tokens) with max_new_tokens={params.max_new_tokens}",
                  "shorten the prompt or lower max_new_tokens")


def left_pad_prompts(prompts: Sequence[Sequence[int]], pad_token_id: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (b p) long, mask (b p) bool)``: the prompts left-padded to the longest, refused
    (naming the prompt) when empty or holding ids outside ``[0, vocab)``: every engine's input check."""
    if len(prompts) == 0:
        raise ValueError("generate: prompt_ids is empty; pass at least one prompt")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, prompt in enumerate(prompts):
        row = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not row:
            raise ValueError(f"generate: prompt {i} is empty; every prompt needs at least one token (e.g. a BOS token)")
        if not all(is_int(t) for t in row):
            # a float id (14.7) was truncated to 14 by torch.tensor: silently another prompt
            bad = next(t for t in row if not is_int(t))
            raise ValueError(f"generate: prompt {i} holds {bad!r}, not an integer token id; pass ints (e.g. the "
                             "tokenizer's input_ids as a list, or a long tensor's .tolist())")
        if min(row) < 0 or max(row) >= vocab:
            raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab}): {row[:10]}...")
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = True
    return ids, mask
