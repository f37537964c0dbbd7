import os

import pytest
import torch

# two cores on CI: keep intra-op threads at the machine's size, and tests deterministic; under
# pytest-xdist every worker is one of several processes sharing the cores, so one thread each
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def char_tok():
    from rlkit.models.tokenizers import char_tokenizer

    return char_tokenizer("0123456789+-*= abc")


@pytest.fixture
def tiny_model(char_tok):
    from rlkit.models import tiny

    return tiny(char_tok, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, seed=0)


@pytest.fixture(scope="module")
def task(request):
    """A 2-digit arithmetic task with 8 test prompts, built once per module. A module sets the size
    of the training split with ``TASK_N_TRAIN = ...`` (default 64); a module that defines its own
    ``task`` fixture uses that one instead."""
    import rlkit as rk

    return rk.tasks.arithmetic(digits=2, n_train=getattr(request.module, "TASK_N_TRAIN", 64), n_test=8)


@pytest.fixture
def fresh_state(task):
    """``fresh_state()``: a new TrainState for ``task`` (a 32-wide tiny model with seed 0, AdamW at
    lr 3e-4), a fresh one on every call."""
    import rlkit as rk

    def build():
        model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1)
        return rk.init(model, rk.optim.adamw(lr=3e-4), tokenizer=task.tokenizer)

    return build


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


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker per core, at most 4. Most of the suite's time is
    spent in tests that start processes of their own (two gloo ranks each), and waiting on them:
    more workers than that only queue for the same cores."""
    return max(1, min(4, os.cpu_count() or 1))
