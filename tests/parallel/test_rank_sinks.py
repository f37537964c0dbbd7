"""On several processes fit calls the sinks of rank 0 only: a launched script that builds its
JSONLSink on every rank wrote each step once per rank into the one file (and drew a progress bar
per rank). A sink with ``all_ranks = True`` is called everywhere."""
from __future__ import annotations

import json
import os

import pytest

import rlkit as rk

pytestmark = pytest.mark.distributed


class _Everywhere(rk.observe.ListSink):
    all_ranks = True


def _worker(folder: str):
    from rlkit.parallel import init_distributed, shutdown

    rank = init_distributed("gloo").rank
    try:
        task = rk.tasks.arithmetic(n_train=16, n_test=4)
        model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1)
        state = rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)
        plan = rk.Pipeline(rk.recipes.get("grpo").with_(n=2, max_new_tokens=2), reward=task.reward).lower()
        state = plan.shard(state)
        here, everywhere = rk.observe.ListSink(), _Everywhere()
        with rk.observe.JSONLSink(os.path.join(folder, "metrics.jsonl")) as file:
            plan.fit(state, task.train, steps=2, batch_size=2, sinks=[here, everywhere, file])
        return rank, [r["step"] for r in here.history], [r["step"] for r in everywhere.history]
    finally:
        shutdown()


def test_only_rank_0_calls_the_sinks_unless_a_sink_asks_for_every_rank(tmp_path):
    from rlkit.parallel.local import run_local

    out = sorted(run_local(_worker, 2, str(tmp_path), timeout=240, device="cpu"))
    assert out == [(0, [1, 2], [1, 2]), (1, [], [1, 2])]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def _unlowered_worker():
    import warnings

    from rlkit.parallel import init_distributed, shutdown

    init_distributed("gloo")
    try:
        task = rk.tasks.arithmetic(n_train=16, n_test=4)
        model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1)
        recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=2)
        said = []
        for lowered in (False, True):
            state = rk.init(model if not lowered else rk.models.tiny(task.tokenizer, seed=0, hidden_size=32,
                            intermediate_size=64, num_attention_heads=2, num_key_value_heads=1),
                            rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)
            plan = rk.Pipeline(recipe, reward=task.reward).lower()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if lowered:
                    plan.fit(plan.shard(state), task.train, steps=1, batch_size=2)
                else:
                    rk.fit(state, recipe, task.reward, task.train, steps=1, batch_size=2)
            said.append([str(w.message) for w in caught if "was not lowered" in str(w.message)])
        return said
    finally:
        shutdown()


def test_fit_on_several_processes_with_an_unlowered_state_warns():
    """A launched script that forgot plan.shard trained a full copy per rank on the whole batch and
    saved it from every rank, without a word."""
    from rlkit.parallel.local import run_local

    for unlowered, lowered in run_local(_unlowered_worker, 2, timeout=240, device="cpu"):
        assert len(unlowered) == 1 and "2 processes run this fit" in unlowered[0] and "plan.shard(state)" in unlowered[0]
        assert lowered == []
