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


@pytest.fixture
def policy_batch():
    """``policy_batch(model, ref=False)``: 8 rows (2 groups of 4) of random 3-token prompts and 2-6
    token responses, with ``model``'s log-probs as ``logprobs`` (plus 0.05 noise), random
    ``advantages`` on the response tokens and, with ``ref=True``, ``ref_logprobs`` 0.3 from them."""
    from rlkit.batch import make_batch
    from rlkit.transforms.forward import model_logprobs

    def build(model, ref: bool = False, b: int = 8, vocab: int = 18):
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (3,), generator=g).tolist() for _ in range(b)]
        responses = [torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(b)]
        batch = make_batch(prompts, responses, group=[i // 4 for i in range(b)], rewards=[0.0] * b)
        lp, _ = model_logprobs(model, batch)
        mask = batch["response_mask"]
        batch.set("logprobs", lp + 0.05 * torch.randn(lp.shape, generator=g) * mask)
        batch.set("advantages", torch.randn(mask.shape, generator=g) * mask)
        if ref:
            batch.set("ref_logprobs", lp + 0.3 * torch.randn(lp.shape, generator=g) * mask)
        return batch

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


@pytest.hookimpl(optionalhook=True)  # an xdist hook: .ci/run's vLLM environment has no xdist
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker per core, at most 4. Most of the suite's time is
    spent in tests that start processes of their own (two gloo ranks each), and waiting on them:
    more workers than that only queue for the same cores."""
    return max(1, min(4, os.cpu_count() or 1))


class _StubWidget:
    """Stands in for an ipywidgets widget (any of IntProgress, HTML, Output, VBox): holds ``value``,
    ``max`` and a box's ``children``, and works as an ``Output`` context."""

    def __init__(self, *args, **kwargs):
        self.value, self.max, self.children = None, kwargs.get("max"), args[0] if args else None

    def clear_output(self, wait=False):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def stub_widget():
    """The stand-in ipywidgets widget class (IntProgress, HTML, Output and VBox alike)."""
    return _StubWidget


@pytest.fixture
def drawn_dashboard():
    """``drawn_dashboard(**kwargs)``: a Dashboard that draws (Agg backend) into stand-in widgets:
    without ipywidgets a Dashboard only keeps its history, and with it, it would display real ones."""
    import matplotlib

    matplotlib.use("Agg")
    from rlkit.observe.notebook import Dashboard

    def make(**kwargs):
        board = Dashboard(**kwargs)
        board._bar, board._text, board._plot = _StubWidget(), _StubWidget(), _StubWidget()
        board._bar.max = board.total
        board._widgets = object()
        return board

    return make
