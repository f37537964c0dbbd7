"""Architecture variants against the plain transformers model.

Every reference here is the model itself, one unpadded row at a time, in float32:
``model(ids).logits.log_softmax(-1)`` gathered at the response tokens. Covered: longrope rotary
tables in the torch engine, model types whose transformers implementation does not honour
packed rows (they must run the padded layout), sliding windows, attention dropout under other
config names, logit soft-capping, out-of-vocabulary pad ids in the config, and HFEngine
without a tokenizer.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from rlkit.batch import make_batch
from rlkit.engines import SamplingParams, TorchEngine
from rlkit.engines.base import pick_pad_token_id
from rlkit.engines.hf_engine import HFEngine
from rlkit.models import logprobs as L
from rlkit.models import response_logprobs

VOCAB = 24
# two groups of rows sharing a prompt (the shared-prompt layout) and a row of its own;
# prompts and responses of different lengths (longest row: 9 tokens)
PROMPTS = [[5, 6, 7], [5, 6, 7], [8], [9, 10, 11, 12, 13], [9, 10, 11, 12, 13]]
RESPONSES = [[5, 5, 5, 6], [7, 20], [8, 9, 10], [10, 11, 12], [13, 14, 15, 16]]
LONGEST = max(len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES))


def _model(model_type: str, **fields):
    """A random tiny causal LM of ``model_type``, float32, in eval mode, with weights large
    enough for peaked, varied next-token distributions."""
    config = transformers.AutoConfig.for_model(model_type, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    return model.eval()


def _reference(model, prompts, responses) -> torch.Tensor:
    """(b t) float32 log-probs of each response token, one unpadded row at a time."""
    out = torch.zeros(len(prompts), max(map(len, responses)))
    was = model.training
    model.eval()
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses)):
            logp = model(torch.tensor([p + r])).logits[0].float().log_softmax(-1)
            out[i, : len(r)] = logp[len(p) - 1 : len(p) - 1 + len(r)].gather(-1, torch.tensor(r)[:, None])[:, 0]
    model.train(was)
    return out


def _args(batch):
    return batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"]


#: the three packed layouts: transformers' packed mask, the varlen (padded-rows) attention, shared prompts
PATHS = {
    "packed": dict(SHARE_PROMPTS=False, CPU_DENSE_MASK_MAX_TOKENS=10**9),
    "varlen": dict(SHARE_PROMPTS=False, CPU_DENSE_MASK_MAX_TOKENS=0),
    "shared": dict(SHARE_PROMPTS=True),
}


def _logprobs(model, batch, path: str, monkeypatch):
    for name, value in PATHS[path].items():
        monkeypatch.setattr(L, name, value)
    view = L.response_view(L.backbone_of(model), *_args(batch))
    lp, _ = response_logprobs(model, *_args(batch))
    monkeypatch.undo()
    return lp, view


# ---------------------------------------------------------------------------------------------
# 1. longrope rotary in the torch engine


def _longrope_llama():
    return _model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                         "short_factor": [1.0 + 0.3 * i for i in range(8)], "long_factor": [3.0 + 0.5 * i for i in range(8)]},
    )


def _behaviour_error(engine, model, prompts, max_new_tokens: int) -> float:
    gen = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=max_new_tokens, ignore_stop=True),
                          generator=torch.Generator().manual_seed(0))
    rows = [prompts[i] for i in gen.prompt_index.tolist()]
    responses = [r[m].tolist() for r, m in zip(gen.response_ids, gen.response_mask)]
    ref = _reference(model, rows, responses)
    return float(((gen.logprobs - ref).abs() * gen.response_mask).max())


def test_torch_engine_longrope_uses_the_factors_the_model_uses_for_the_rollout_length():
    """A longrope rotary takes its short factors for a sequence within
    original_max_position_embeddings (16) and its long ones beyond: the engine built its table
    for the whole context (64 positions: long factors for a 13-token rollout, log-probs off by
    about 1) and must not reuse a table across the two regimes."""
    model = _longrope_llama()
    engine = TorchEngine.from_model(model)
    short, long = [[5, 6, 7, 8, 9], [10, 11]], [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    assert _behaviour_error(engine, model, short, 8) < 1e-5  # 13 tokens: short factors
    assert _behaviour_error(engine, model, long, 20) < 1e-5  # 25 tokens: long factors
    assert _behaviour_error(engine, model, short, 8) < 1e-5  # the cached long table is not reused
    # the table itself: as the model's rotary for a sequence of that length
    for length in (13, 16, 17, 40):
        cos, sin = engine._rope_table(length)
        want_cos, want_sin = model.model.rotary_emb(torch.empty(0), torch.arange(length)[None])
        torch.testing.assert_close(cos[:length], want_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[:length], want_sin[0], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# 2. packed layouts: only for model types that honour packed rows


NOT_PACKING = {
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2, word_embed_proj_dim=32,
                max_position_embeddings=64, dropout=0.0, attention_dropout=0.0),
    "bloom": dict(hidden_size=32, n_layer=1, n_head=2, hidden_dropout=0.0, attention_dropout=0.0),
    "mpt": dict(d_model=32, n_layers=1, n_heads=2, max_seq_len=64),
    "falcon": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, new_decoder_architecture=True, num_kv_heads=1),
    "stablelm": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     max_position_embeddings=64),
}


@pytest.mark.parametrize("model_type", sorted(NOT_PACKING))
def test_model_types_not_known_to_honour_packed_rows_run_the_padded_layout(model_type, monkeypatch):
    """OPT (positions from the attention mask), BLOOM and MPT (ALiBi), Falcon and StableLM
    (attention kwargs not passed down) gave log-probs 1 to 3.6 off, or crashed, in the packed
    layouts; layout="packed" (the default) now runs them padded, exactly, in eval and training."""
    model = _model(model_type, **NOT_PACKING[model_type])
    batch = make_batch(PROMPTS, RESPONSES)
    ref = _reference(model, PROMPTS, RESPONSES)
    kinds = set()
    for train in (False, True):
        model.train(train)
        for path in PATHS:
            lp, view = _logprobs(model, batch, path, monkeypatch)
            torch.testing.assert_close(lp.detach(), ref, rtol=0, atol=1e-5, msg=f"{model_type} {path} train={train}")
            kinds.add(view.kind)
    assert kinds == {"padded"}
    assert ref[batch["response_mask"]].abs().min() > 0


# ---------------------------------------------------------------------------------------------
# 3. sliding windows, attention dropout names, soft-capping (packing model types)


SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=64)


@pytest.mark.parametrize("model_type,fields,custom", [
    ("mistral", dict(sliding_window=4096), True),  # Mistral's default window: longer than every row
    ("mistral", dict(sliding_window=LONGEST), True),  # as long as the longest row: hides nothing
    ("mistral", dict(sliding_window=LONGEST - 3), False),  # shorter than some rows: transformers' attention
    ("qwen2", dict(use_sliding_window=True, sliding_window=4096, max_window_layers=0), True),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0), False),
])
def test_sliding_window_blocks_rlkit_attention_only_when_shorter_than_a_row(model_type, fields, custom, monkeypatch):
    """A sliding window at least as long as the batch's longest row changes nothing: the shared /
    varlen layouts run (they raised 'supports no ... sliding window (4096)'); a shorter one
    sends the packed rows through transformers' attention, which applies it. Exact either way."""
    model = _model(model_type, **SMALL, **fields)
    batch = make_batch(PROMPTS, RESPONSES)
    ref = _reference(model, PROMPTS, RESPONSES)
    for path in PATHS:
        with torch.no_grad():
            lp, view = _logprobs(model, batch, path, monkeypatch)
        torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5, msg=f"{model_type} {fields} {path}")
        expected = {"shared": "shared" if custom else "packed"}.get(path, "packed")
        assert view.kind == expected and view.varlen == (custom and path != "packed"), (path, view.kind, view.varlen)


def test_rlkit_attention_accepts_a_window_no_shorter_than_the_layout_rows():
    batch = make_batch(PROMPTS, RESPONSES)
    layout = L.shared_prefix(*_args(batch))
    n, heads, d = layout.input_ids.numel(), 2, 8
    q = torch.randn(1, heads, n, d)
    longest = max(layout.prompt_max, layout.key_max)
    full, _ = L._shared_prefix_attention(None, q, q, q, None, rlkit_shared_prefix=layout)
    wide, _ = L._shared_prefix_attention(None, q, q, q, None, sliding_window=longest, rlkit_shared_prefix=layout)
    torch.testing.assert_close(wide, full, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="sliding window"):
        L._shared_prefix_attention(None, q, q, q, None, sliding_window=longest - 1, rlkit_shared_prefix=layout)
    with pytest.raises(RuntimeError, match="soft-capping"):
        L._shared_prefix_attention(None, q, q, q, None, softcap=50.0, rlkit_shared_prefix=layout)


@pytest.mark.parametrize("model_type,fields", [
    ("gpt2", dict(n_embd=32, n_layer=1, n_head=2, n_positions=64, attn_pdrop=0.1, resid_pdrop=0.0, embd_pdrop=0.0)),
    ("gpt_bigcode", dict(n_embd=32, n_layer=1, n_head=2, n_positions=64, attn_pdrop=0.1, resid_pdrop=0.0, embd_pdrop=0.0)),
])
def test_attention_dropout_under_other_config_names_falls_back_in_training(model_type, fields, monkeypatch):
    """GPT-2 and GPTBigCode name their attention dropout attn_pdrop (0.1 by default): training
    through the shared-prompt layout raised 'no attention dropout (0.1)'. In training the packed
    rows now attend through transformers (dropout applied); in eval the shared layout is exact."""
    model = _model(model_type, **fields)
    batch = make_batch(PROMPTS, RESPONSES)
    ref = _reference(model, PROMPTS, RESPONSES)
    with torch.no_grad():
        lp, view = _logprobs(model, batch, "shared", monkeypatch)
    assert view.kind == "shared"
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)
    model.train()
    for path in PATHS:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        lp, view = _logprobs(model, batch, path, monkeypatch)
        assert view.kind == "packed" and not view.varlen
        assert torch.isfinite(lp).all() and (lp[batch["response_mask"]] < 0).all()
        lp.sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # the dropout is applied: the same training forward under two seeds differs
    torch.manual_seed(1)
    other, _ = _logprobs(model, batch, "varlen", monkeypatch)
    assert not torch.equal(other.detach(), lp.detach())


def test_attention_logit_softcapping_keeps_transformers_attention(monkeypatch):
    """Gemma 2's attention soft-capping, which rlkit's attention functions do not apply: with a
    window longer than every row the packed rows still attend through transformers, exactly."""
    model = _model("gemma2", **SMALL, head_dim=16, sliding_window=4096, attn_logit_softcapping=5.0, final_logit_softcapping=None)
    batch = make_batch(PROMPTS, RESPONSES)
    ref = _reference(model, PROMPTS, RESPONSES)
    for path in PATHS:
        with torch.no_grad():
            lp, view = _logprobs(model, batch, path, monkeypatch)
        torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)
        assert view.kind == "packed" and not view.varlen


# ---------------------------------------------------------------------------------------------
# 4. pad ids outside the vocabulary; HFEngine without a tokenizer


def test_config_pad_id_outside_the_vocabulary_is_not_used_by_the_torch_engine():
    """pad_token_id=-1 (early Llama conversions): the engine padded prompts and finished rows
    with it and crashed with a bare IndexError. It now pads with an id in the vocabulary."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=-1, **SMALL)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    engine = TorchEngine.from_model(model)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]  # different lengths: left padding
    gen = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, temperature=1.0, stop_token_ids=(3, 4)),
                          generator=torch.Generator().manual_seed(0))
    rows = [prompts[i] for i in gen.prompt_index.tolist()]
    responses = [r[m].tolist() for r, m in zip(gen.response_ids, gen.response_mask)]
    ref = _reference(model, rows, responses)
    torch.testing.assert_close(gen.logprobs * gen.response_mask, ref, rtol=0, atol=1e-5)
    assert engine.pad_token_id == 2  # the config's eos
    with pytest.raises(ValueError, match=r"pad_token_id=-1 .*\[0, 24\)"):
        TorchEngine.from_model(model, pad_token_id=-1)
    with pytest.raises(ValueError, match=r"pad_token_id=24 "):
        TorchEngine.from_model(model, pad_token_id=VOCAB)
    assert TorchEngine.from_model(model, pad_token_id=7).pad_token_id == 7


def test_pick_pad_token_id_skips_config_ids_outside_the_vocabulary():
    class Config:
        vocab_size = 10
        pad_token_id = -1
        eos_token_id = 2

    c = Config()
    assert pick_pad_token_id(c) == 2
    c.eos_token_id = [-1, 12, 3]
    assert pick_pad_token_id(c) == 3
    c.eos_token_id = 10
    assert pick_pad_token_id(c) == 0
    c.pad_token_id = 4
    assert pick_pad_token_id(c) == 4
    assert pick_pad_token_id(c, vocab=4) == 0  # the embedding's rows decide when given
    with pytest.raises(ValueError, match=r"pad_token_id=10 "):
        pick_pad_token_id(c, 10)


def test_hf_engine_without_a_tokenizer_says_what_to_pass():
    model = _model("llama", **SMALL)
    with pytest.raises(ValueError, match=r"no tokenizer.*tokenizer=") as err:
        HFEngine(model, None)
    assert "the tokenizer has no pad_token_id" not in str(err.value)
    assert HFEngine(model, 3).pad_token_id == 3
