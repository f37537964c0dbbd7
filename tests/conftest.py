import os

import pytest
import torch

# two cores on CI: keep intra-op threads at the machine's size, and tests deterministic
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def char_tok():
    from rlkit.models.tokenizers import char_tokenizer

    return char_tokenizer("0123456789+-*= abc")


@pytest.fixture
def tiny_model(char_tok):
    from rlkit.models import tiny

    return tiny(char_tok, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, seed=0)
