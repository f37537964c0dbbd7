import copy
import math

import pytest
import torch

from rlkit.batch import make_batch
from rlkit.models import (
    LogprobModule,
    critic,
    response_logprobs,
    tiny,
    token_logprobs,
    values_for_response,
)
from rlkit.models.logprobs import ValueModule
from rlkit.models.tokenizers import char_tokenizer

# rows of different prompt / response lengths, including a 1-token prompt and a 1-token response
PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [4, 4], [7, 8, 9, 10]]
RESPONSES = [[5, 5, 5, 6], [7], [8, 9], [10, 11, 12], [13, 14, 15, 16, 4, 5]]


@pytest.fixture(scope="module")
def model():
    tok = char_tokenizer("0123456789+= ")
    # a larger init than the default 0.02 gives peaked, varied distributions (a stronger test)
    return tiny(tok, hidden_size=64, intermediate_size=128, initializer_range=0.2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def batch():
    return make_batch(PROMPTS, RESPONSES, pad_token_id=0)


def _args(batch):
    return batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"]


def _reference(model, temperature=1.0):
    """Row by row, unpadded, full logits, float64 log-softmax: obviously correct and slow."""
    lp = torch.zeros(len(PROMPTS), max(map(len, RESPONSES)), dtype=torch.float64)
    ent = torch.zeros_like(lp)
    rows = []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        logits = model(torch.tensor([p + r])).logits[0].double() / temperature
        logp = logits.log_softmax(-1)
        for j, token in enumerate(r):
            pos = len(p) - 1 + j  # the position whose logits predict response token j
            rows.append(logp[pos, token])
            lp[i, j] = logp[pos, token].detach()
            ent[i, j] = -(logp[pos].exp() * logp[pos]).sum().detach()
    return lp, ent, torch.stack(rows)


def test_token_logprobs_hand_worked():
    logits = torch.tensor([[0.0, math.log(3.0)], [2.0, 2.0]])
    lp, ent = token_logprobs(logits, torch.tensor([1, 0]), with_entropy=True)
    torch.testing.assert_close(lp, torch.tensor([math.log(0.75), math.log(0.5)]))
    h0 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(ent, torch.tensor([h0, math.log(2.0)]))
    # temperature 2 halves the logits: p = (1, sqrt 3) / (1 + sqrt 3)
    lp2, _ = token_logprobs(logits[:1], torch.tensor([1]), temperature=2.0)
    torch.testing.assert_close(lp2, torch.tensor([math.log(math.sqrt(3) / (1 + math.sqrt(3)))]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_equals_padded_equals_reference(model, batch, temperature):
    with torch.no_grad():
        packed_lp, packed_ent = response_logprobs(model, *_args(batch), temperature=temperature, with_entropy=True)
        padded_lp, padded_ent = response_logprobs(
            model, *_args(batch), temperature=temperature, with_entropy=True, layout="padded"
        )
        ref_lp, ref_ent, _ = _reference(model, temperature)
    assert packed_lp.dtype == torch.float32 and packed_lp.shape == batch["response_ids"].shape
    torch.testing.assert_close(packed_lp, padded_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_ent, padded_ent, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_ent.double(), ref_ent, rtol=0, atol=1e-5)
    # masked positions are exactly 0, and the distributions are far from uniform (a meaningful test)
    mask = batch["response_mask"]
    assert (packed_lp[~mask] == 0).all() and (packed_ent[~mask] == 0).all()
    assert packed_lp[mask].std() > 0.3


def test_chunking_does_not_change_results(model, batch):
    with torch.no_grad():
        whole, whole_ent = response_logprobs(model, *_args(batch), with_entropy=True, chunk_tokens=4096)
        for chunk in (1, 3, 7):
            lp, ent = response_logprobs(model, *_args(batch), with_entropy=True, chunk_tokens=chunk)
            # equal up to float32 rounding: the head's matrix product over 1, 3 or 7 rows may block
            # its sums differently from one over all rows (seen on an AVX2 CPU: 5 ulps of a log-prob
            # near -3), so a few ulps relative, not a fixed absolute bound
            torch.testing.assert_close(lp, whole, rtol=2e-6, atol=1e-6)
            torch.testing.assert_close(ent, whole_ent, rtol=2e-6, atol=1e-6)
        no_entropy = response_logprobs(model, *_args(batch))
    assert no_entropy[1] is None


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_small_chunks_skip_the_checkpoint_with_the_same_gradients(model, batch, monkeypatch):
    # a chunk of few logits keeps them for the backward instead of recomputing the head; large
    # ones are checkpointed; values and gradients are the same either way, bit for bit
    from rlkit.models import logprobs as L

    calls = []
    real = L.checkpoint
    monkeypatch.setattr(L, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    results = []
    for threshold in (0, L.CHECKPOINT_MIN_LOGITS):
        monkeypatch.setattr(L, "CHECKPOINT_MIN_LOGITS", threshold)
        calls.clear()
        lp, ent = response_logprobs(model, *_args(batch), with_entropy=True, chunk_tokens=4)
        grads = _grads(model, (lp * torch.linspace(-1, 1, lp.numel()).view(lp.shape)).sum() + ent.sum())
        results.append((lp.detach(), ent.detach(), grads, len(calls)))
    (lp0, ent0, g0, n0), (lp1, ent1, g1, n1) = results
    assert n0 == 4 and n1 == 0  # 16 response tokens in chunks of 4: all checkpointed, then none
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def test_keep_logits_follows_the_memory_left_with_the_same_gradients(model, batch, monkeypatch):
    # KEEP_LOGITS="auto" keeps every chunk's logits for the backward when the call's logits take
    # at most KEEP_LOGITS_FRACTION of the memory the device has left, else checkpoints the big
    # chunks; the device's memory is simulated here (the CPU has no such probe: "auto" follows
    # CHECKPOINT_MIN_LOGITS there). Values and gradients are the same either way, bit for bit.
    from rlkit.models import logprobs as L

    calls = []
    real = L.checkpoint
    monkeypatch.setattr(L, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(L, "CHECKPOINT_MIN_LOGITS", 0)  # every chunk counts as big
    vocab = model.get_output_embeddings().out_features
    tokens = int(batch["response_mask"].sum())  # 16: four chunks of 4
    logits_bytes = tokens * vocab * 4  # float32 head
    results = {}
    for left, keeps in ((None, False), (4 * logits_bytes, True), (4 * logits_bytes - 1, False)):
        monkeypatch.setattr(L, "_device_bytes_left", lambda device, left=left: left)
        assert L.keeps_logits(tokens, vocab, 4, torch.device("cpu")) is keeps
        calls.clear()
        lp, ent = response_logprobs(model, *_args(batch), with_entropy=True, chunk_tokens=4)
        grads = _grads(model, (lp * torch.linspace(-1, 1, lp.numel()).view(lp.shape)).sum() + ent.sum())
        assert len(calls) == (0 if keeps else 4), (left, len(calls))
        results[keeps] = (lp.detach(), ent.detach(), grads)
        with torch.no_grad():  # forward-only passes never checkpoint, whatever the memory
            calls.clear()
            response_logprobs(model, *_args(batch), chunk_tokens=4)
            assert not calls
    (lp0, ent0, g0), (lp1, ent1, g1) = results[False], results[True]
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    for forced in (True, False):  # the flag overrides the probe
        monkeypatch.setattr(L, "KEEP_LOGITS", forced)
        assert L.keeps_logits(tokens, vocab, 4, torch.device("cpu")) is forced


def test_gradients_packed_padded_reference(model, batch):
    weights = torch.linspace(-1.0, 2.0, batch["response_ids"].numel()).view(batch["response_ids"].shape)
    grads = {}
    for layout in ("packed", "padded"):
        lp, ent = response_logprobs(model, *_args(batch), layout=layout, with_entropy=True, chunk_tokens=4)
        grads[layout] = _grads(model, (lp * weights).sum() + 0.1 * ent.sum())
    _, _, ref_rows = _reference(model)
    mask = batch["response_mask"]
    logits_rows = []  # entropy rows of the reference, recomputed with grad
    for p, r in zip(PROMPTS, RESPONSES):
        logp = model(torch.tensor([p + r])).logits[0].double().log_softmax(-1)
        logits_rows.append(-(logp.exp() * logp).sum(-1)[len(p) - 1 : len(p) - 1 + len(r)])
    ref_loss = (ref_rows * weights[mask].double()).sum() + 0.1 * torch.cat(logits_rows).sum()
    grads["reference"] = _grads(model, ref_loss)
    for name, g in grads["reference"].items():
        scale = g.abs().max().item() + 1e-12
        torch.testing.assert_close(grads["packed"][name], g.float(), rtol=0, atol=1e-5 * max(1.0, scale), msg=name)
        torch.testing.assert_close(grads["padded"][name], g.float(), rtol=0, atol=1e-5 * max(1.0, scale), msg=name)
    assert any(g.abs().max() > 1e-3 for g in grads["packed"].values())
    model.zero_grad(set_to_none=True)


def test_eager_attention_packed_equals_padded(batch):
    model = tiny(20, hidden_size=64, intermediate_size=128, initializer_range=0.2, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        a, _ = response_logprobs(model, *_args(batch))
        b, _ = response_logprobs(model, *_args(batch), layout="padded")
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_logprob_module_is_one_module_call(model, batch):
    module = LogprobModule(model)
    assert isinstance(module, torch.nn.Module)
    assert {n for n, _ in module.named_parameters()} == {"model." + n for n, _ in model.named_parameters()}
    calls = []
    handle = module.register_forward_pre_hook(lambda m, args: calls.append(1))
    with torch.no_grad():
        via_module, _ = response_logprobs(module, *_args(batch))
        direct, _ = response_logprobs(model, *_args(batch))
    handle.remove()
    assert calls == [1]  # response_logprobs called the wrapper itself (FSDP2's hooks fire there)
    torch.testing.assert_close(via_module, direct, rtol=0, atol=0)
    # no view: FSDP2 warns at every forward of a sharded module whose output is one
    logprobs, entropy = module(*_args(batch), with_entropy=True)
    assert not logprobs._is_view() and not entropy._is_view()
    values = ValueModule(critic(model))(*_args(batch))
    assert not values._is_view()


def test_bad_inputs_are_named(model, batch):
    args = _args(batch)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        response_logprobs(model, *args, temperature=0.0)
    with pytest.raises(ValueError, match="layout must be one of"):
        response_logprobs(model, *args, layout="ragged")
    right_padded_prompt = args[1].flip(-1)
    with pytest.raises(ValueError, match="prompt_mask"):
        response_logprobs(model, args[0], right_padded_prompt, args[2], args[3])
    left_padded_response = args[3].flip(-1)
    with pytest.raises(ValueError, match="response_mask is not right-padded"):
        response_logprobs(model, args[0], args[1], args[2], left_padded_response)


def test_values_packed_padded_and_alignment(model, batch):
    value_model = critic(model)
    with torch.no_grad():
        packed_v = values_for_response(value_model, *_args(batch))
        padded_v = values_for_response(value_model, *_args(batch), layout="padded")
        torch.testing.assert_close(packed_v, padded_v, rtol=0, atol=1e-5)
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
            full = value_model(torch.tensor([p + r])).logits[0, :, 0]
            # verl: the value of token j sits at the position that predicts it
            torch.testing.assert_close(packed_v[i, : len(r)], full[len(p) - 1 : len(p) - 1 + len(r)], rtol=0, atol=1e-5)
            assert (packed_v[i, len(r) :] == 0).all()
    # gradients flow to the critic
    values_for_response(value_model, *_args(batch)).sum().backward()
    assert value_model.score.weight.grad.abs().sum() > 0


def test_packed_rows_through_padded_segments_equal_the_padded_layout(model, batch, monkeypatch):
    """The CPU path for long packed batches (each row scattered into a padded batch for SDPA)
    gives the padded layout's log-probs and gradients."""
    from rlkit.models import logprobs as L

    monkeypatch.setattr(L, "CPU_DENSE_MASK_MAX_TOKENS", 0)  # every packed batch takes that path
    monkeypatch.setattr(L, "SHARE_PROMPTS", False)
    calls = []
    monkeypatch.setattr(L, "_padded_segments", lambda *a, _f=L._padded_segments: calls.append(1) or _f(*a))
    model = copy.deepcopy(model).double()  # float64: the two layouts must agree to rounding
    results = []
    for layout in ("packed", "padded"):
        model.zero_grad(set_to_none=True)
        lp, _ = response_logprobs(model, *_args(batch), layout=layout)
        (lp * torch.arange(lp.numel(), dtype=lp.dtype).reshape(lp.shape)).sum().backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert calls, "the packed call did not go through the padded-segments attention"
    (lp0, g0), (lp1, g1) = results
    torch.testing.assert_close(lp0, lp1, rtol=0, atol=1e-6)  # log-probs are computed in float32
    for name in g1:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-9, atol=1e-9 * float(g1[name].abs().max()), msg=name)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_cpu_math_attention_matches_sdpa_in_values_and_gradients(heads, kv_heads):
    # the CPU padded-segment attention (two batched products, GQA without repeating keys) against
    # SDPA with repeated keys/values, in float64: bottom-right causal masks with padded keys
    from rlkit.models.logprobs import _causal_mask, _math_attention

    g = torch.Generator().manual_seed(0)
    s, lq, lk, d = 5, 4, 7, 8
    q_len, k_len = torch.tensor([4, 1, 3, 4, 2]), torch.tensor([7, 1, 5, 4, 6])
    mask = _causal_mask(q_len, k_len, lq, lk)
    q = torch.randn(s, heads, lq, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(s, kv_heads, lk, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(s, heads, lq, d, generator=g, dtype=torch.float64)
    groups = heads // kv_heads
    ours = _math_attention(q, k, v, mask, 0.3, groups)
    grads = torch.autograd.grad(ours, (q, k, v), grad_out)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask, scale=0.3)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # a key past a row's end or after its causal limit gets no weight: its value does not matter
    assert grads[2][1, :, 1:].abs().max() == 0
    # float32 in, float32 out; bf16 in: computed in float32, returned in bf16
    assert _math_attention(q.float(), k.float(), v.float(), mask, None, groups).dtype == torch.float32
    assert _math_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, None, groups).dtype == torch.bfloat16


def test_take_rows_gathers_like_indexing_with_gradients_summed_over_repeats(monkeypatch):
    # the CPU row gather (index_select, backward index_add_) against plain indexing: the same rows,
    # and a row taken several times gets the sum of its slots' gradients
    from rlkit.models import logprobs as L

    g = torch.Generator().manual_seed(0)
    src = torch.randn(7, 3, 2, generator=g, dtype=torch.float64)
    index = torch.tensor([[0, 6, 6], [2, 0, 6]])
    grad_out = torch.randn(2, 3, 3, 2, generator=g, dtype=torch.float64)
    results = []
    for flag in (True, False):
        monkeypatch.setattr(L, "CPU_INDEX_SELECT", flag)
        x = src.clone().requires_grad_()
        out = L._take_rows(x, index)
        out.backward(grad_out)
        results.append((out.detach(), x.grad))
    (out, grad), (ref, ref_grad) = results
    assert out.shape == (2, 3, 3, 2) and torch.equal(out, ref)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad[6], grad_out[0, 1] + grad_out[0, 2] + grad_out[1, 2])
    assert (grad[[1, 3, 4, 5]] == 0).all()


def test_token_entropy_with_a_minus_inf_logit_is_finite_with_a_finite_gradient():
    """A masked vocabulary entry (-inf logit) has probability 0 and adds nothing to the entropy;
    ``softmax(z) * z`` made it 0 * -inf = NaN, in the value and the gradient."""
    from rlkit.models.logprobs import token_logprobs

    z = torch.tensor([[1.0, -0.5, float("-inf"), 2.0], [0.3, float("-inf"), float("-inf"), 0.1]], requires_grad=True)
    targets = torch.tensor([3, 0])
    lp, ent = token_logprobs(z, targets, with_entropy=True)
    finite = [z.detach()[i][torch.isfinite(z.detach()[i])] for i in range(2)]
    expected = torch.stack([-(f.softmax(-1) * f.log_softmax(-1)).sum() for f in finite])  # over the reachable tokens only
    assert torch.allclose(ent, expected, atol=1e-6) and torch.isfinite(lp).all()
    (ent.sum() + lp.sum()).backward()
    assert torch.isfinite(z.grad).all()


def _vocab(model):
    return model.get_input_embeddings().num_embeddings


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_token_ids_outside_the_vocabulary_under_the_masks_are_named(model, batch, layout):
    """Row 0's last response token is only a target in the drop-last packed layout (never
    embedded): its id was not checked, a bare gather IndexError on CPU and an out-of-bounds read
    by the fused kernel on CUDA. Every id under the masks is now checked, naming the field."""
    vocab = _vocab(model)
    p_ids, p_mask, r_ids, r_mask = _args(batch)
    last = len(RESPONSES[0]) - 1
    for bad in (vocab, vocab + 1000, -1):
        r = r_ids.clone()
        r[0, last] = bad
        with torch.no_grad(), pytest.raises(ValueError, match=rf"response_ids holds token id {bad} at row 0, column {last}, outside the model's vocabulary \[0, {vocab}\)"):
            response_logprobs(model, p_ids, p_mask, r, r_mask, layout=layout)
        p = p_ids.clone()
        p[2, -1] = bad
        with torch.no_grad(), pytest.raises(ValueError, match=rf"prompt_ids holds token id {bad} at row 2"):
            response_logprobs(model, p, p_mask, r_ids, r_mask, layout=layout)
    # the critic's forward checks them too
    r = r_ids.clone()
    r[0, last] = vocab
    with torch.no_grad(), pytest.raises(ValueError, match="response_ids holds token id"):
        values_for_response(critic(model), p_ids, p_mask, r, r_mask, layout=layout)


def test_pad_ids_outside_the_vocabulary_are_not_embedded_in_either_layout(model, batch):
    """Ids under False masks are pads: no range error, and layout='padded' (which embeds the
    whole (b p+t) batch) no longer looks them up, so its log-probs equal the clean batch's."""
    p_ids, p_mask, r_ids, r_mask = _args(batch)
    assert (~p_mask).any() and (~r_mask).any()
    vocab = _vocab(model)
    with torch.no_grad():
        clean, _ = response_logprobs(model, *_args(batch), layout="padded")
        for pad in (-1, vocab + 7):
            p, r = p_ids.masked_fill(~p_mask, pad), r_ids.masked_fill(~r_mask, pad)
            for layout in ("packed", "padded"):
                lp, _ = response_logprobs(model, p, p_mask, r, r_mask, layout=layout)
                torch.testing.assert_close(lp, clean, rtol=0, atol=1e-5)


def test_token_logprobs_refuses_a_temperature_not_above_zero():
    logits, targets = torch.tensor([[2.0, 0.0, -1.0]]), torch.tensor([0])
    for bad in (0.0, -1.0, float("nan"), "1.0"):
        with pytest.raises(ValueError, match=r"temperature must be > 0 for log-probs.*pass temperature=1\.0"):
            token_logprobs(logits, targets, temperature=bad)
    lp, _ = token_logprobs(logits, targets, temperature=2.0)
    torch.testing.assert_close(lp, (logits / 2).log_softmax(-1)[:, 0])


def test_attention_dropout_while_training_falls_back_to_transformers_attention(batch):
    """rlkit's shared-prompt and varlen attention apply no dropout and raised on a training model
    with attention_dropout > 0; such a model now runs the packed layout through transformers'
    attention (dropout applied), and in eval mode still takes rlkit's layouts."""
    from rlkit.models import logprobs as L

    tok = char_tokenizer("0123456789+= ")
    model = tiny(tok, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, attention_dropout=0.5)
    group = make_batch([[5, 6, 7]] * 2, [[8, 9], [10]])  # two samples of one prompt: shared by default
    long = make_batch([list(range(1, 13)) * 25] * 2, [[3] * 40, [4] * 30])  # > CPU_DENSE_MASK_MAX_TOKENS packed tokens
    assert L._full_attention_packed(model.base_model.eval())
    with torch.no_grad():
        assert L.response_view(model.base_model, *_args(group)).kind == "shared"
        assert L.response_view(model.base_model, *_args(long)).varlen
    model.train()
    for b in (group, long, batch):
        model.zero_grad(set_to_none=True)
        lp, _ = response_logprobs(model, *_args(b))  # raised "supports no attention dropout"
        assert torch.isfinite(lp).all() and (lp[b["response_mask"]] < 0).all()
        lp.sum().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
        view = L.response_view(model.base_model, *_args(b))
        assert view.kind == "packed" and not view.varlen
    assert not L._full_attention_packed(model.base_model)
    # dropout is applied: two training forwards differ, eval forwards agree with the shared layout's
    with torch.no_grad():
        torch.manual_seed(0)
        a, _ = response_logprobs(model, *_args(group))
        b_, _ = response_logprobs(model, *_args(group))
        assert not torch.equal(a, b_)
        model.eval()
        shared, _ = response_logprobs(model, *_args(group))
        padded, _ = response_logprobs(model, *_args(group), layout="padded")
        torch.testing.assert_close(shared, padded, rtol=0, atol=1e-5)
    values_for_response(critic(model).train(), *_args(group)).sum().backward()
