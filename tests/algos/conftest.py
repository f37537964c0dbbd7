"""Random padded batches shared by the algos tests.

``make_mask`` returns right-padded masks with some rows of length 1 (and optionally rows of
length 0 or holes in the middle, as multi-turn observation tokens).
"""
from __future__ import annotations

import pytest
import torch


def _make_mask(b: int, t: int, gen: torch.Generator, *, empty_rows: int = 0, holes: bool = False) -> torch.Tensor:
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[0] = 1  # always one row of length 1
    lengths[-1] = t  # and one full row
    if b > 3:
        lengths[2] = 1
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if holes:
        hole = torch.rand(b, t, generator=gen) < 0.25
        hole[:, 0] = False
        mask = mask & ~hole
    for r in range(empty_rows):
        mask[1 + 2 * r] = False
    return mask


@pytest.fixture
def make_mask():
    return _make_mask


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def seq_rewards_to_tokens(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each row's scalar reward on its last valid token (what the caller does)."""
    out = torch.zeros(mask.shape, dtype=scores.dtype)
    for i in range(mask.shape[0]):
        valid = mask[i].nonzero().flatten()
        if len(valid):
            out[i, int(valid[-1])] = scores[i]
    return out


@pytest.fixture
def to_tokens():
    return seq_rewards_to_tokens
