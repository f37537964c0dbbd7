"""The engine's compiled decode structures compute what the plain eager step computes.

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
    compiled = TorchEngine.from_model(model, compile_decode=True, decode_attention=attention)
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
    engine = TorchEngine.from_model(model, compile_decode=True)
    out = engine.generate(prompts, params)
    assert "compiler exploded" in engine.compile_error and engine._compiled is None
    ref = TorchEngine.from_model(model, compile_decode=False).generate(prompts, params)
    assert torch.equal(out.response_ids, ref.response_ids)
