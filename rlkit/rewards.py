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


def hash_format(completions: Sequence[str], **_) -> list[float]:
    """1.0 where the completion ends with a ``#### <number>`` answer line (GSM8K format)."""
    return [float(extract_hash_answer(c) is not None) for c in completions]


class RewardModel:
    """A sequence classifier (``AutoModelForSequenceClassification``, 1 label) as the reward role.

    Called with the whole Batch (``score`` passes it): it scores ``prompt + response`` token ids.
    The reward model must share the actor's tokenizer (token in, token out); for a different
    tokenizer, decode and re-encode in your own batch-style function.
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
        out = []
        for i in range(0, ids.shape[0], self.micro_batch_size):
            sl = slice(i, i + self.micro_batch_size)
            m = mask[sl].to(device)
            pos = (m.long().cumsum(1) - 1).clamp(min=0)
            logits = self.model(input_ids=ids[sl].to(device), attention_mask=m.long(), position_ids=pos).logits
            # the score of the last real token (sequences are right-aligned, so the last column)
            out.append(logits[:, -1, 0] if logits.dim() == 3 else logits[:, 0])
        return torch.cat(out).float().cpu()
