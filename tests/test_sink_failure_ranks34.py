"""A sink that raises on one rank of a lowered fit stops every rank after the same step.

Only rank 0 calls the sinks. When one raised there, rank 0 left ``fit`` while the other ranks went
on into the next step's collectives and waited for the process group's timeout (under torchrun,
until the launcher tore the job down), and a checkpoint due at that step was skipped on several
processes. Now the ranks of a lowered state agree after each step's sinks (one all-reduce): rank 0
raises the sink's error, the others :class:`rlkit.parallel.FailedOnAnotherRank` naming rank 0, all
after the same step, with that step's state in ``exc.state`` and its due checkpoint saved.
"""
from __future__ import annotations

import pytest

import rlkit as rk

STEPS, FAIL_AT = 4, 2


def _digits(completions, **_):
    return [min(3, sum(ch.isdigit() for ch in c)) / 3 for c in completions]


class _BreaksAt:
    def __init__(self, step):
        self.step, self.seen = step, []

    def on_step(self, step, metrics):
        self.seen.append(step)
        if step == self.step:
            raise ConnectionError("metrics server gone")


def _worker(folder, placement_spec):
    import time

    from rlkit.parallel import FailedOnAnotherRank, init_distributed, shutdown, split_placement
    import torch.distributed as dist

    # a short collective timeout: a rank left waiting fails within seconds instead of minutes
    init_distributed("gloo", timeout=20)
    try:
        task = rk.tasks.arithmetic(n_train=32, n_test=8)
        model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1)
        placement = split_placement(placement_spec) if placement_spec else None
        plan = rk.Pipeline(rk.recipes.get("grpo").with_(n=2, max_new_tokens=4), reward=_digits).lower(placement)
        state = plan.shard(rk.init(model, rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer))
        sink = _BreaksAt(FAIL_AT)
        t0 = time.perf_counter()
        try:
            plan.fit(state, task.train, steps=STEPS, batch_size=2, sinks=sink,
                     checkpointer=rk.Checkpointer(folder, every=FAIL_AT))
            out = {"error": None}
        except ConnectionError as exc:
            out = {"error": "sink", "step": exc.state.step, "history": len(exc.history)}
        except FailedOnAnotherRank as exc:
            out = {"error": "other", "rank": exc.rank, "message": str(exc), "step": exc.state.step,
                   "history": len(exc.history)}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        out["seconds"] = time.perf_counter() - t0
        out["seen"] = sink.seen
        out["me"] = dist.get_rank()
        return out
    finally:
        shutdown()


@pytest.mark.distributed
@pytest.mark.parametrize("placement", [None, {"actor": 1, "rollout": 1}], ids=["data-parallel", "split"])
def test_a_sink_failing_on_rank_0_stops_every_rank_after_the_same_step(tmp_path, placement):
    from rlkit.checkpoint import list_checkpoints
    from rlkit.parallel.local import run_local

    folder = str(tmp_path / "ckpt")
    r0, r1 = run_local(_worker, 2, folder, placement, timeout=240)
    assert r0["error"] == "sink", r0
    assert r0["seen"] == list(range(1, FAIL_AT + 1))  # rank 0 called the sink up to the step that raised
    assert r1["seen"] == []  # only rank 0 calls the sinks
    assert r1["error"] == "other", r1  # before: a collective timeout on rank 1
    assert (r0["me"], r1["me"]) == (0, 1)
    assert r1["rank"] == 0 and "sink raised on rank 0" in r1["message"]
    assert r0["step"] == r1["step"] == FAIL_AT  # both stopped after the step whose sink raised, with its state
    assert r0["history"] == r1["history"] == FAIL_AT
    assert [step for step, _ in list_checkpoints(folder)] == [FAIL_AT]  # the due checkpoint, saved by both ranks


def test_failed_rank_on_one_process():
    from rlkit.parallel.agree import failed_rank

    assert failed_rank(False) is None
    assert failed_rank(True) == 0
