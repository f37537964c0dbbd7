"""Scaffolding shared by the 2-process jobs of ``test_rank_fixes.py`` and ``test_ckpt_rank_fixes.py``.

``run_local`` spawns its workers and pickles the job by reference (``module.name``), so a worker
imports the test module, and through it this one: tests/parallel is on ``sys.path`` under pytest's
default ("prepend") import mode, and a spawned process starts with its parent's ``sys.path``.
Everything here is therefore a plain module-level function.
"""
from __future__ import annotations

from typing import Any, Callable


def tiny_task():
    """The small arithmetic task every job trains on."""
    import rlkit as rk

    return rk.tasks.arithmetic(n_train=16, n_test=4)


def tiny_recipe():
    """GRPO with 2 samples of 2 new tokens."""
    import rlkit as rk

    return rk.recipes.get("grpo").with_(n=2, max_new_tokens=2)


def tiny_model(task, seed: int = 0, dtype=None):
    """A one-layer, 16-wide model for ``task`` (``dtype``: the model's default when None)."""
    import rlkit as rk

    kw = {} if dtype is None else {"dtype": dtype}
    return rk.models.tiny(task.tokenizer, seed=seed, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, **kw)


def tiny_state(task, seed: int = 0, dtype=None, lr: float = 1e-2):
    """An unsharded TrainState of :func:`tiny_model` with AdamW at ``lr``."""
    import rlkit as rk

    return rk.init(tiny_model(task, seed, dtype), rk.optim.adamw(lr=lr), tokenizer=task.tokenizer)


def join(backend: str | None = None, *, timeout: float) -> tuple[int, dict, Callable[[str, Callable[[], Any]], None]]:
    """In a worker: join the job's process group and return ``(rank, out, attempt)``. ``out`` starts
    as ``{"rank": rank}``; ``attempt(name, fn)`` records ``fn()``'s result as ``out[name]``, or the
    exception it raised as ``"Type: message"``."""
    from rlkit import parallel as par

    info = par.init_distributed(backend, timeout=timeout)
    out: dict = {"rank": info.rank}

    def attempt(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded for the tests
            out[name] = f"{type(e).__name__}: {e}"

    return info.rank, out, attempt


def disagreement(result: dict, name: str) -> str:
    """One rank's recorded ``"RanksDisagreeError: ..."`` for scenario ``name`` (fails if it is anything else)."""
    message = result[name]
    assert isinstance(message, str) and message.startswith("RanksDisagreeError"), f"rank {result['rank']}: {name} -> {message!r}"
    return message
