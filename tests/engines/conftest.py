"""Shared pieces for the engine tests: a random tiny model with varied outputs, and float64 references."""
from __future__ import annotations

import pytest
import torch

from rlkit.models import tiny
from rlkit.models.tokenizers import char_tokenizer

TEXTS = ["12+3=", "7", "abc def gh", "99", "a+b=c"]  # different lengths: left padding is exercised


@pytest.fixture(scope="session")
def tok():
    return char_tokenizer("0123456789+= abcdefghij")


def make_model(tok, arch: str = "qwen2", **overrides):
    # initializer_range 0.2 (not 0.02): peaked, varied next-token distributions instead of a model
    # that repeats one token, so token-equality tests can actually fail
    fields = dict(hidden_size=64, intermediate_size=128, initializer_range=0.2, tie_word_embeddings=False)
    fields.update(overrides)
    return tiny(tok, arch=arch, **fields).eval()


@pytest.fixture(scope="module")
def model(tok):
    return make_model(tok)


@pytest.fixture(scope="session")
def prompts(tok):
    return [tok.encode(t) for t in TEXTS]


def processed_logprobs_ref(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """float64 log-probs of one (v) logit row after temperature, top-k and top-p, by a plain loop."""
    z = logits.double() / temperature
    order = sorted(range(len(z)), key=lambda i: -z[i].item())
    keep = set(order[:top_k]) if top_k > 0 else set(order)
    probs = torch.softmax(torch.tensor([z[i].item() if i in keep else float("-inf") for i in range(len(z))], dtype=torch.float64), -1)
    if top_p < 1.0:
        mass, kept = 0.0, set()
        for i in order:
            if i in keep and (not kept or mass < top_p):
                kept.add(i)
                mass += probs[i].item()
        keep = kept
    out = torch.tensor([z[i].item() if i in keep else float("-inf") for i in range(len(z))], dtype=torch.float64)
    return out.log_softmax(-1)


def behaviour_ref(model, prompts, gen, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(b t) float64: each generated token's log-prob under the processed distribution, recomputed
    from full-sequence logits of the model row by row."""
    out = torch.zeros(gen.response_ids.shape, dtype=torch.float64)
    for row, i in enumerate(gen.prompt_index.tolist()):
        response = gen.response_ids[row][gen.response_mask[row]].tolist()
        p = prompts[i]
        with torch.no_grad():
            logits = model(torch.tensor([p + response])).logits[0]
        for j, token in enumerate(response):
            out[row, j] = processed_logprobs_ref(logits[len(p) - 1 + j], temperature, top_k, top_p)[token]
    return out


@pytest.fixture(scope="session")
def refs():
    """The reference helpers, as a fixture (test modules do not import conftest)."""

    class Refs:
        make_model = staticmethod(make_model)
        processed_logprobs = staticmethod(processed_logprobs_ref)
        behaviour = staticmethod(behaviour_ref)

    return Refs
