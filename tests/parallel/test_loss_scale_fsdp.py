"""float16 dynamic loss scaling (rlkit.transforms.update.LossScale) under FSDP2 over 2 processes
(CPU, gloo) equals one process.

A float16 actor lowered with ``Pipeline.lower`` is sharded in halves; over FSDP's DTensor shards the
optimizer steps the float16 weights themselves (no float32 master copies there), so both runs use
AdamW without master weights. The first update's advantages are so large that its scaled
gradients overflow: its mini-batches skip their step and halve the scale; the next two step and
(every ``GROWTH`` finite steps) double it again; the last overflows again. The overflow is decided from the global gradient
norm and a collective on the losses' finiteness, so every rank must skip, step and scale alike, and
as one process does on the same global batches. One 2-process job; the reference runs here.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytestmark = pytest.mark.distributed

LR = 1e-3
GROWTH = 2  # loss_scale_growth_interval: finite steps in a row that double the scale
ROWS = 8  # per update: 2 mini-batches of 4 rows, 2 rows per rank
# AdamW without master copies keeps float16 moments; rlkit picks torch's fused kernel (float32
# arithmetic) on the CPU, for FSDP's DTensor shards too (torch's default loop steps a float16 shard
# in float16, where eps=1e-8 is 0: the first step was inf/NaN on every rank). eps=1e-4: a second
# moment stored in float16 underflows for gradients below ~1e-3, and with eps=1e-8 the next step
# divides by ~0 (entries moved by 3.6, FSDP and one process 4.8 apart); at 1e-4 a step stays about
# lr, and the two runs end within a float16 ulp
OPT = dict(eps=1e-4)
START = 2.0**12  # the first loss scale
# each update's advantage magnitude: 1e4 makes the scaled gradients overflow at 2**12 and at 2**11
# by far (still at a tenth of it), 1 keeps them finite at 2**10 to 2**12 by far (still at 3 times
# it): the overflows must not hang on float rounding, which 2 processes and 1 do in other orders
ADV = (1e4, 1.0, 1.0, 1e4)


def _state():
    """A float16 tiny actor at loss scale ``START``, AdamW without master weights (the optimizer
    FSDP's shards get)."""
    import rlkit as rk
    from _workers import tiny_model, tiny_task

    task = tiny_task()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # rk.init's float16 warnings
        state = rk.init(tiny_model(task, dtype=torch.float16), rk.optim.adamw(lr=LR, master_weights=False, **OPT),
                        tokenizer=task.tokenizer)
    return task, state.replace(extras={"loss_scale/actor": START})


def _batches(task, model):
    """``len(ADV)`` global batches of random prompts and responses, their rollout log-probs from the
    initial weights (in float32), advantages of the magnitudes ``ADV``."""
    from rlkit.batch import make_batch
    from rlkit.transforms.forward import model_logprobs

    vocab = len(task.tokenizer)
    g = torch.Generator().manual_seed(0)
    out = []
    for adv in ADV:
        prompts = [torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(ROWS)]
        responses = [torch.randint(3, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(ROWS)]
        batch = make_batch(prompts, responses, group=[i // 4 for i in range(ROWS)], rewards=[0.0] * ROWS)
        batch.set("logprobs", model_logprobs(copy.deepcopy(model).float(), batch)[0])
        batch.set("advantages", adv * torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"])
        out.append(batch)
    return out


def _train(state, batches) -> tuple:
    """The updates, and after each: (scale, overflows, skipped steps, good steps, policy version)."""
    import rlkit as rk

    trace = []
    for batch in batches:
        # max_nonfinite_steps=1: a step skipped as non-finite, not as an overflow, raises
        state, metrics = rk.update(state, batch, mini_batch_size=ROWS // 2, max_nonfinite_steps=1, max_logprob_gap=None,
                                   loss_scale_growth_interval=GROWTH)
        trace.append((metrics["actor/loss_scale"], metrics["actor/loss_scale_overflows"], metrics["actor/skipped_steps"],
                      state.extras["loss_scale/actor"], state.extras["loss_scale/actor_good_steps"], state.policy_version))
    return state, trace


def _job() -> dict:
    import rlkit as rk
    from rlkit.parallel import init_distributed, shutdown

    info = init_distributed("gloo", timeout=60)
    try:
        task, state = _state()
        batches = _batches(task, state.actor)
        plan = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower()
        state = plan.shard(state)
        sharded = all(type(p.data) is not torch.Tensor for p in state.actor.parameters())
        fused = [g.get("fused") for g in state.optimizer.param_groups]
        state, trace = _train(state, batches)
        params = {k: v.full_tensor().detach().clone() for k, v in state.actor.named_parameters()}
        return {"rank": info.rank, "trace": trace, "params": params, "sharded": sharded, "fused": fused,
                "dtypes": sorted({str(p.dtype) for p in state.actor.parameters()})}
    finally:
        shutdown()


@pytest.fixture(scope="module")
def ranks():
    from rlkit.parallel.local import run_local

    return run_local(_job, 2, timeout=150, device="cpu")


@pytest.fixture(scope="module")
def single():
    """The same updates on one process, on the same global batches."""
    task, state = _state()
    start = {k: v.detach().clone() for k, v in state.actor.named_parameters()}
    state, trace = _train(state, _batches(task, state.actor))
    return start, trace, {k: v.detach().clone() for k, v in state.actor.named_parameters()}


def test_the_scenario_overflows_steps_grows_and_overflows_again(single):
    """The premise, on one process: update 0 overflows twice (2**12 -> 2**10), 1 and 2 step twice
    each and double the scale each (GROWTH = 2), 3 overflows twice after the steps."""
    _, trace, _ = single
    assert [t[0] for t in trace] == [2.0**10, 2.0**11, 2.0**12, 2.0**10]  # actor/loss_scale
    assert [t[1] for t in trace] == [2.0, 0.0, 0.0, 2.0]  # actor/loss_scale_overflows
    assert [t[2] for t in trace] == [0.0] * 4  # actor/skipped_steps: no non-finite step
    assert [t[5] for t in trace] == [0, 1, 2, 2]  # policy_version: the updates that stepped


def test_every_rank_holds_the_same_scale_and_overflow_count(ranks):
    assert all(r["sharded"] and r["dtypes"] == ["torch.float16"] for r in ranks)
    assert all(set(r["fused"]) == {True} for r in ranks)  # the shards step in torch's fused kernel
    assert ranks[0]["trace"] == ranks[1]["trace"]


def test_the_scale_trajectory_equals_one_process(ranks, single):
    _, trace, _ = single
    for r in ranks:
        assert r["trace"] == trace, (r["rank"], r["trace"], trace)


def test_the_parameters_match_one_process(ranks, single):
    start, _, params = single
    for r in ranks:
        assert r["params"].keys() == params.keys()
        moved = diff = 0.0
        for name, value in params.items():
            got = r["params"][name].float()
            moved += (value.float() - start[name].float()).pow(2).sum().item()
            diff += (got - value.float()).pow(2).sum().item()
            # 1e-3 at most here (a float16 ulp at 1.0): float sums in another order
            assert torch.allclose(got, value.float(), atol=2e-3, rtol=1e-2), (r["rank"], name, (got - value.float()).abs().max())
        # 0.007 here; a step that one run skipped and the other took is off by ~0.5
        assert moved > 0 and (diff / moved) ** 0.5 < 0.05, (r["rank"], (diff / moved) ** 0.5)
