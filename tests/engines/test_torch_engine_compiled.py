"""The engine's compiled decode structures compute what the plain eager step computes.

On CPU ``compile_decode=True`` compiles the whole decode step as one graph (``"step"``); the
tests below run it through inductor, as a user's CPU run does, and through dynamo's eager
backend for the cases that only check the step's structure.

On CUDA the decode step runs through ``torch.compile``d pieces; two layouts exist
(``FUSE_DECODE_EPILOGUES``): two halves per layer with separate cache copies, or a layer entry
that adds the previous layer's deferred MLP output and writes k/v into the cache inside the
compiled code. Here the pieces are compiled with dynamo's "eager" backend on CPU, which checks the
restructuring (deferred residuals, in-graph cache writes, the final norm) token for token; that
inductor's kernels equal the eager ones on GPU is checked by ``benchmarks/grpo_step.py --check``.
"""
import pytest
import torch

from rlkit.batch import make_batch
from rlkit.engines import SamplingParams, TorchEngine
from rlkit.engines import torch_engine as te
from rlkit.models import response_logprobs


@pytest.fixture
def eager_backend_pieces(monkeypatch):
    monkeypatch.setattr(te, "_COMPILED", tuple(torch.compile(fn, backend="eager", dynamic=False) for fn in te._DECODE_PIECES))


def _triton_interpreted() -> bool:
    """Triton's interpreter runs the kernels on this module's CPU model (GPU runs: grpo_step.py --check)."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1" and te._triton_kernels() is not None


ATTENTION = [("sdpa", True, True), ("sdpa", False, True)]
if _triton_interpreted():  # the Triton kernel applies rotary and writes the cache itself, or only attends
    ATTENTION += [("triton", True, True), ("triton", True, False)]


@pytest.mark.parametrize("attention,fused_epilogues,rotary_in_kernel", ATTENTION)
def test_compiled_decode_equals_the_plain_step(model, prompts, eager_backend_pieces, monkeypatch, attention, fused_epilogues,
                                               rotary_in_kernel):
    monkeypatch.setattr(te, "FUSE_DECODE_EPILOGUES", fused_epilogues)
    monkeypatch.setattr(te, "FUSE_ROTARY_ATTENTION", rotary_in_kernel)
    params = SamplingParams(n=2, max_new_tokens=9, temperature=0, ignore_stop=True)
    compiled = TorchEngine.from_model(model, compile_decode="pieces", decode_attention=attention)
    assert compiled._compiled is not None
    plain = TorchEngine.from_model(model, compile_decode=False, decode_attention="sdpa")
    fast, ref = compiled.generate(prompts, params), plain.generate(prompts, params)
    assert compiled.compile_error is None
    assert torch.equal(fast.response_ids, ref.response_ids)
    # the restructured SDPA step sums in the same order; the Triton kernel's online softmax does not
    torch.testing.assert_close(fast.logprobs, ref.logprobs, rtol=0, atol=1e-6 if attention == "sdpa" else 1e-5)
    # and the behaviour log-probs are the training forward's on the same tokens
    batch = make_batch([prompts[i] for i in fast.prompt_index.tolist()], [r.tolist() for r in fast.response_ids])
    with torch.no_grad():
        train, _ = response_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"])
    torch.testing.assert_close(fast.logprobs, train, rtol=0, atol=1e-5)


def test_a_failing_compiled_step_falls_back_to_eager(model, prompts, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(te, "_COMPILED", (broken,) * len(te._DECODE_PIECES))
    params = SamplingParams(n=1, max_new_tokens=6, temperature=0, ignore_stop=True)
    engine = TorchEngine.from_model(model, compile_decode="pieces")
    out = engine.generate(prompts, params)
    assert "compiler exploded" in engine.compile_error and engine._compiled is None
    ref = TorchEngine.from_model(model, compile_decode=False).generate(prompts, params)
    assert torch.equal(out.response_ids, ref.response_ids)


# --------------------------------------------------------------------------------------------
# compile_decode="step": the whole decode step as one graph (the CPU default of compile_decode=True)

needs_cxx = pytest.mark.skipif(
    __import__("shutil").which("g++") is None and __import__("shutil").which("c++") is None,
    reason="inductor's CPU backend needs a C++ compiler",
)


def _eager_backend_step(engine):
    """Compile the engine's step with dynamo's eager backend: the graph capture, no code generation."""
    engine._whole_step = torch.compile(engine._decode_step_impl, backend="eager", dynamic=None)
    return engine


def test_compile_decode_true_means_the_whole_step_on_cpu(model):
    engine = TorchEngine.from_model(model, compile_decode=True)
    assert engine.compile_mode == "step" and engine._whole_step is not None and engine._compiled is None
    assert TorchEngine.from_model(model).compile_mode is None  # off by default on CPU
    assert TorchEngine.from_model(model, compile_decode="pieces").compile_mode == "pieces"
    with pytest.raises(ValueError, match="compile_decode must be"):
        TorchEngine.from_model(model, compile_decode="graph")


@needs_cxx
def test_inductor_compiled_step_samples_what_the_eager_step_samples(model, prompts):
    """Through inductor's C++ kernels: with the same generator the same tokens are sampled (the
    noise is drawn outside the graph), and the behaviour log-probs agree to float32 rounding."""
    params = SamplingParams(n=3, max_new_tokens=10, temperature=1.0, ignore_stop=True)
    compiled = TorchEngine.from_model(model, compile_decode=True)
    plain = TorchEngine.from_model(model)
    for seed in (0, 1):
        fast = compiled.generate(prompts, params, generator=torch.Generator().manual_seed(seed))
        ref = plain.generate(prompts, params, generator=torch.Generator().manual_seed(seed))
        assert compiled.compile_error is None
        assert torch.equal(fast.response_ids, ref.response_ids)
        torch.testing.assert_close(fast.logprobs, ref.logprobs, rtol=0, atol=1e-5)
    # a different seed samples different tokens: the noise really comes from the generator
    other = compiled.generate(prompts, params, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(other.response_ids, fast.response_ids)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8)])
def test_compiled_step_over_several_cache_buckets(model, prompts, tok, temperature, top_k, top_p):
    """Greedy, top-k and top-p sampling, stop tokens, and a response long enough to cross several
    cache buckets (each bucket length is another graph; masked slots past the filled ones)."""
    params = SamplingParams(n=2, max_new_tokens=14, temperature=temperature, top_k=top_k, top_p=top_p,
                            stop_token_ids=(tok.convert_tokens_to_ids("="),))
    compiled = _eager_backend_step(TorchEngine.from_model(model, compile_decode=True, cache_bucket=4))
    plain = TorchEngine.from_model(model, cache_bucket=4)
    fast = compiled.generate(prompts, params, generator=torch.Generator().manual_seed(3))
    ref = plain.generate(prompts, params, generator=torch.Generator().manual_seed(3))
    assert compiled.compile_error is None
    assert torch.equal(fast.response_ids, ref.response_ids) and torch.equal(fast.response_mask, ref.response_mask)
    assert torch.equal(fast.truncated, ref.truncated)
    # bucketed attention sums over masked slots too, a different summation order than the eager step's
    torch.testing.assert_close(fast.logprobs, ref.logprobs, rtol=0, atol=1e-5)


def test_a_failing_compiled_whole_step_falls_back_to_eager(model, prompts):
    def broken(*args, **kwargs):
        raise RuntimeError("compiler exploded")

    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, ignore_stop=True)
    engine = TorchEngine.from_model(model, compile_decode=True)
    engine._whole_step = broken
    with pytest.warns(RuntimeWarning, match="continues eagerly"):
        out = engine.generate(prompts, params, generator=torch.Generator().manual_seed(0))
    assert "compiler exploded" in engine.compile_error and engine._whole_step is None
    ref = TorchEngine.from_model(model).generate(prompts, params, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.response_ids, ref.response_ids)


def test_the_recompile_limit_is_a_named_fallback_not_a_silent_eager_step(model, prompts):
    # each engine and cache bucket is another dynamo variant of one code object; at dynamo's
    # limit the step would silently run eagerly inside the "compiled" engine. It must instead
    # fall back visibly: a warning, engine.compile_error, and the eager step's tokens
    params = SamplingParams(n=2, max_new_tokens=10, temperature=1.0, ignore_stop=True)
    engine = _eager_backend_step(TorchEngine.from_model(model, compile_decode=True, cache_bucket=2))
    # after the engine raised the limit; through dynamo's own patch: with pytest 9.2, undoing a
    # monkeypatch of this config module left recompile_limit unreadable for later tests
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(RuntimeWarning, match="continues eagerly"):
        out = engine.generate(prompts, params, generator=torch.Generator().manual_seed(0))
    assert "RecompileLimit" in engine.compile_error and engine._whole_step is None
    ref = TorchEngine.from_model(model, cache_bucket=2).generate(prompts, params, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.response_ids, ref.response_ids)


def test_the_default_compiles_on_cuda_only_models_big_enough_to_pay():
    from rlkit.engines.torch_engine import _compile_by_default
    from rlkit.models.compile import AUTO_MIN_PARAMS

    half = torch.empty(AUTO_MIN_PARAMS // 2, device="meta")
    other = torch.empty(AUTO_MIN_PARAMS // 2, device="meta")
    assert _compile_by_default(True, {"a": half, "b": other})
    assert not _compile_by_default(True, {"a": half, "b": half})  # a tied weight counts once
    assert not _compile_by_default(False, {"a": half, "b": other})  # never by default on CPU
