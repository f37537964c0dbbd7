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


def _child_env(nproc: int = 1) -> dict[str, str]:
    """Environment for a test's child processes: one intra-op thread each, and, when this machine
    has fewer GPUs than the ``nproc`` processes the test starts, ``RLKIT_DEVICE=cpu`` so that their
    workers compute on the CPU over gloo (rlkit allows one GPU per process and stops otherwise):
    the rule :func:`rlkit.parallel.local.run_local` applies, from the same function."""
    from rlkit.parallel.local import device_env

    return {**os.environ, "OMP_NUM_THREADS": "1", **device_env(nproc)}


@pytest.fixture(scope="session")
def child_env():
    """``child_env(nproc)``: the environment for child processes (see ``_child_env``)."""
    return _child_env
