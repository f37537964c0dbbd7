"""What the engine does around CUDA-graph capture, on CPU: captured steps replay what eager steps
compute; calls whose prompt widths differ by a few tokens reuse one plan and its graphs; a capture
that fails falls back to eager decoding with one warning, and under tensor parallelism the ranks
agree on that.

CPU has no CUDA graphs, so ``TorchEngine._capture`` is replaced by a fake with a CUDA graph's
semantics: capturing records the step without running it, and ``replay()`` runs it. A failing
capture raises before anything runs, as a capture that fails part-way records nothing that runs.
The real capture path is covered on GPUs by ``tests/engines/test_torch_engine_compiled.py`` and
the GPU benchmarks.
"""
import warnings

import pytest
import torch

from rlkit.engines import SamplingParams, TorchEngine
from rlkit.models import tiny
from rlkit.models.tokenizers import char_tokenizer
from rlkit.parallel.local import run_local

TEXTS = ["12+3=", "7", "abc def gh", "99"]


class _FakeGraph:
    def __init__(self, step):
        self.step = step
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.step()


def _fake_capture(fail: bool, log: list | None = None):
    def capture(self, plan, step):
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        if log is not None:
            log.append(plan.key)
        return _FakeGraph(step)

    return capture


def _setup():
    tok = char_tokenizer("0123456789+= abcdefghij")
    model = tiny(tok, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 initializer_range=0.2, tie_word_embeddings=False).eval()
    return model, [tok.encode(t) for t in TEXTS]


def _generate(engine, prompts, graphs: bool, calls: int = 2):
    """``calls`` greedy generations (the plan, and its graphs, are kept between calls); the
    engine's ``cuda_graphs`` switched on by hand, as CPU engines never capture."""
    engine.cuda_graphs = graphs
    params = SamplingParams(n=2, max_new_tokens=10, temperature=0.0, ignore_stop=True)
    outs = [engine.generate(prompts, params) for _ in range(calls)]
    return [(o.response_ids.clone(), o.logprobs.clone(), o.metrics["graphs"]) for o in outs]


def test_captured_steps_replay_what_the_eager_steps_compute(monkeypatch):
    monkeypatch.setattr(TorchEngine, "_capture", _fake_capture(fail=False))
    model, prompts = _setup()
    engine = TorchEngine.from_model(model, fuse=False, compile_decode=False, cache_bucket=4)
    eager = _generate(TorchEngine.from_model(model, fuse=False, compile_decode=False, cache_bucket=4), prompts, False,
                      calls=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no capture failure, no warning
        graphed = _generate(engine, prompts, True, calls=3)
    # several lengths; a length first run in the last steps of a call is captured in the next one
    assert 2 <= graphed[0][2] <= graphed[1][2] == graphed[2][2]
    assert all(g.replays > 0 for g in engine._plan.graphs.values())
    for (ids, lp, _), (ref_ids, ref_lp, _) in zip(graphed, eager):
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)  # graphed steps attend over bucketed lengths


def test_a_failed_capture_warns_once_and_decodes_eagerly(monkeypatch):
    monkeypatch.setattr(TorchEngine, "_capture", _fake_capture(fail=True))
    model, prompts = _setup()
    engine = TorchEngine.from_model(model, fuse=False, compile_decode=False, cache_bucket=4)
    eager = _generate(TorchEngine.from_model(model, fuse=False, compile_decode=False, cache_bucket=4), prompts, False)
    with pytest.warns(RuntimeWarning, match=r"capturing the decode step.*failed \(RuntimeError: operation not "
                      r"permitted.*cuda_graphs=False") as record:
        got = _generate(engine, prompts, True)
    assert len([w for w in record if "CUDA graph" in str(w.message)]) == 1  # once per plan, not per step
    assert "tensor-parallel" not in str(record[0].message)
    for (ids, lp, n_graphs), (ref_ids, ref_lp, _) in zip(got, eager):
        assert n_graphs == 0
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)  # graphed steps attend over bucketed lengths


def _tp_worker(failing_rank):
    import torch.distributed as dist

    from rlkit.parallel import init_distributed, shutdown
    from rlkit.parallel.reshard import shard_dim

    init_distributed("gloo")
    try:
        rank = dist.get_rank()
        TorchEngine._capture = _fake_capture(fail=rank == failing_rank)
        model, prompts = _setup()
        shards = {}
        for name, p in model.named_parameters():
            dim = shard_dim(name, p.dim())
            shards[name] = p.detach() if dim is None else p.detach().chunk(2, dim)[rank].clone()
        engine = TorchEngine(model.config, shards, tp_group=dist.group.WORLD, decode_attention="sdpa", fuse=False,
                             compile_decode=False, cache_bucket=4)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = _generate(engine, prompts, True)
        return {"out": out, "warnings": [str(w.message) for w in record if "CUDA graph" in str(w.message)]}
    finally:
        shutdown()


@pytest.mark.distributed
def test_tensor_parallel_ranks_agree_when_one_rank_fails_to_capture():
    results = run_local(_tp_worker, 2, 1, timeout=240)
    model, prompts = _setup()
    single = _generate(TorchEngine.from_model(model, fuse=False, compile_decode=False, cache_bucket=4), prompts, False)
    for rank, result in enumerate(results):
        # both ranks stopped capturing, not just the one that failed, and both say which rank failed
        assert len(result["warnings"]) == 1, (rank, result["warnings"])
        assert "rank(s) [1] of its tensor-parallel group" in result["warnings"][0]
        assert ("RuntimeError" in result["warnings"][0]) == (rank == 1)
        for (ids, lp, n_graphs), (ref_ids, ref_lp, _) in zip(result["out"], single):
            assert n_graphs == 0, rank
            assert torch.equal(ids, ref_ids), rank
            torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)


def test_prompts_a_few_tokens_longer_reuse_the_kept_plan_and_its_graphs(monkeypatch):
    captures = []
    monkeypatch.setattr(TorchEngine, "_capture", _fake_capture(fail=False, log=captures))
    model, _ = _setup()
    tok = char_tokenizer("0123456789+= abcdefghij")
    calls = [["12+3=", "7"], ["12+34=", "99"], ["1+2+3+4=", "5"], ["12+3=", "7"]]  # longest prompt 5, 6, 8, 5
    params = SamplingParams(n=2, max_new_tokens=10, temperature=0.0, ignore_stop=True)

    def run(engine, graphs):
        engine.cuda_graphs = graphs
        out, plans = [], []
        for texts in calls:
            g = engine.generate([tok.encode(t) for t in texts], params)
            out.append((g.response_ids.clone(), g.logprobs.clone()))
            plans.append(engine._plan)
        return out, plans

    eager, _ = run(TorchEngine.from_model(model, fuse=False, compile_decode=False, cache_bucket=4), False)
    bucketed, plans = run(TorchEngine.from_model(model, fuse=False, compile_decode=False, cache_bucket=4,
                                                 prompt_bucket=8), True)
    assert all(p is plans[0] for p in plans) and plans[0].state.prompt_width == 8
    n_bucketed = len(captures)
    assert n_bucketed == len(plans[0].graphs) > 0  # captured once, then replayed by the later calls
    captures.clear()
    _, unbucketed = run(TorchEngine.from_model(model, fuse=False, compile_decode=False, cache_bucket=4,
                                               prompt_bucket=1), True)
    assert len({id(p) for p in unbucketed}) == 4 and len(captures) > 2 * n_bucketed  # a new plan per width
    for (ids, lp), (ref_ids, ref_lp) in zip(bucketed, eager):
        assert torch.equal(ids, ref_ids)  # the extra left padding changes nothing but rounding
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)


def test_prompt_bucket_must_be_positive():
    model, _ = _setup()
    with pytest.raises(ValueError, match="prompt_bucket must be >= 1"):
        TorchEngine.from_model(model, prompt_bucket=0)
