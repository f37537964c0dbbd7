"""Train -> generate resharding moves weights exactly (CPU, gloo).

The weights are a random-init transformers Qwen2 (vocabulary 41, odd, so FSDP's row chunks are
uneven: 21 + 20, or 11 + 11 + 11 + 8) built once in the test process and passed to the workers,
which hold them in a plain module tree with the same parameter names (resharding depends only
on names, shapes and dtypes; this skips a 3 s transformers import in every worker). The expected
weights are the tensors passed in, so no comparison depends on the collectives under test.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.distributed

TP_SHARDED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj.weight", "down_proj.weight")


def _qwen2_weights(seed: int) -> dict[str, torch.Tensor]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=41, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Qwen2ForCausalLM(config).named_parameters()}


def _tree(weights: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose named_parameters() are ``weights`` (``layers.<i>`` become ModuleList entries)."""
    root = nn.Module()
    for name, value in weights.items():
        *path, leaf = name.split(".")
        module = root
        for i, part in enumerate(path):
            if part.isdigit():
                while len(module) <= int(part):
                    module.append(nn.Module())
                module = module[int(part)]
                continue
            if not hasattr(module, part):
                following_index = i + 1 < len(path) and path[i + 1].isdigit()
                module.add_module(part, nn.ModuleList() if following_index else nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(value.clone()))
    return root


def _expected_tp_shard(name: str, full: torch.Tensor, k: int, j: int) -> torch.Tensor:
    """Independent statement of the TP layout: column-parallel rows, row-parallel columns, the rest replicated."""
    if any(s in name for s in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return full.chunk(k, dim=0)[j]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(k, dim=1)[j]
    return full


def _summary(weights, report, expected) -> dict:
    return {
        "names": sorted(weights),
        "equal": all(torch.equal(weights[n], expected[n]) for n in expected) and set(weights) == set(expected),
        "bytes": report.bytes,
        "expected_bytes": sum(t.numel() * t.element_size() for t in expected.values()),
        "buckets": report.buckets,
        "peak": report.peak_buffer_bytes,
        "sharded_fraction": report.sharded_fraction,
        "seconds": report.seconds,
    }


def _job_two(full: dict[str, torch.Tensor]) -> dict:
    from rlkit.parallel import reshard as R
    from rlkit.parallel.fsdp import shard_model
    from rlkit.parallel.mesh import device_mesh, init_distributed, role_mesh, shutdown

    rank = init_distributed(timeout=60).rank
    largest = max(t.numel() * t.element_size() for t in full.values())
    out: dict = {"rank": rank, "largest": largest}
    actor = shard_model(_tree(full), device_mesh())

    weights, report = R.gather_weights(actor, R.replicated(), bucket_bytes=64 << 10)
    out["replicated"] = _summary(weights, report, full)

    weights, report = R.gather_weights(actor, R.replicated(dtype=torch.bfloat16))
    out["replicated_bf16"] = _summary(weights, report, {k: v.to(torch.bfloat16) for k, v in full.items()})

    weights, report = R.gather_weights(actor, R.tensor_parallel(2), bucket_bytes=64 << 10)
    out["tp2"] = _summary(weights, report, {k: _expected_tp_shard(k, v, 2, rank) for k, v in full.items()})

    # Split placement: actor trains on rank 0 alone, rollout generates on rank 1.
    actor_mesh, _ = role_mesh([0]), role_mesh([1])
    other = {k: torch.zeros_like(v) for k, v in full.items()}  # the rollout rank starts from other weights
    model = shard_model(_tree(full), actor_mesh) if rank == 0 else _tree(other)
    weights, report = R.gather_weights(model, R.split([0], [1]), bucket_bytes=64 << 10)
    out["split"] = _summary(weights, report, full if rank == 1 else {})

    # Rollouts from two generation replicas (different widths) become one global batch, and
    # each data-parallel rank trains on its own rows of it.
    from rlkit.batch import column, make_batch
    from rlkit.parallel.placement import gather_rows, shard_rows

    mine = make_batch(
        [[1, 2, 3]] if rank == 0 else [[4]], [[5]] if rank == 0 else [[6, 7]], group=[rank], columns={"answer": [f"a{rank}"]}
    )
    merged = gather_rows(mine)
    out["gathered"] = {
        "prompt_ids": merged["prompt_ids"].tolist(),
        "response_ids": merged["response_ids"].tolist(),
        "answer": column(merged, "answer"),
        "my_rows": shard_rows(merged)["group"].tolist(),
    }

    # Unequal row counts and widths, float / bool / 1-D fields and two text columns: the
    # collective gather equals concatenating both ranks' batches on one process (rlkit's
    # concat: same padding rule; it renumbers groups, which here are already 0 and 1).
    from rlkit.transforms.rollout import concat

    def part(r):
        prompts, responses = ([[1, 2, 3]], [[5]]) if r == 0 else ([[4], [6, 6]], [[6, 7, 8], [9]])
        lp = [[-0.5 - r] * len(x) for x in responses]
        cols = {"answer": [f"a{r}{i}" for i in range(len(prompts))], "prompt_text": [str(p) for p in prompts]}
        return make_batch(prompts, responses, logprobs=lp, rewards=[float(r)] * len(prompts), group=[r] * len(prompts), columns=cols)

    uneven = gather_rows(part(rank))
    expected = concat([part(0), part(1)])
    out["uneven"] = {
        "keys": sorted(uneven.keys()) == sorted(expected.keys()),
        "tensors": all(
            uneven[k].dtype == expected[k].dtype and torch.equal(uneven[k], expected[k])
            for k in expected.keys() if isinstance(expected.get(k), torch.Tensor)
        ),
        "text": [column(uneven, k) == column(expected, k) for k in ("answer", "prompt_text")],
        "rows": uneven.batch_size[0],
    }

    # Ranks whose batches have different fields get the same clear error, not a garbled batch
    # or a hang: here rank 1's logprobs are float64 and rank 0's float32.
    odd = part(rank)
    if rank == 1:
        odd.set("logprobs", odd["logprobs"].double())
    try:
        gather_rows(odd)
        out["rows_mismatch"] = "no error"
    except ValueError as e:
        out["rows_mismatch"] = str(e)

    # Ranks that disagree on the architecture get an error naming the problem, not garbage.
    try:
        R.gather_weights(actor if rank == 0 else _tree(full).to(torch.bfloat16), R.replicated())
        out["mismatch"] = "no error"
    except RuntimeError as e:
        out["mismatch"] = str(e)
    shutdown()
    return out


def _job_four(full: dict[str, torch.Tensor]) -> dict:
    from rlkit.parallel import reshard as R
    from rlkit.parallel.fsdp import shard_model
    from rlkit.parallel.mesh import device_mesh, init_distributed, role_mesh, shutdown

    rank = init_distributed(timeout=60).rank
    out: dict = {"rank": rank}
    actor = shard_model(_tree(full), device_mesh())
    weights, report = R.gather_weights(actor, R.tensor_parallel(2), bucket_bytes=64 << 10)
    out["tp2_dp2"] = _summary(weights, report, {k: _expected_tp_shard(k, v, 2, rank % 2) for k, v in full.items()})

    # Split: FSDP over ranks [0, 1] -> TP2 on ranks [2, 3].
    actor_mesh, _ = role_mesh([0, 1]), role_mesh([2, 3])
    other = {k: torch.zeros_like(v) for k, v in full.items()}
    model = shard_model(_tree(full), actor_mesh) if rank < 2 else _tree(other)
    weights, report = R.gather_weights(model, R.split([0, 1], [2, 3], tp=2), bucket_bytes=64 << 10)
    expected = {k: _expected_tp_shard(k, v, 2, rank - 2) for k, v in full.items()} if rank >= 2 else {}
    out["split_tp2"] = _summary(weights, report, expected)
    shutdown()
    return out


@pytest.fixture(scope="module")
def two():
    from rlkit.parallel.local import run_local

    return run_local(_job_two, 2, _qwen2_weights(3), timeout=150)


@pytest.fixture(scope="module")
def four():
    from rlkit.parallel.local import run_local

    return run_local(_job_four, 4, _qwen2_weights(5), timeout=200)


def test_fsdp2_to_replicated_is_exact_and_bucketed(two):
    for r in two:
        s = r["replicated"]
        assert s["equal"] and len(s["names"]) == 27
        assert s["bytes"] == s["expected_bytes"]
        assert s["buckets"] > 1
        # one bucket in flight: send (own rows) + receive (the bucket's full tensors)
        assert s["peak"] <= 2 * max(64 << 10, r["largest"]) + 4096
        assert r["replicated_bf16"]["equal"]


def test_fsdp2_to_tensor_parallel2_holds_only_the_shard(two):
    for r in two:
        s = r["tp2"]
        assert s["equal"], "each rank's shard must equal the matching slice of the full weight"
        # received exactly its shards (+ replicated tensors): no full copy of a TP-sharded weight
        assert s["bytes"] == s["expected_bytes"]
        assert s["sharded_fraction"] == pytest.approx(0.5)


def test_split_placement_actor_rank0_rollout_rank1(two):
    by_rank = {r["rank"]: r for r in two}
    assert by_rank[1]["split"]["equal"] and len(by_rank[1]["split"]["names"]) == 27
    assert by_rank[1]["split"]["bytes"] == by_rank[1]["split"]["expected_bytes"]
    assert by_rank[0]["split"]["names"] == [] and by_rank[0]["split"]["bytes"] == 0


def test_disagreeing_ranks_get_a_clear_error(two):
    for r in two:
        assert "disagree on the parameter list" in r["mismatch"], r["mismatch"]


def test_gather_rows_then_shard_rows_round_trip(two):
    for r in two:
        g = r["gathered"]
        assert g["prompt_ids"] == [[1, 2, 3], [0, 0, 4]]  # prompts stay left-padded
        assert g["response_ids"] == [[5, 0], [6, 7]]  # responses stay right-padded
        assert g["answer"] == ["a0", "a1"]
        assert g["my_rows"] == [r["rank"]]


def test_gather_rows_with_uneven_rows_equals_one_process_concatenation(two):
    for r in two:
        u = r["uneven"]
        assert u == {"keys": True, "tensors": True, "text": [True, True], "rows": 3}, u


def test_gather_rows_with_different_fields_raises_on_every_rank(two):
    for r in two:
        msg = r["rows_mismatch"]
        assert "different fields" in msg and "ranks [1]" in msg and "float" in msg, msg


def test_fsdp4_to_tp2_x_dp2(four):
    for r in four:
        s = r["tp2_dp2"]
        assert s["equal"], r["rank"]
        assert s["bytes"] == s["expected_bytes"]
        assert s["sharded_fraction"] == pytest.approx(0.5)


def test_split_fsdp2_to_tp2_on_other_ranks(four):
    for r in four:
        s = r["split_tp2"]
        assert s["equal"], r["rank"]
        if r["rank"] >= 2:
            assert len(s["names"]) == 27 and s["bytes"] == s["expected_bytes"]
        else:
            assert s["bytes"] == 0


def test_single_process_returns_the_training_storage():
    from rlkit.parallel.reshard import gather_weights, replicated

    model = torch.nn.Linear(3, 2)
    weights, report = gather_weights(model, replicated())
    assert weights["weight"].data_ptr() == model.weight.data_ptr()  # no copy: the sync costs nothing
    assert report.bytes == 0 and report.tensors == 2
    assert math.isclose(report.gbps, 0.0)
