"""Single-process pieces of the distributed layer: rank arithmetic, TP plans, placement, row splits.

Nothing here initialises torch.distributed in the test process.
"""
from __future__ import annotations

import pytest
import torch

from rlkit.parallel import mesh as M
from rlkit.parallel import placement as P
from rlkit.parallel import reshard as R


def test_world_without_torchrun_is_one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = M.init_distributed()
    assert (info.rank, info.world_size, info.distributed, info.is_main) == (0, 1, False, True)
    M.shutdown()  # no-op without a process group


def test_init_distributed_names_the_missing_variable(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="RANK"):
        M.init_distributed()


def _pretend_gpus(monkeypatch, n: int):
    """This process sees ``n`` CUDA devices (only torch's queries are replaced: nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_more_processes_than_gpus_is_a_clear_error_before_nccl(monkeypatch):
    _pretend_gpus(monkeypatch, 1)
    monkeypatch.delenv(M.DEVICE_ENV, raising=False)
    for name, value in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT="29999").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(M.dist, "init_process_group", lambda *a, **k: pytest.fail("reached NCCL"))
    with pytest.raises(RuntimeError, match=r"2 processes on this node but 1 visible CUDA device\(s\).*RLKIT_DEVICE=cpu"):
        M.init_distributed()
    M.check_gpus_per_process(2, 2)
    M.check_gpus_per_process(1, 8)
    with pytest.raises(RuntimeError, match="0 visible CUDA device"):
        M.check_gpus_per_process(1, 0)


def test_rlkit_device_cpu_keeps_a_gpu_machine_on_the_cpu(monkeypatch):
    _pretend_gpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv(M.DEVICE_ENV, raising=False)
    assert M.default_device() == torch.device("cuda", 1)
    assert M.default_backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setenv(M.DEVICE_ENV, "cpu")
    assert M.default_device() == torch.device("cpu")
    assert M.default_backend() == "gloo"
    monkeypatch.setenv(M.DEVICE_ENV, "gpu")
    with pytest.raises(ValueError, match="RLKIT_DEVICE='gpu'"):
        M.default_device()


def _device_worker():
    import os

    from rlkit.parallel import init_distributed, shutdown

    info = init_distributed()
    try:
        return os.environ.get(M.DEVICE_ENV), info.device.type, info.backend
    finally:
        shutdown()


@pytest.mark.distributed
def test_run_local_puts_more_workers_than_gpus_on_the_cpu():
    from rlkit.parallel.local import run_local

    if torch.cuda.device_count() >= 2:
        pytest.skip("with 2 GPUs each worker takes one")
    assert run_local(_device_worker, 2, timeout=120) == [("cpu", "cpu", "gloo")] * 2
    with pytest.raises(ValueError, match="device must be None, 'cpu' or 'cuda'"):
        run_local(_device_worker, 2, device="tpu")


def test_split_ranks():
    assert M.split_ranks({"actor": 2, "rollout": 2}, world_size=4) == {"actor": [0, 1], "rollout": [2, 3]}
    assert M.split_ranks({"actor": 1, "rollout": -1}, world_size=4) == {"actor": [0], "rollout": [1, 2, 3]}
    with pytest.raises(ValueError, match="add up to 3 but world_size=4"):
        M.split_ranks({"actor": 1, "rollout": 2}, world_size=4)
    with pytest.raises(ValueError, match="at least one"):
        M.split_ranks({"actor": 4, "rollout": -1}, world_size=4)


def test_chunk_rows_match_torch_chunk():
    for d0 in (1, 5, 40, 41):
        for parts in (1, 2, 3, 4, 8):
            chunks = torch.arange(d0).chunk(parts)
            for i in range(parts):
                lo, hi = R._chunk_rows(d0, parts, i)
                expected = chunks[i].tolist() if i < len(chunks) else []
                assert list(range(lo, hi)) == expected, (d0, parts, i)


def test_tp_style_default_and_hf_plan_keys():
    assert R.tp_style("model.layers.0.self_attn.q_proj.weight") == "colwise"
    assert R.tp_style("model.layers.3.self_attn.k_proj.bias") == "colwise"
    assert R.tp_style("model.layers.0.mlp.down_proj.weight") == "rowwise"
    assert R.tp_style("model.embed_tokens.weight") == "replicate"
    assert R.tp_style("lm_head.weight") == "replicate"
    assert R.shard_dim("model.layers.0.self_attn.o_proj.weight", 2) == 1
    assert R.shard_dim("model.layers.0.self_attn.o_proj.bias", 1) is None  # added after the reduction
    hf_plan = (("layers.*.self_attn.q_proj", "colwise"), ("layers.*.mlp.down_proj", "rowwise"))
    assert R.tp_style("model.layers.1.self_attn.q_proj.weight", hf_plan) == "colwise"
    assert R.tp_style("model.layers.1.self_attn.k_proj.weight", hf_plan) == "replicate"


def test_layout_validation():
    with pytest.raises(ValueError, match="cannot form TP groups of 2"):
        R.split([0], [1, 2, 3], tp=2)
    with pytest.raises(ValueError, match="style"):
        R.tensor_parallel(2, plan={"*.q_proj": "diagonal"})
    p = R._Param("model.layers.0.self_attn.k_proj.weight", (30, 64), torch.float32, 0, None)
    with pytest.raises(ValueError, match="not divisible by tensor-parallel size 4"):
        R._need(p, 4, 0)


def test_local_placement_is_the_identity():
    placement = P.local_placement()
    assert placement.ranks("actor") == (0,) and placement.colocated("actor", "rollout")
    assert placement.sync_layout() == R.replicated()
    assert placement.sync_layout(tp=2) == R.tensor_parallel(2)
    with pytest.raises(KeyError, match="no role 'judge'"):
        placement.mesh("judge")


def test_shard_rows_keeps_groups_whole():
    from rlkit.batch import make_batch

    batch = make_batch([[1]] * 4, [[2]] * 4, group=[0, 0, 1, 1])
    assert P.shard_rows(batch) is batch  # one process
    with pytest.raises(ValueError, match="not divisible"):
        _rows(5, 2, 1)
    with pytest.raises(ValueError, match="splits groups of 4"):
        _rows(8, 4, 4)


def _rows(b: int, size: int, group_size: int):
    """shard_rows as rank 0 of ``size`` (the divisibility checks are what is under test)."""
    import unittest.mock as mock

    with mock.patch.object(P, "_dp_rank_size", return_value=(0, size)):
        return P.shard_rows(torch.arange(b), group_size=group_size)


def test_shard_rows_slices_contiguously():
    import unittest.mock as mock

    for rank in range(3):
        with mock.patch.object(P, "_dp_rank_size", return_value=(rank, 3)):
            assert P.shard_rows(torch.arange(6), group_size=2).tolist() == [2 * rank, 2 * rank + 1]


def test_concat_respects_left_and_right_padding():
    # the one-process concatenation that gather_rows must equal (tests/parallel/test_reshard.py)
    from rlkit.batch import column, make_batch, validate
    from rlkit.transforms.rollout import concat

    a = make_batch([[5, 6, 7]], [[1]], group=[0], columns={"answer": ["x"]})
    b = make_batch([[8]], [[2, 3, 4]], group=[1], columns={"answer": ["y"]})
    merged = validate(concat([a, b]))
    assert merged["prompt_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert merged["prompt_mask"].tolist() == [[True] * 3, [False, False, True]]
    assert merged["response_ids"].tolist() == [[1, 0, 0], [2, 3, 4]]
    assert merged["response_mask"].tolist() == [[True, False, False], [True] * 3]
    assert column(merged, "answer") == ["x", "y"]


def _raises_on_rank_1():
    import torch.distributed as dist

    M.init_distributed("gloo")
    try:
        if dist.get_rank() == 1:
            raise ValueError("only rank 1 fails")
        dist.all_reduce(torch.ones(1))  # rank 0 waits in a collective rank 1 never joins
    finally:
        M.shutdown()  # the documented teardown; its barrier paired with rank 0's all_reduce: a hang


@pytest.mark.distributed
def test_a_rank_that_raises_is_reported_not_hung():
    import time

    from torch.multiprocessing import ProcessRaisedException

    from rlkit.parallel.local import run_local

    start = time.perf_counter()
    with pytest.raises(ProcessRaisedException, match="only rank 1 fails"):
        run_local(_raises_on_rank_1, 2, timeout=90)
    assert time.perf_counter() - start < 60
