"""Interoperability with transformers models and tokenizers.

1. An exported directory (model + rlkit's char tokenizer, as ``rlkit run --out``) reloads with the
   tokenizer it was trained with: transformers 5 loads it as Qwen2Tokenizer for a qwen2 model,
   which dropped spaces, newlines and non-ASCII characters.
2. Models whose forward maps lm_head's logits elementwise (Gemma 2's final soft-capping,
   Granite's and Cohere's scales) train: rlkit's log-probs and entropies are those of the
   model's own logits (reference: ``model(ids).logits``, one unpadded row at a time).
3. HFEngine with a tokenizer pad id outside the model's embedding rows.
4. Dropout: ``rk.models.disable_dropout`` and rk.init's warning.
"""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers

import rlkit as rk
from rlkit.batch import make_batch
from rlkit.engines import SamplingParams
from rlkit.engines.hf_engine import HFEngine
from rlkit.models import build as B
from rlkit.models import load_tokenizer, response_logprobs, tiny
from rlkit.models import logprobs as L
from rlkit.models import tokenizers as T
from rlkit.models.tokenizers import char_tokenizer

# ---------------------------------------------------------------------------------------------
# 1. exported tokenizers reload as saved

TEXTS = ["1 + 2 =\n", "12+3=15", "a\nb  c", "é1 ", " 7 ", "abc é\n\n"]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_exported_char_tokenizer_reloads_with_its_own_ids(arch, tmp_path):
    """What `rlkit run arithmetic --out DIR` writes: the model and the char tokenizer in one
    directory. For qwen2 transformers forces Qwen2Tokenizer ("1 + 2 =" -> "1+2=")."""
    tok = char_tokenizer("0123456789+= \nabcé")
    tiny(tok, arch=arch, hidden_size=32, intermediate_size=64).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # loaded directly, no fallback needed
        loaded = load_tokenizer(tmp_path)
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text), text
        assert loaded.decode(loaded.encode(text)) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2, 3)
    assert loaded.padding_side == "left" and len(loaded) == len(tok)


def test_exported_arithmetic_task_tokenizer_reloads_with_its_own_ids(tmp_path):
    task = rk.tasks.arithmetic(digits=2)
    tiny(task.tokenizer, hidden_size=32, intermediate_size=64).save_pretrained(tmp_path)
    task.tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    for text in ["1 + 2", "12 + 34 = 46", "99 - 7 = "]:
        assert loaded.encode(text) == task.tokenizer.encode(text), text


def test_a_class_that_encodes_otherwise_falls_back_to_the_saved_tokenizer_json(tmp_path):
    """A tokenizer_config naming a model-specific class that does not reproduce tokenizer.json:
    the saved tokenizer.json governs, with a warning naming the class."""
    tok = char_tokenizer("0123456789+= \nabc")
    tiny(tok, hidden_size=32, intermediate_size=64).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config_path.write_text(json.dumps(config))
    with pytest.warns(RuntimeWarning, match=r"as Qwen2Tokenizer.*tokenizer\.json.*PreTrainedTokenizerFast"):
        loaded = load_tokenizer(tmp_path)
    for text in TEXTS[:3]:
        assert loaded.encode(text) == tok.encode(text), text


def test_a_tokenizer_no_class_reproduces_is_refused(tmp_path, monkeypatch):
    tok = char_tokenizer("0123456789+= ")
    tok.save_pretrained(tmp_path)
    monkeypatch.setattr(T, "_saved_ids", lambda directory: [99, 98])
    with pytest.raises(ValueError, match=r"tokenizer\.json.*\[99, 98\].*save_pretrained"):
        load_tokenizer(tmp_path)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies are over these)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def test_a_real_byte_level_tokenizer_directory_loads_as_before(tmp_path):
    """A Qwen2-style byte-level BPE tokenizer saved beside a qwen2 model: still the class and the
    ids AutoTokenizer gives, without a warning."""
    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tok = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
    tiny(len(tok), hidden_size=32, intermediate_size=64).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        loaded = load_tokenizer(tmp_path)
    assert type(loaded) is type(reference) is transformers.Qwen2Tokenizer
    for text in ["the 12 cats\n", " héllo  the\tend", "«x» 中文 ok?\n\n"]:
        assert loaded.encode(text) == reference.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text)) == text


# ---------------------------------------------------------------------------------------------
# 2. logit soft-capping and scales

VOCAB = 24
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, max_position_embeddings=64)
#: model type -> its logit field; values far from 1 (the weights below give logits of a few units)
LOGIT_MODELS = {
    "gemma2": dict(final_logit_softcapping=2.0),
    "gemma3_text": dict(final_logit_softcapping=2.0),
    "nanochat": dict(final_logit_softcapping=2.0),
    "granite": dict(logits_scaling=4.0),
    "granitemoe": dict(logits_scaling=4.0),
    "granitemoeshared": dict(logits_scaling=0.25),
    "cohere": dict(logit_scale=0.25),
    "cohere2": dict(logit_scale=3.0),
}
PROMPTS = [[5, 6, 7], [5, 6, 7], [8], [9, 10, 11, 12, 13], [9, 10, 11, 12, 13]]
RESPONSES = [[5, 5, 5, 6], [7, 20], [8, 9, 10], [10, 11, 12], [13, 14, 15, 16]]
#: transformers' packed mask, the padded-rows (varlen) attention, shared prompts; and padded
PATHS = {
    "packed": dict(SHARE_PROMPTS=False, CPU_DENSE_MASK_MAX_TOKENS=10**9),
    "varlen": dict(SHARE_PROMPTS=False, CPU_DENSE_MASK_MAX_TOKENS=0),
    "shared": dict(SHARE_PROMPTS=True),
    "padded": dict(),
}


def _model(model_type: str, **fields):
    config = transformers.AutoConfig.for_model(model_type, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                               **SMALL, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model.eval()


def _reference(model, temperature: float, transformed: bool = True):
    """(b t) log-probs and entropies of the responses from ``model(ids).logits`` (its own forward,
    logit map included), one unpadded row at a time, and the sum of the log-probs (for gradients).
    ``transformed=False``: from lm_head's raw logits instead."""
    device = next(model.parameters()).device
    lp = torch.zeros(len(PROMPTS), max(map(len, RESPONSES)))
    ent = torch.zeros_like(lp)
    total = 0.0
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        ids = torch.tensor([p + r], device=device)
        if transformed:
            logits = model(ids).logits[0]
        else:
            logits = model.get_output_embeddings()(model.base_model(ids).last_hidden_state)[0]
        logp = (logits[len(p) - 1 : len(p) - 1 + len(r)].float() / temperature).log_softmax(-1)
        row = logp.gather(-1, torch.tensor(r, device=device)[:, None])[:, 0]
        total = total + row.sum()
        lp[i, : len(r)] = row.detach().cpu()
        ent[i, : len(r)] = -(logp.exp() * logp).sum(-1).detach().cpu()
    return lp, ent, total


@pytest.mark.parametrize("model_type", sorted(LOGIT_MODELS))
def test_logprobs_and_entropy_apply_the_models_logit_map(model_type, monkeypatch):
    """The first compute_old_logprobs raised 'do not apply it yet' for these model types."""
    model = _model(model_type, **LOGIT_MODELS[model_type])
    batch = make_batch(PROMPTS, RESPONSES)
    args = batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"]
    mask = batch["response_mask"]
    for temperature in (1.0, 0.7):
        ref_lp, ref_ent, ref_total = _reference(model, temperature)
        model.zero_grad(set_to_none=True)
        ref_total.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        raw_lp, _, _ = _reference(model, temperature, transformed=False)
        assert float((raw_lp - ref_lp).abs().max()) > 0.05  # the map matters at these sizes
        for path, flags in PATHS.items():
            for name, value in flags.items():
                monkeypatch.setattr(L, name, value)
            layout = "padded" if path == "padded" else "packed"
            model.zero_grad(set_to_none=True)
            lp, ent = response_logprobs(model, *args, temperature=temperature, with_entropy=True, layout=layout)
            monkeypatch.undo()
            torch.testing.assert_close(lp.detach(), ref_lp * mask, rtol=0, atol=2e-5, msg=lambda m: f"{path} T={temperature}: {m}")
            torch.testing.assert_close(ent.detach(), ref_ent * mask, rtol=0, atol=2e-5, msg=lambda m: f"{path} T={temperature}: {m}")
            (lp * mask).sum().backward()
            for n, p in model.named_parameters():
                if n in ref_grads:  # float32 sums in other orders: relative to the gradient's norm
                    err = float((p.grad - ref_grads[n]).norm())
                    assert err <= 1e-5 * float(ref_grads[n].norm()) + 1e-7, (path, temperature, n, err)


def test_a_logit_field_of_a_model_type_not_checked_is_refused_naming_it():
    """HyperCLOVA X multiplies by logits_scaling where Granite divides: a model type rlkit has not
    checked keeps a clear refusal naming the field, the value and the fix."""
    model = _model("llama", logits_scaling=4.0)
    batch = make_batch(PROMPTS, RESPONSES)
    with pytest.raises(ValueError, match=r"model_type 'llama'.*logits_scaling=4\.0.*granite.*LOGIT_TRANSFORMS"):
        response_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"])
    assert L.logit_transform(_model("llama", logits_scaling=1.0).config) is None  # a scale of 1 is no map
    with pytest.raises(ValueError, match=r"final_logit_softcapping=0\.0.*positive"):
        L.logit_transform(_model("gemma2", final_logit_softcapping=0.0).config)


def test_gemma2_trains_end_to_end_and_the_trainer_agrees_with_the_hf_engine(tmp_path):
    """The repro: load_model, rk.init and rollout(engine="hf") accepted Gemma 2 (default
    soft-capping 30), then compute_old_logprobs raised. The torch engine's refusal stays clear."""
    tok = char_tokenizer("0123456789+= abc")
    config = transformers.Gemma2Config(vocab_size=len(tok), pad_token_id=0, bos_token_id=1, eos_token_id=2, **SMALL)
    assert config.final_logit_softcapping == 30.0
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    state = rk.init(rk.models.load_model(tmp_path), rk.optim.adamw(lr=1e-4), tokenizer=tok)
    with pytest.raises(ValueError, match="TorchEngine supports model_type.*'gemma2'.*HFEngine"):
        rk.rollout(state, ["1+2=", "abc"], n=2, max_new_tokens=6)
    batch = rk.rollout(state, ["1+2=", "abc"], n=2, max_new_tokens=6, engine="hf", seed=0)
    old = rk.compute_old_logprobs(state, batch)["old_logprobs"]
    gap = ((old - batch["logprobs"]).abs() * batch["response_mask"]).max()
    assert float(gap) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused Triton log-prob path runs on CUDA")
@pytest.mark.parametrize("model_type", ["gemma2", "granite", "cohere"])
def test_fused_cuda_path_applies_the_logit_map(model_type, monkeypatch):
    """bf16 on CUDA: the Triton log-softmax pass over the mapped chunk, against the same model's
    own bf16 logits, and its gradients against the torch path's."""
    pytest.importorskip("triton")
    model = _model(model_type, **LOGIT_MODELS[model_type]).to("cuda", torch.bfloat16)
    batch = make_batch(PROMPTS, RESPONSES)
    args = [batch[k].cuda() for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    mask = args[3]
    with torch.no_grad():
        ref_lp, ref_ent, _ = _reference(model, 0.8)
    results = []
    for fused in (True, False):
        monkeypatch.setattr(L, "USE_FUSED_LOGPROBS", fused)
        model.zero_grad(set_to_none=True)
        lp, ent = response_logprobs(model, *args, temperature=0.8, with_entropy=True, layout="padded")
        (lp * mask).sum().backward()
        grads = [p.grad.float().clone() for p in model.parameters() if p.grad is not None]
        results.append((lp.detach(), ent.detach(), grads))
        torch.testing.assert_close(lp.detach().cpu(), ref_lp * mask.cpu(), rtol=0, atol=5e-2)
        torch.testing.assert_close(ent.detach().cpu(), ref_ent * mask.cpu(), rtol=0, atol=5e-2)
    (lp_f, ent_f, g_f), (lp_t, ent_t, g_t) = results
    torch.testing.assert_close(lp_f, lp_t, rtol=0, atol=1e-4)
    torch.testing.assert_close(ent_f, ent_t, rtol=0, atol=1e-4)
    for a, b in zip(g_f, g_t):
        assert float((a - b).norm()) <= 2e-2 * float(b.norm()) + 1e-6


# ---------------------------------------------------------------------------------------------
# 3. HFEngine: a pad id outside the embedding


def test_hf_engine_pads_with_an_in_vocabulary_id_when_the_tokenizers_pad_has_no_embedding_row():
    """tok.add_special_tokens({"pad_token": "[PAD]"}) without resizing: pad id = vocab size, and
    rollout(engine="hf") crashed with a bare IndexError in the embedding (prompt padding, and
    generate's padding of finished rows)."""
    tok = char_tokenizer("0123456789+= abc")
    model = tiny(tok, hidden_size=32, intermediate_size=64)
    good = HFEngine(model, tok)
    bad_tok = char_tokenizer("0123456789+= abc")
    bad_tok.add_special_tokens({"pad_token": "[PAD]"})
    vocab = model.get_input_embeddings().num_embeddings
    assert bad_tok.pad_token_id == vocab
    bad = HFEngine(model, bad_tok)
    assert bad.pad_token_id == good.pad_token_id == 0  # the config's pad, as the torch engine's
    prompts = [[5], [5, 6, 14, 7, 15]]  # different lengths: left padding
    # frequent stop tokens: some rows finish early, and generate pads them while others go on
    params = SamplingParams(n=4, max_new_tokens=8, temperature=1.0, stop_token_ids=tuple(range(5, 12)))
    a = bad.generate(prompts, params, generator=torch.Generator().manual_seed(3))
    b = good.generate(prompts, params, generator=torch.Generator().manual_seed(3))
    lengths = a.response_mask.sum(-1)
    assert int(lengths.min()) < int(lengths.max())
    for field in ("response_ids", "response_mask", "logprobs", "truncated"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert int(a.response_ids.min()) >= 0 and int(a.response_ids.max()) < vocab

    state = rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=bad_tok)
    batch = rk.rollout(state, ["1", "12+3="], n=2, max_new_tokens=4, engine="hf", seed=0)
    old = rk.compute_old_logprobs(state, batch)["old_logprobs"]
    assert float(((old - batch["logprobs"]).abs() * batch["response_mask"]).max()) < 1e-4


def test_hf_engine_refuses_an_int_pad_id_outside_the_vocabulary():
    model = tiny(20, hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match=r"pad id 20 is outside the model's vocabulary \[0, 20\)"):
        HFEngine(model, 20)
    with pytest.raises(ValueError, match=r"pad id -1 "):
        HFEngine(model, -1)

    class NegativePad:
        pad_token_id = -1

    assert HFEngine(model, NegativePad()).pad_token_id == 0


# ---------------------------------------------------------------------------------------------
# 4. dropout


def _gpt2(tok):
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=len(tok), pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2)  # dropout: the library's defaults (0.1)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _opt():
    config = transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2, word_embed_proj_dim=32,
                                    max_position_embeddings=64, vocab_size=VOCAB, dropout=0.1, attention_dropout=0.1,
                                    activation_dropout=0.1, layerdrop=0.5)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("build", ["gpt2", "opt"])
def test_disable_dropout_makes_the_training_forward_the_eval_forward(build):
    """GPT-2 drops out through modules; OPT through float rates its layers copied from the config
    (functional dropout, and layerdrop skipping whole layers)."""
    model = _gpt2(char_tokenizer("0123456789+= abcdefghij")) if build == "gpt2" else _opt()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [12, 11, 10, 9, 8, 7, 6, 5]])
    model.train()
    with torch.no_grad():
        noisy = [model(ids).logits for _ in range(2)]
    assert not torch.equal(noisy[0], noisy[1])
    modules, fields = B.active_dropout(model)
    assert modules and fields
    assert B.disable_dropout(model) is model and rk.models.disable_dropout is B.disable_dropout
    assert B.active_dropout(model) == ([], [])
    assert model.training  # the mode is the caller's
    with torch.no_grad():
        first, second = model(ids).logits, model(ids).logits
        model.eval()
        evaluated = model(ids).logits
    assert torch.equal(first, second)
    torch.testing.assert_close(first, evaluated, rtol=0, atol=1e-6)
    rates = {k: v for k, v in model.config.to_dict().items() if "drop" in k and isinstance(v, float)}
    assert rates and all(v == 0.0 for v in rates.values()), rates


def test_init_warns_about_an_actor_with_dropout_and_not_about_one_without():
    tok = char_tokenizer("0123456789+= abcdefghij")
    with pytest.warns(RuntimeWarning, match=r"rk\.init: the actor has dropout on: 7 module\(s\).*attn_pdrop=0\.1.*PPO's ratio is "
                                            r"not 1.*logprob_gap.*rk\.models\.disable_dropout\(model\) before rk\.init"):
        rk.init(_gpt2(tok), rk.optim.adamw(lr=1e-3), tokenizer=tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rk.init(tiny(tok, hidden_size=32, intermediate_size=64), rk.optim.adamw(lr=1e-3))
        rk.init(B.disable_dropout(_gpt2(tok)), rk.optim.adamw(lr=1e-3), tokenizer=tok)


def test_without_dropout_the_first_on_policy_update_has_ratio_one():
    """The repro: with GPT-2's default dropout the first update's actor/logprob_gap was ~0.96 and
    38% of the tokens clipped; with disable_dropout the update sees the rollout's log-probs."""
    tok = char_tokenizer("0123456789+= abcdefghij")
    model = B.disable_dropout(_gpt2(tok))
    state = rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=tok)
    batch = rk.rollout(state, ["1", "12+3=45 ab", "7+8="], n=3, max_new_tokens=8, engine="hf", seed=1)
    batch = rk.score(batch, lambda prompts, completions, **k: [float(len(c) % 3) for c in completions])
    batch = rk.advantage(batch, "grpo")
    state, metrics = rk.update(state, batch, loss="ppo_clip")
    assert metrics["actor/logprob_gap"] < 1e-4
    assert metrics["actor/clipfrac"] == 0.0
