"""Ready-made reward functions (TRL-style: ``f(completions, **columns) -> list[float]``).

They take the decoded completions and the batch's columns by name, so the same function works
with ``rk.score`` and with TRL's trainers. A completion may also be what TRL passes for a
conversational dataset, a list of messages (``[{"role": "assistant", "content": text}]``): its
last message's content is scored.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Sequence

import torch

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")
# a number written with thousands separators, whole: 1-3 digits, then groups of exactly 3, not
# inside a longer run of digits, commas or decimals ("1,234,567" but not "1,2", "12,34" or "1,234,56")
_GROUPED = re.compile(r"(?<![\d,.])\d{1,3}(?:,\d{3})+(?!\d|,\d)")


def _text(completion: Any) -> str:
    """A completion's text: a string as it is; TRL's conversational form, a list of message dicts,
    its last message's ``content`` (the assistant's reply)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict) and "content" in completion[-1]:
        content = completion[-1]["content"]
        if isinstance(content, list):  # multimodal content parts: their text
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return str(content)
    if isinstance(completion, dict) and "content" in completion:
        return str(completion["content"])
    return str(completion)


def _norm(x: Any) -> str:
    """``x`` as stripped text, the thousands separators of its numbers removed (other commas kept)."""
    return _GROUPED.sub(lambda m: m.group(0).replace(",", ""), str(x).strip())


def exact_match(completions: Sequence[str], answer: Sequence[Any], **_) -> list[float]:
    """1.0 where the completion, stripped, equals the answer, else 0. Thousands separators in
    numbers are ignored ("1,234" equals "1234"); every other comma counts ("Paris, France" is not
    "Paris France", "1,2" is not "12")."""
    return [float(_norm(_text(c)) == _norm(a)) for c, a in zip(completions, answer)]


def extract_hash_answer(text: str) -> str | None:
    """GSM8K convention: the final answer follows ``####``. Returns None when absent. Thousands
    separators are dropped ("1,234" is "1234"); any other comma stays ("1,2" is not "12"), as in
    :func:`exact_match`."""
    if "####" not in text:
        return None
    tail = text.split("####")[-1]
    match = _NUMBER.search(tail)
    return _norm(match.group(0)) if match else None


def math_answer(completions: Sequence[str], answer: Sequence[Any], **_) -> list[float]:
    """1.0 where the ``#### <answer>`` of the completion equals the reference answer.

    The reference may itself be a full GSM8K solution (its ``####`` part is used) or a number.
    Numbers compare by value, exactly ("2.0" is "2"; integers past float precision stay distinct).
    """
    out = []
    for c, a in zip(completions, answer):
        ref = extract_hash_answer(str(a)) or _norm(a)
        got = extract_hash_answer(_text(c))
        try:
            # Decimal, not float: float("12345678901234567891") == float("12345678901234567890")
            ok = got is not None and Decimal(got) == Decimal(ref)
        except (InvalidOperation, ValueError):
            ok = got is not None and got == ref
        out.append(float(ok))
    return out


def format_reward(pattern: str, *, full: bool = True, name: str | None = None):
    """A reward of 1.0 where the completion matches the regex ``pattern`` (whole text if ``full``)."""
    regex = re.compile(pattern, re.DOTALL)

    def reward(completions: Sequence[str], **_) -> list[float]:
        match = regex.fullmatch if full else regex.search
        return [float(match(_text(c).strip()) is not None) for c in completions]

    reward.__name__ = name or "format"
    return reward


_HASH_LINE = re.compile(r"####\s*" + _NUMBER.pattern)


def hash_format(completions: Sequence[str], **_) -> list[float]:
    """1.0 where the completion ends with a ``#### <number>`` answer line (GSM8K format): its last
    non-empty line is ``#### <number>`` (spaces around it allowed), else 0.0. A completion that
    goes on after its answer line (``"#### 42\nWait, ..."``) scores 0.0."""
    out = []
    for c in completions:
        lines = [line for line in _text(c).splitlines() if line.strip()]
        out.append(float(bool(lines) and _HASH_LINE.fullmatch(lines[-1].strip()) is not None))
    return out


class RewardModel:
    """A sequence classifier (``AutoModelForSequenceClassification``, 1 label) as the reward role.

    Called with the whole Batch (``score`` passes it): it scores ``prompt + response`` token ids,
    each sequence as the classifier scores it alone, unpadded. The reward model must share the
    actor's tokenizer (token in, token out); for a different tokenizer, decode and re-encode in
    your own batch-style function.

    Padding: where the classifier's config has a ``pad_token_id``, the sequences are right-padded
    with it (as TRL and the tokenizers of encoder classifiers pad), which suits both poolings
    transformers uses: an encoder (BERT, RoBERTa, DeBERTa) pools the first token, a decoder
    (Llama, Qwen2) the last token that is not ``pad_token_id``. A classifier whose config has no
    ``pad_token_id`` (transformers' decoders then refuse batches of more than one sequence) is
    taken to pool the last token, a decoder's convention: the sequences are left-padded, so the
    last column is the end of every one; an encoder classifier needs a ``pad_token_id`` in its
    config (the BERT family's configs have one).

    ``micro_batch_size``: the sequences per forward pass, a positive int.
    """

    def __init__(self, model, *, micro_batch_size: int = 64):
        from rlkit._checks import int_at_least

        int_at_least(micro_batch_size, "RewardModel: micro_batch_size", 1, " (sequences per forward pass; the default is 64)")
        self.model = model.eval()
        self.micro_batch_size = micro_batch_size
        self.__name__ = "reward_model"

    @torch.no_grad()
    def __call__(self, batch) -> torch.Tensor:
        device = next(self.model.parameters()).device
        ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
        config = getattr(self.model, "config", None)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        pad = getattr(config, "pad_token_id", None) if config is not None else None
        if pad is not None:
            # left-aligned, padded with the classifier's own pad id: position 0 is every sequence's
            # first token (an encoder's pooled one; right-aligned rows pooled a pad there), and the
            # last token that is not pad_token_id its end (a decoder's), whatever id the batch padded with
            order = torch.argsort((~mask.bool()).long(), dim=1, stable=True)
            ids, mask = ids.gather(1, order), mask.gather(1, order)
            ids = ids.masked_fill(~mask.bool(), pad)
            return self._scores(ids, mask, device, positions=False)
        # right-align the real tokens so the classifier's "last non-pad token" is the response end
        order = torch.argsort(mask.long(), dim=1, stable=True)
        ids, mask = ids.gather(1, order), mask.gather(1, order)
        # transformers' classifier pools the rightmost token that is not pad_token_id, and without
        # one refuses batches > 1: the sequences are right-aligned, so an id no token has (-1) makes
        # it pool the last column, the end of every sequence, as one sequence alone does
        no_pad = config is not None and getattr(config, "pad_token_id", 0) is None
        if no_pad:
            config.pad_token_id = -1
        try:
            return self._scores(ids, mask, device, positions=True)
        finally:
            if no_pad:
                config.pad_token_id = None

    def _scores(self, ids: torch.Tensor, mask: torch.Tensor, device, *, positions: bool) -> torch.Tensor:
        """The classifier's first logit for each row, ``micro_batch_size`` rows a pass;
        ``positions``: pass position ids counted over the real tokens (left-padded rows need them;
        left-aligned rows take the model's own, which not every encoder lets one pass)."""
        out = []
        for i in range(0, ids.shape[0], self.micro_batch_size):
            sl = slice(i, i + self.micro_batch_size)
            m = mask[sl].to(device)
            kw = {"position_ids": (m.long().cumsum(1) - 1).clamp(min=0)} if positions else {}
            logits = self.model(input_ids=ids[sl].to(device), attention_mask=m.long(), **kw).logits
            if logits.dim() == 3:  # per-token scores (rows, t, labels): each row's at its last real token
                last = (torch.arange(m.shape[1], device=m.device) * m.long()).argmax(1)
                out.append(logits[torch.arange(len(last), device=logits.device), last.to(logits.device), 0])
            else:
                out.append(logits[:, 0])
        return torch.cat(out).float().cpu()
