"""``load_full_state_dict`` with a state dict that does not fit the model, and ``global_sum`` of flags.

- a wrong shape, an extra key or a missing key raises the same ValueError on every rank, naming the
  entry and both shapes, before any tensor moves (a wrong shape used to raise an unnamed broadcast
  error on rank 1 while rank 0 hung in a send; an extra key raised on rank 0 only), and the group
  and the model are left as they were;
- ``global_sum`` of bool or small-integer tensors returns int64 counts (a bool came back as bool).

Two 2-process jobs (gloo, CPU, a 15 s group timeout): every load scenario, then every sum.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from _workers import join

pytestmark = pytest.mark.distributed


class Toy(nn.Module):
    """One 'layer' and two parameters with fewer rows than, or rows not divisible by, 2 ranks."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([nn.Linear(5, 6)])
        self.tiny = nn.Parameter(torch.randn(1, 3))
        self.odd = nn.Parameter(torch.randn(3, 2))
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x):
        return self.layers[0](x).sum() + self.tiny.sum() + self.odd.sum()


def _job() -> dict:
    from rlkit import parallel as par

    rank, out, attempt = join(timeout=15)
    mesh = par.device_mesh()
    full = par.full_state_dict(par.shard_model(Toy(seed=0), mesh))  # rank 0: full tensors; others: {}

    def state(model) -> dict:
        return {k: v.clone() for k, v in par.full_state_dict(model, cpu_offload=False).items()}

    def load(edit=None, from_rank0=True, on_rank=0):
        model = par.shard_model(Toy(seed=1), mesh)
        before = state(model)
        sd = dict(full) if from_rank0 else {k: v.clone() for k, v in state(par.shard_model(Toy(seed=0), mesh)).items()}
        if edit is not None and rank == on_rank:
            edit(sd)
        try:
            par.load_full_state_dict(model, sd, from_rank0=from_rank0)
        finally:
            out[f"unchanged_{len(out)}"] = all(torch.equal(v, before[k]) for k, v in state(model).items())
        after = state(model)
        return {"loaded": all(torch.equal(after[k], v) for k, v in state(par.shard_model(Toy(seed=0), mesh)).items())}

    def reshape(sd):
        sd["odd"] = torch.zeros(4, 2)

    def extra(sd):
        sd["bogus"] = torch.zeros(2)

    def missing(sd):
        del sd["odd"]

    attempt("good", load)
    attempt("shape", lambda: load(reshape))
    attempt("extra", lambda: load(extra))
    attempt("missing", lambda: load(missing))
    attempt("local_shape_rank1", lambda: load(reshape, from_rank0=False, on_rank=1))
    attempt("good_after", load)  # the group still works after the refused loads
    par.shutdown()
    return out


def _sum_job() -> dict:
    """``global_sum`` of each kind of input on each rank: ``{name: {"value", "dtype"}}``."""
    from rlkit import parallel as par

    rank, out, attempt = join(timeout=15)

    def summed(value):
        s = par.global_sum(value)
        return {"value": s.tolist(), "dtype": str(s.dtype)}

    attempt("sum_bool", lambda: summed(torch.tensor([True, False, True])))
    attempt("sum_int8", lambda: summed(torch.tensor([100, -100], dtype=torch.int8)))
    attempt("sum_int", lambda: summed(3))
    attempt("sum_float32", lambda: summed(torch.tensor([0.5, 1.0])))
    par.shutdown()
    return out


@pytest.fixture(scope="module")
def ranks():
    from rlkit.parallel.local import run_local

    return run_local(_job, 2, timeout=120, device="cpu")


@pytest.fixture(scope="module")
def sums():
    from rlkit.parallel.local import run_local

    return run_local(_sum_job, 2, timeout=60, device="cpu")


def test_a_matching_state_dict_loads(ranks):
    for r in ranks:
        assert r["good"] == {"loaded": True} and r["good_after"] == {"loaded": True}, r


def test_a_wrong_shape_is_named_on_every_rank_instead_of_hanging(ranks):
    message = ranks[0]["shape"]
    assert message == ranks[1]["shape"]
    assert message.startswith("ValueError: load_full_state_dict: rank 0's state dict does not match Toy"), message
    assert "another shape: 'odd': (4, 2) in the state dict, (3, 2) in the model." in message
    assert "Nothing was loaded" in message and "full_state_dict(model)" in message


def test_an_extra_key_raises_on_every_rank(ranks):
    message = ranks[0]["extra"]
    assert message == ranks[1]["extra"]
    assert message.startswith("ValueError: load_full_state_dict:") and "not in the model: 'bogus'" in message


def test_a_missing_key_raises_on_every_rank(ranks):
    message = ranks[0]["missing"]
    assert message == ranks[1]["missing"]
    assert message.startswith("ValueError: load_full_state_dict:") and "missing from the state dict: 'odd'" in message


def test_without_from_rank0_the_rank_with_the_bad_dict_is_named_on_every_rank(ranks):
    message = ranks[0]["local_shape_rank1"]
    assert message == ranks[1]["local_shape_rank1"]
    assert "the state dict of rank 1 does not match" in message and "'odd': (4, 2)" in message


def test_a_refused_load_leaves_the_model_as_it_was(ranks):
    for r in ranks:
        flags = [v for k, v in r.items() if k.startswith("unchanged_")]
        # good, shape, extra, missing, local_shape_rank1, good_after: only the good loads change the model
        assert flags == [False, True, True, True, True, False], r


def test_global_sum_counts_flags_and_small_integers_in_int64(sums):
    for r in sums:
        assert r["sum_bool"] == {"value": [2, 0, 2], "dtype": "torch.int64"}
        assert r["sum_int8"] == {"value": [200, -200], "dtype": "torch.int64"}
        assert r["sum_int"] == {"value": 6, "dtype": "torch.int64"}
        assert r["sum_float32"] == {"value": [1.0, 2.0], "dtype": "torch.float32"}


def test_global_sum_without_a_process_group_gives_the_same_dtypes():
    import torch.distributed as dist

    from rlkit.parallel.fsdp import global_sum

    assert not dist.is_initialized()
    assert global_sum(torch.tensor([True, False])).dtype == torch.int64
    assert global_sum(torch.tensor([1], dtype=torch.int16)).dtype == torch.int64
    assert global_sum(torch.tensor(1.5, dtype=torch.bfloat16)).dtype == torch.bfloat16
