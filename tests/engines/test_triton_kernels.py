"""The engine's Triton kernels against torch. Sampler: greedy = argmax (lowest index on ties),
log-probs = log_softmax, sample frequencies = softmax, draws independent of how the vocabulary is
split. Decode attention: equal to SDPA with the cache mask, and the engine using it decodes the
same tokens as the SDPA engine.

Runs where Triton can: on a CUDA machine, or on CPU under Triton's interpreter
(``TRITON_INTERPRET=1 python -m pytest tests/engines/test_triton_kernels.py``); skipped otherwise
(CI has no Triton). ``benchmarks/grpo_step.py --check`` repeats these checks at full size on GPU.
"""
import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from rlkit.engines import torch_engine as te  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sample(logits, temperature, seed=1234, step=0, split_size=None):
    sampler = te._make_sampler(logits.shape[0], logits.shape[1], DEVICE)
    if split_size is not None:  # force another split of the vocabulary
        b = logits.shape[0]
        n_splits = math.ceil(logits.shape[1] / split_size)
        f32 = dict(dtype=torch.float32, device=DEVICE)
        sampler = te._Sampler(
            seed=sampler.seed, n_splits=n_splits, split_size=split_size,
            partial=[torch.empty(b, n_splits, **f32) for _ in range(3)]
            + [torch.empty(b, n_splits, dtype=torch.int32, device=DEVICE), torch.empty(b, n_splits, **f32)],
            tokens=sampler.tokens, logprobs=sampler.logprobs,
        )
    sampler.seed.fill_(seed)
    tokens, lp = te.fused_sample(logits, sampler, torch.tensor(step, device=DEVICE), temperature)
    return tokens.clone(), lp.clone()


def test_greedy_is_argmax_with_lowest_index_ties_and_logprobs_are_log_softmax():
    torch.manual_seed(0)
    vocab = 5000  # not a multiple of the block: the masked tail is exercised
    logits = (torch.randn(6, vocab) * 3).to(torch.bfloat16)
    # exact ties inside one program (vocabulary split of 2048 columns here, 4 quarters of 512):
    # column 530 sits in a lower lane (18) than column 100 (lane 100), column 1500 in quarter 2
    logits[1, 530] = logits[1, 100] = logits[1, 1500] = 50.0
    logits[3, 4000] = logits[3, 2100] = logits[3, 17] = 50.0  # ties across programs
    logits[2, vocab - 1] = 40.0  # the maximum in the last, partial block
    logits = logits.to(DEVICE)
    tokens, lp = _sample(logits, 0.0)
    ref = logits.float().log_softmax(-1)
    assert torch.equal(tokens, logits.float().argmax(-1))
    assert tokens[1] == 100 and tokens[3] == 17 and tokens[2] == vocab - 1
    torch.testing.assert_close(lp, ref.gather(-1, tokens[:, None]).squeeze(-1), rtol=0, atol=5e-6)


def test_sampled_logprobs_are_those_of_the_tempered_distribution():
    torch.manual_seed(1)
    logits = (torch.randn(8, 3000) * 2).to(DEVICE)
    tokens, lp = _sample(logits, 0.7, seed=99)
    ref = (logits / 0.7).log_softmax(-1)
    torch.testing.assert_close(lp, ref.gather(-1, tokens[:, None]).squeeze(-1), rtol=0, atol=5e-6)


def test_frequencies_match_softmax():
    torch.manual_seed(2)
    rows, vocab, t = 3000, 6, 1.3
    row = torch.randn(vocab) * 1.5
    tokens, _ = _sample(row.expand(rows, vocab).contiguous().to(DEVICE), t, seed=7)
    probs = torch.softmax(row.double() / t, -1)
    freq = torch.bincount(tokens.cpu(), minlength=vocab).double() / rows
    sigma = torch.sqrt(probs * (1 - probs) / rows)
    assert float(((freq - probs).abs() / sigma).max()) < 4.5


def test_draws_do_not_depend_on_the_vocabulary_split_and_change_with_seed_and_step():
    torch.manual_seed(3)
    logits = torch.randn(5, 9000).to(DEVICE)  # flat-ish: many tokens can win
    a, lp_a = _sample(logits, 1.0, seed=5, step=3, split_size=2048)
    b, lp_b = _sample(logits, 1.0, seed=5, step=3, split_size=3 * 2048)
    c, _ = _sample(logits, 1.0, seed=5, step=3, split_size=5 * 2048)  # one split
    assert torch.equal(a, b) and torch.equal(a, c)
    torch.testing.assert_close(lp_a, lp_b, rtol=0, atol=1e-6)
    assert not torch.equal(a, _sample(logits, 1.0, seed=6, step=3)[0])
    assert not torch.equal(a, _sample(logits, 1.0, seed=5, step=4)[0])


def test_a_share_of_rows_draws_the_whole_batchs_noise_for_them():
    """``sampler.total_rows`` and the share's first row added to the seed: rows [2, 5) of a batch of
    7, sampled alone, draw what the whole batch's call draws for them (replicas splitting a batch
    sample what one process samples)."""
    torch.manual_seed(4)
    logits = torch.randn(7, 9000).to(DEVICE)
    whole, lp_whole = _sample(logits, 1.0, seed=5, step=3)
    sampler = te._make_sampler(3, logits.shape[1], DEVICE)
    sampler.total_rows = 7
    sampler.seed.fill_(5 + 2)
    share, lp_share = te.fused_sample(logits[2:5].contiguous(), sampler, torch.tensor(3, device=DEVICE), 1.0)
    assert torch.equal(share, whole[2:5])
    torch.testing.assert_close(lp_share, lp_whole[2:5], rtol=0, atol=1e-6)
    alone, _ = _sample(logits[2:5].contiguous(), 1.0, seed=5, step=3)
    assert not torch.equal(alone, whole[2:5])  # keyed as rows 0-2 of a batch of 3: other draws


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused sampler and CUDA graphs run on CUDA")
def test_engine_shares_with_rows_sample_the_whole_batch_with_graphs_and_the_fused_sampler():
    from rlkit.engines import SamplingParams, TorchEngine
    from rlkit.models import tiny
    from rlkit.models.tokenizers import char_tokenizer

    tok = char_tokenizer("0123456789+= abcdefghij")
    model = tiny(tok, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 initializer_range=0.2).to(DEVICE).eval()
    prompts = [tok.encode(t) for t in ["12+3=", "7", "abc def gh", "99", "1+1=", "ab"]]
    params = SamplingParams(n=2, max_new_tokens=12, temperature=1.0, stop_token_ids=(4, 7))
    engine = TorchEngine.from_model(model)
    assert engine.cuda_graphs and engine.fused_sampling
    whole = engine.generate(prompts, params, generator=torch.Generator(DEVICE).manual_seed(9))
    for start, size in ((0, 2), (2, 4)):
        for _ in range(2):  # the second call replays the kept graphs
            part = engine.generate(prompts[start:start + size], params, generator=torch.Generator(DEVICE).manual_seed(9),
                                   rows=(2 * start, 2 * len(prompts)))
            w = part.response_ids.shape[1]
            assert torch.equal(part.response_ids, whole.response_ids[2 * start:2 * (start + size), :w])
            torch.testing.assert_close(part.logprobs, whole.logprobs[2 * start:2 * (start + size), :w], rtol=0, atol=1e-4)


def _rotate(x, cos, sin):
    """transformers' rotary: x cos + rotate_half(x) sin, in float64"""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("slot", [0, 36, 64, 149])
def test_decode_attention_writes_the_cache_and_equals_sdpa_with_the_cache_mask(slot, rotary):
    torch.manual_seed(4)
    b, kvh, g, d, slots = 3, 2, 7, 64, 160
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    q = torch.randn(b, kvh, g, d, device=DEVICE, dtype=dtype)
    k_new = torch.randn(b, kvh, d, device=DEVICE, dtype=dtype)
    v_new = torch.randn(b, kvh, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b, kvh, slots, d, device=DEVICE, dtype=dtype)
    v = torch.randn(b, kvh, slots, d, device=DEVICE, dtype=dtype)
    valid = torch.rand(b, slots, device=DEVICE) < 0.7
    valid[:, slot] = True  # the slot being written is always valid
    valid[1, :slot] = False  # a row that sees only its newest token
    angle = torch.rand(b, d // 2, device=DEVICE) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    k_ref, v_ref = k.clone(), v.clone()
    rot = (cos, sin) if rotary else ()
    out = te.decode_attention(q, k_new, v_new, k, v, valid, torch.tensor([slot], device=DEVICE), d**-0.5, *rot)
    # reference: rotate in float64, write the cache, SDPA over [0, slot] with the mask
    qr, kr = q.double(), k_new.double()
    if rotary:
        c, s = cos.double()[:, None, None], sin.double()[:, None, None]
        qr, kr = _rotate(qr, c, s), _rotate(kr[:, :, None], c, s)[:, :, 0]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(k[:, :, slot].double(), kr, rtol=tol, atol=tol)  # the kernel wrote the cache
    k_ref[:, :, slot], v_ref[:, :, slot] = k[:, :, slot], v_new
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # the new value, and nothing else
    n = slot + 1
    mask = torch.zeros(b, 1, 1, n, device=DEVICE, dtype=torch.float64).masked_fill_(~valid[:, None, None, :n], float("-inf"))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qr, k_ref[:, :, :n].double(), v_ref[:, :, :n].double(), attn_mask=mask, scale=d**-0.5
    )
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(out[1].double(), v_new[1, :, None].double().expand(kvh, g, d), rtol=tol, atol=tol)


def test_engine_with_triton_decode_attention_decodes_like_sdpa():
    from rlkit.engines import SamplingParams, TorchEngine
    from rlkit.models import tiny
    from rlkit.models.tokenizers import char_tokenizer

    tok = char_tokenizer("0123456789+= abcdefghij")
    model = tiny(tok, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 initializer_range=0.2, tie_word_embeddings=False).to(DEVICE).eval()
    prompts = [tok.encode(t) for t in ["12+3=", "7", "abc def gh", "99"]]
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0, ignore_stop=True)
    kw = dict(cuda_graphs=False, compile_decode=False, fuse=False, fused_sampling=False)
    fast = TorchEngine.from_model(model, decode_attention="triton", **kw)
    assert fast.decode_attention == "triton"
    a = fast.generate(prompts, params)
    b = TorchEngine.from_model(model, decode_attention="sdpa", **kw).generate(prompts, params)
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
