"""Ready-made reward functions (TRL-style: ``f(completions, **columns) -> list[float]``).

They take the decoded completions and the batch's columns by name, so the same function works
with ``rk.score`` and with TRL's trainers.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def _norm(x: Any) -> str:
    return str(x).strip().replace(",", "")


def exact_match(completions: Sequence[str], answer: Sequence[Any], **_) -> list[float]:
    """1.0 where the completion, stripped, equals the answer (commas in numbers ignored), else 0."""
    return [float(_norm(c) == _norm(a)) for c, a in zip(completions, answer)]


def extract_hash_answer(text: str) -> str | None:
    """GSM8K convention: the final answer follows ``####``. Returns None when absent."""
    if "####" not in text:
        return None
    tail = text.split("####")[-1]
    match = _NUMBER.search(tail)
    return match.group(0).replace(",", "") if match else None


def math_answer(completions: Sequence[str], answer: Sequence[Any], **_) -> list[float]:
    """1.0 where the ``#### <answer>`` of the completion equals the reference answer.

    The reference may itself be a full GSM8K solution (its ``####`` part is used) or a number.
    """
    out = []
    for c, a in zip(completions, answer):
        ref = extract_hash_answer(str(a)) or _norm(a)
        got = extract_hash_answer(c)
        try:
            ok = got is not None and float(got) == float(ref)
        except ValueError:
            ok = got is not None and got == ref
        out.append(float(ok))
    return out


def format_reward(pattern: str, *, full: bool = True, name: str | None = None):
    """A reward of 1.0 where the completion matches the regex ``pattern`` (whole text if ``full``)."""
    regex = re.compile(pattern, re.DOTALL)

    def reward(completions: Sequence[str], **_) -> list[float]:
        match = regex.fullmatch if full else regex.search
        return [float(match(c.strip()) is not None) for c in completions]

    reward.__name__ = name or "format"
    return reward


_HASH_LINE = re.compile(r"####\s*" + _NUMBER.pattern)


def hash_format(completions: Sequence[str], **_) -> list[float]:
    """1.0 where the completion ends with a ``#### <number>`` answer line (GSM8K format): its last
    non-empty line is ``#### <number>`` (spaces around it allowed), else 0.0. A completion that
    goes on after its answer line (``"#### 42\nWait, ..."``) scores 0.0."""
    out = []
    for c in completions:
        lines = [line for line in c.splitlines() if line.strip()]
        out.append(float(bool(lines) and _HASH_LINE.fullmatch(lines[-1].strip()) is not None))
    return out


class RewardModel:
    """A sequence classifier (``AutoModelForSequenceClassification``, 1 label) as the reward role.

    Called with the whole Batch (``score`` passes it): it scores ``prompt + response`` token ids.
    The reward model must share the actor's tokenizer (token in, token out); for a different
    tokenizer, decode and re-encode in your own batch-style function. A classifier whose config
    has no ``pad_token_id`` scores the last token of each sequence (transformers refuses batches
    of more than one sequence there; the sequences are aligned here, so none is needed).
    """

    def __init__(self, model, *, micro_batch_size: int = 64):
        self.model = model.eval()
        self.micro_batch_size = micro_batch_size
        self.__name__ = "reward_model"

    @torch.no_grad()
    def __call__(self, batch) -> torch.Tensor:
        device = next(self.model.parameters()).device
        ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
        # right-align the real tokens so the classifier's "last non-pad token" is the response end
        order = torch.argsort(mask.long(), dim=1, stable=True)
        ids, mask = ids.gather(1, order), mask.gather(1, order)
        config = getattr(self.model, "config", None)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        # transformers' classifier pools the rightmost token that is not pad_token_id, and without
        # one refuses batches > 1: the sequences are right-aligned, so an id no token has (-1) makes
        # it pool the last column, the end of every sequence, as one sequence alone does
        no_pad = config is not None and getattr(config, "pad_token_id", 0) is None
        if no_pad:
            config.pad_token_id = -1
        try:
            out = []
            for i in range(0, ids.shape[0], self.micro_batch_size):
                sl = slice(i, i + self.micro_batch_size)
                m = mask[sl].to(device)
                pos = (m.long().cumsum(1) - 1).clamp(min=0)
                logits = self.model(input_ids=ids[sl].to(device), attention_mask=m.long(), position_ids=pos).logits
                # the score of the last real token (sequences are right-aligned, so the last column)
                out.append(logits[:, -1, 0] if logits.dim() == 3 else logits[:, 0])
        finally:
            if no_pad:
                config.pad_token_id = None
        return torch.cat(out).float().cpu()
