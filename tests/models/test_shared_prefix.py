"""Shared prompts in the training forward: each prompt computed once for its consecutive rows.

The shared layout must give the unshared forward's log-probs, entropies, values and gradients
(the prompt's gradient is the sum over its responses); only the amount of arithmetic changes."""
import copy

import pytest
import torch

import rlkit as rk
from rlkit.batch import make_batch
from rlkit.models import critic, response_logprobs, tiny, values_for_response
from rlkit.models import logprobs as L
from rlkit.models.tokenizers import char_tokenizer

# groups of consecutive rows with the same prompt (lengths 3, 1, 5), a lone prompt, an empty response
PROMPTS = [[5, 6, 7]] * 3 + [[8]] * 2 + [[9, 10, 11, 12, 13]] * 3 + [[4, 4]]
RESPONSES = [[5, 5, 5, 6], [7], [8, 9], [10, 11, 12], [], [13, 14, 15, 16, 4, 5], [6], [7, 7], [9, 8, 7]]


def _model(**kw):
    tok = char_tokenizer("0123456789+= ")
    return tiny(tok, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                initializer_range=0.2, tie_word_embeddings=False, **kw)


def _args():
    b = make_batch(PROMPTS, RESPONSES, pad_token_id=0)
    return b["prompt_ids"], b["prompt_mask"], b["response_ids"], b["response_mask"]


def _run(model, share, monkeypatch):
    monkeypatch.setattr(L, "SHARE_PROMPTS", share)
    model.zero_grad(set_to_none=True)
    lp, ent = response_logprobs(model, *_args(), with_entropy=True)
    weights = torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype).reshape(lp.shape)
    ((lp * weights).sum() + 0.3 * ent.sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_layout_shares_each_prompt_once_and_predicts_from_the_right_positions():
    view = L.shared_prefix(*_args())
    assert view is not None
    # prompts 3 + 1 + 5 + 2 once each, plus every response token but each row's last (its
    # output predicts nothing)
    assert view.input_ids.numel() == 3 + 1 + 5 + 2 + sum(max(len(r) - 1, 0) for r in RESPONSES)
    seq = view.input_ids.tolist()
    # [5 6 7] then [5 5 5](6) ()(7) [8](9), then [8] and [10 11](12)
    assert seq[:3 + 3 + 1 + 1 + 2] == [5, 6, 7, 5, 5, 5, 8, 8, 10, 11]
    # the first token of every response is predicted by its group's last prompt token
    first_of_row = [sum(map(len, RESPONSES[:r])) for r in range(len(RESPONSES)) if RESPONSES[r]]
    preds = view.predict_index[first_of_row].tolist()
    assert [seq[i] for i in preds] == [7, 7, 7, 8, 13, 13, 13, 4]
    # positions continue the prompt in every response
    assert view.position_ids[view.response_index[:3]].tolist() == [3, 4, 5]
    # the other response tokens are predicted by response tokens of the same row
    assert [seq[i] for i in view.predict_index[1:4].tolist()] == [5, 5, 5]
    assert L.shared_prefix(*[t[:1] for t in _args()]) is None  # one row: nothing to share


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_shared_prompts_give_the_unshared_logprobs_entropies_and_gradients(monkeypatch, dtype):
    model = _model().to(dtype)
    lp0, ent0, g0 = _run(model, False, monkeypatch)
    lp1, ent1, g1 = _run(model, True, monkeypatch)
    # every token's forward is the same computation: equal to float64 rounding (bitwise here)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=tol)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=tol)
    # gradients: a shared prompt token's gradient is summed over its responses before the
    # backward of transformers' RMSNorm, which computes in float32 even in a float64 model, not
    # after; so both dtypes agree to float32 rounding (1e-6 relative; measured 4e-7)
    assert g0.keys() == g1.keys()
    for name in g0:
        scale = float(g0[name].abs().max())
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-5 * max(scale, 1.0), msg=name)


def test_shared_prompts_give_the_unshared_critic_values(monkeypatch):
    value_model = critic(_model()).double()
    out = []
    for share in (False, True):
        monkeypatch.setattr(L, "SHARE_PROMPTS", share)
        out.append(values_for_response(value_model, *_args()))
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=1e-10)


def test_an_update_with_shared_prompts_equals_one_without(monkeypatch):
    base = _model()
    batch = make_batch(PROMPTS, RESPONSES, pad_token_id=0)
    batch.set("advantages", torch.linspace(-1, 1, batch["response_mask"].numel()).reshape(batch["response_mask"].shape))
    batch.set("logprobs", torch.zeros(batch["response_mask"].shape))
    params = []
    for share in (False, True):
        monkeypatch.setattr(L, "SHARE_PROMPTS", share)
        state = rk.init(copy.deepcopy(base), rk.optim.adamw(lr=1e-2, eps=1.0, weight_decay=0.0))
        state, metrics = rk.update(state, batch, micro_batch_size=3, max_logprob_gap=None)
        params.append({k: v.detach().clone() for k, v in state.actor.named_parameters()})
    for k in params[0]:
        torch.testing.assert_close(params[1][k], params[0][k], rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.parametrize("kvh", [2, 4])
def test_cpu_shared_attention_equals_the_segment_by_segment_one_bit_for_bit(kvh):
    # _shared_padded builds its padded batches from one cached plan per layout instead of per
    # segment; the attention inputs are the same, so outputs and gradients must be identical
    layout = L.shared_prefix(*_args())
    n, heads, d = layout.input_ids.numel(), 4, 16
    g = torch.Generator().manual_seed(0)
    q0 = torch.randn(n, heads, d, generator=g)
    k0, v0 = (torch.randn(n, kvh, d, generator=g) for _ in range(2))
    w = torch.randn(n, heads, d, generator=g)
    results = []
    for fn in (L._shared_padded, L._shared_segments):  # the second: what runs with flash, here without
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = fn(q, k, v, layout, 0.25, heads // kvh)
        (out * w).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for new, old, name in zip(*results, ("out", "dq", "dk", "dv")):
        assert torch.equal(new, old), name
    # the plan is built once per layout, then reused (one per forward, not per layer)
    plan = L._padded_plan(layout)
    assert L._padded_plan(layout) is plan
    assert plan.gather_out.unique().numel() == n  # every packed token has its own padded slot


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen flash attention needs CUDA")
def test_flash_segments_align_causality_to_the_bottom_right_as_the_shared_layout_needs():
    # on CUDA the shared layout runs through flash attention; its queries-against-[prompt;
    # response] segments are right only if causality is aligned to the last key
    torch.manual_seed(0)
    heads, kvh, d = 4, 2, 64
    q_len, k_len = torch.tensor([3, 5, 1, 6]), torch.tensor([7, 5, 4, 9])  # offsets 4, 0, 3, 3
    q_cu, k_cu = L._cu(q_len).cuda(), L._cu(k_len).cuda()
    q = torch.randn(int(q_len.sum()), heads, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(int(k_len.sum()), kvh, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(int(k_len.sum()), kvh, d, device="cuda", dtype=torch.bfloat16)
    sizes = (q_cu, k_cu, int(q_len.max()), int(k_len.max()), d**-0.5, heads // kvh)
    out = L._flash_segments(q, k, v, *sizes)
    ref = L._padded_segments(q.double(), k.double(), v.double(), *sizes)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen flash attention needs CUDA")
def test_shared_prompts_on_cuda_run_through_flash_and_give_the_unshared_logprobs(monkeypatch):
    model = _model().cuda().to(torch.bfloat16)
    calls = []
    flash = L._flash_segments
    monkeypatch.setattr(L, "_flash_segments", lambda *a: calls.append(1) or flash(*a))
    args = [t.cuda() for t in _args()]
    out = {}
    for share in (False, True):
        monkeypatch.setattr(L, "SHARE_PROMPTS", share)
        calls.clear()
        out[share] = response_logprobs(model, *args)
        assert calls  # both layouts ran through flash attention
    torch.testing.assert_close(out[True], out[False], rtol=0, atol=3e-2)


def _direct(model, p_ids, p_mask, r_ids, r_mask):
    """Reference log-probs and critic-style outputs from one plain padded forward of ``model``:
    the logits at the position before each response token."""
    ids, mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1).long()
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    return out[:, p_ids.shape[1] - 1 : -1], r_mask.bool()


@pytest.mark.parametrize("layout,share", [("packed", True), ("packed", False), ("padded", None)])
def test_view_built_beforehand_gives_the_reference_logprobs_values_and_the_calls_gradients(layout, share, monkeypatch):
    # a ResponseView built before the call (what the passes and update do from the CPU batch):
    # log-probs and values equal one plain padded forward of the model, and the gradients those
    # of the call building its own view
    torch.manual_seed(0)
    model = _model()
    if share is not None:
        monkeypatch.setattr(L, "SHARE_PROMPTS", share)
    args = _args()
    view = L.response_view(L.backbone_of(model), *args, device="cpu", layout=layout)
    assert view.kind == {"packed": "shared" if share else "packed", "padded": "padded"}[layout]
    assert torch.equal(view.targets, args[2][args[3].bool()])
    assert view.shape == tuple(args[3].shape) and view.scatter_index.tolist() == args[3].flatten().nonzero().flatten().tolist()
    with torch.no_grad():
        logits, mask = _direct(model, *args)
    ref = logits.log_softmax(-1).gather(-1, args[2][..., None]).squeeze(-1) * mask
    outs = []
    for v in (None, view):
        model.zero_grad(set_to_none=True)
        lp, ent = response_logprobs(model, *args, with_entropy=True, layout=layout, view=v)
        (lp.sum() + 0.3 * ent.sum()).backward()
        outs.append((lp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(outs[1][0], ref, rtol=0, atol=2e-5)
    assert (outs[1][0][~mask] == 0).all()  # the scatter leaves padding at 0
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
    value_model = critic(model).eval()
    cview = L.response_view(L.backbone_of(value_model), *args, device="cpu", layout=layout)
    with torch.no_grad():
        values = values_for_response(value_model, *args, layout=layout, view=cview)
        ref_values = _direct(value_model, *args)[0][..., 0] * mask
    torch.testing.assert_close(values, ref_values, rtol=0, atol=2e-5)


def test_response_view_names_the_bad_mask():
    p_ids, p_mask, r_ids, r_mask = _args()
    bad = r_mask.clone()
    bad[0, 0] = False  # a pad before a real token: not right-padded
    with pytest.raises(ValueError, match="response_mask is not right-padded"):
        L.response_view(L.backbone_of(_model()), p_ids, p_mask, r_ids, bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_passes_and_update_queue_without_waiting_for_the_gpu():
    # the log-prob passes over a CPU batch must never synchronise the host with the GPU (so the
    # host can score rewards while they run): CUDA's sync debug mode raises on any synchronising call
    model = _model().cuda()
    # eager blocks: what is checked is the host side of the passes (compiled float32 blocks are
    # checked against eager in the next test)
    state = rk.init(model, rk.optim.adamw(lr=1e-3), ref="copy", compile=False)
    batch = make_batch(PROMPTS, RESPONSES, pad_token_id=0)
    batch.set("logprobs", torch.zeros(batch["response_ids"].shape))
    # warm-up: compiling each model's blocks (actor and reference are separate variants) and the
    # first pinned blocks may synchronise; later calls must not
    rk.compute_ref_logprobs(state, rk.compute_old_logprobs(state, batch))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = rk.compute_old_logprobs(state, batch)
        out = rk.compute_ref_logprobs(state, out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out["old_logprobs"].device.type == "cuda" and out["ref_logprobs"].device.type == "cuda"
    with torch.no_grad():
        ref = response_logprobs(model, *(t.cuda() for t in _args()))[0]
    torch.testing.assert_close(out["old_logprobs"], ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_blocks_equal_eager_for_a_float32_model_on_cuda():
    # float32 on CUDA takes the padded-segments attention (no flash); compiled blocks once hit a
    # device-side assert there (inductor fused the segment gather into the rotary kernel)
    from rlkit.models.compile import compile_layers

    torch.manual_seed(0)
    model = _model().cuda()
    compiled = copy.deepcopy(model)
    compile_layers(compiled)
    args = [t.cuda() for t in _args()]
    with torch.no_grad():
        lp, ent = response_logprobs(model, *args, with_entropy=True)
        lp_c, ent_c = response_logprobs(compiled, *args, with_entropy=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(lp_c, lp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent_c, ent, atol=1e-4, rtol=1e-4)


def test_checkpointing_turns_the_packed_layouts_off_without_a_deprecation_warning(recwarn):
    """Activation checkpointing (transformers' own) rules out the packed layouts; asking whether it
    is on must not trip transformers' FutureWarning for the old property name."""
    import warnings

    backbone = L.backbone_of(_model())
    warnings.simplefilter("always")
    assert L._full_attention_packed(backbone)
    enable = getattr(backbone, "activation_checkpointing_enable", None) or backbone.gradient_checkpointing_enable
    enable()
    recwarn.clear()  # only what asking costs counts below
    assert not L._full_attention_packed(backbone)
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)], [str(w.message) for w in recwarn]

    class OldTransformers(torch.nn.Module):  # a model class with only the old property name
        config = backbone.config

        @property
        def is_gradient_checkpointing(self):
            return True

    assert L._checkpointing(OldTransformers()) and not L._full_attention_packed(OldTransformers())
    assert not L._checkpointing(torch.nn.Linear(2, 2))
