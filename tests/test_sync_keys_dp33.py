"""Every step, every rank and every placement logs the same ``sync/*`` keys.

A lowered weight sync (``Plan._weight_sync``, data parallel; ``Plan._split_sync``, split
placement) reported only ``{bytes, seconds}`` and dropped the engine's ``load_weights`` report,
while a step that moved no weights logged zeros under the engine's declared ``sync_keys``
(TorchEngine: ``bytes, seconds, fused_bytes``): step 1 logged ``sync/fused_bytes`` and later
steps did not, and under split placement it never appeared.
"""
from __future__ import annotations

import pytest

import rlkit as rk

STEPS = 3


def _task():
    return rk.tasks.arithmetic(n_train=64, n_test=8)


def _model(task):
    return rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                          num_key_value_heads=1)


def _recipe():
    return rk.recipes.get("grpo").with_(n=2, max_new_tokens=4)


def _digits(completions, **_):  # dense, so every step trains and the policy version moves
    return [min(3, sum(ch.isdigit() for ch in c)) / 3 for c in completions]


def _sync_keys(history):
    return [sorted(k for k in row if k.startswith("sync/")) for row in history]


def _worker(steps):
    """Data parallel over both ranks, then split placement (actor rank 0, rollout rank 1): each
    run's per-step ``sync/*`` key sets, and the policy versions (so the syncs did happen)."""
    from rlkit.parallel import init_distributed, shutdown, split_placement

    init_distributed("gloo")
    try:
        task = _task()
        out = {}
        for name, placement in (("dp", None), ("split", split_placement({"actor": 1, "rollout": 1}))):
            plan = rk.Pipeline(_recipe(), reward=_digits).lower(placement)
            state = plan.shard(rk.init(_model(task), rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer))
            state, history = plan.fit(state, task.train, steps=steps, batch_size=2)
            out[name] = {"keys": _sync_keys(history), "version": state.policy_version,
                         "bytes": [row.get("sync/bytes") for row in history]}
        return out
    finally:
        shutdown()


def _single_process_keys():
    task = _task()
    state = rk.init(_model(task), rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer)
    _, history = rk.fit(state, _recipe(), _digits, task.train, steps=STEPS, batch_size=2)
    keys = _sync_keys(history)
    assert keys[0] and all(k == keys[0] for k in keys), keys
    return keys[0]


@pytest.mark.distributed
def test_lowered_runs_log_the_same_sync_keys_every_step_rank_and_placement():
    from rlkit.parallel.local import run_local

    expected = _single_process_keys()
    assert "sync/fused_bytes" in expected  # TorchEngine's declared sync_keys
    results = run_local(_worker, 2, STEPS, timeout=240)
    for name in ("dp", "split"):
        for rank, r in enumerate(results):
            got = r[name]
            assert got["version"] >= 2, (name, rank, got)  # later steps did sync weights
            assert len(got["keys"]) == STEPS, (name, rank, got)
            for step, keys in enumerate(got["keys"], 1):
                assert keys == expected, f"{name}: rank {rank} step {step} logged {keys}, expected {expected}"
            assert any(b > 0 for b in got["bytes"][1:]), (name, rank, got["bytes"])


def test_sync_report_carries_the_engines_declared_keys_and_its_load_report():
    """The report of a lowered sync: the engine's declared keys (zeros where its load report has
    none), its load report's extra figures, and the collective's bytes and seconds."""
    from types import SimpleNamespace

    from rlkit.pipeline import _sync_report
    from rlkit.transforms.rollout import _no_sync

    gathered = SimpleNamespace(bytes=100, seconds=0.5)

    class Buckets:  # VLLMEngine's declared keys
        sync_keys = ("bytes", "seconds", "buckets")

    class Fused:  # TorchEngine's
        sync_keys = ("bytes", "seconds", "fused_bytes")

    got = _sync_report(gathered, {"bytes": 7.0, "seconds": 0.1, "buckets": 3}, Buckets())
    assert got == {"bytes": 100.0, "seconds": 0.5, "buckets": 3.0}
    got = _sync_report(gathered, {"bytes": 7.0, "seconds": 0.1, "fused_bytes": 12.0}, Fused())
    assert got == {"bytes": 100.0, "seconds": 0.5, "fused_bytes": 12.0}
    for engine in (Buckets(), Fused(), None):
        synced = {f"sync/{k}" for k in _sync_report(gathered, None, engine)}
        assert synced == set(_no_sync(engine))
