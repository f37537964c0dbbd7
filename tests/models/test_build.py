import json

import pytest
import torch

from rlkit.models import critic, load_model, tiny, tiny_config
from rlkit.models.build import PRESETS
from rlkit.models.tokenizers import char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer("0123456789+= ")


def _ids(vocab: int, b: int = 3, s: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))


def test_tiny_preset_shape_and_tokenizer_ids(tok):
    model = tiny(tok)
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (
        128, 2, 4, 2, 512
    )
    assert c.head_dim == 32
    assert (c.vocab_size, c.pad_token_id, c.bos_token_id, c.eos_token_id) == (len(tok), 0, 1, 2)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied by default
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.rlkit_tokenizer is tok
    assert next(model.parameters()).dtype == torch.float32


def test_tiny_is_seeded_and_leaves_global_rng_alone(tok):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = tiny(tok, seed=7)
    after = torch.rand(1)
    assert torch.equal(before, after)  # building the model drew nothing from the global RNG
    b = tiny(tok, seed=7)
    c = tiny(tok, seed=8)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_presets_and_int_vocab():
    assert PRESETS["small"]["hidden_size"] == 256 and PRESETS["small"]["num_hidden_layers"] == 4
    # the 0.5b shape as a config (allocating 151936 x 896 embeddings would dominate the test time)
    c = tiny_config(151936, size="qwen2.5-0.5b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (896, 24, 14, 2)
    assert (c.intermediate_size, c.vocab_size, c.head_dim) == (4864, 151936, 64)
    assert c.rope_parameters["rope_theta"] == 1e6 and c.tie_word_embeddings
    model = tiny(300, size="small", num_hidden_layers=1)
    assert model.config.hidden_size == 256 and model.config.vocab_size == 300
    assert not hasattr(model, "rlkit_tokenizer")


def test_rope_theta_is_kept_with_a_rope_scaling():
    """transformers 5 builds rope_parameters from rope_scaling with the default theta: rope_theta
    given beside it was dropped silently (10000 instead of 1e6)."""
    for scaling in ({"rope_type": "linear", "factor": 2.0}, {"type": "linear", "factor": 2.0}):
        c = tiny_config(100, arch="llama", rope_theta=1e6, rope_scaling=scaling)
        assert c.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    assert tiny_config(100, arch="llama").rope_parameters["rope_theta"] == 10000.0
    with pytest.raises(ValueError, match="rope_theta=1000000.0 disagrees"):
        tiny_config(100, rope_theta=1e6, rope_parameters={"rope_type": "default", "rope_theta": 5e5})


@pytest.mark.parametrize("arch, cls", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_other_archs(arch, cls):
    model = tiny(40, arch=arch, hidden_size=64, intermediate_size=128)
    assert type(model).__name__ == cls and model.config.head_dim == 16
    assert model(_ids(40)).logits.shape == (3, 7, 40)


def test_overrides_and_bad_names(tok):
    model = tiny(tok, hidden_size=64, tie_word_embeddings=False, dtype=torch.bfloat16)
    assert model.config.hidden_size == 64 and model.config.head_dim == 16
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        tiny(tok, size="huge")
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        tiny(tok, arch="gpt2")


def test_save_and_load_gives_identical_logits(tok, tmp_path):
    model = tiny(tok, hidden_size=64, intermediate_size=128).eval()
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    x = _ids(len(tok))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=1e-6)


def test_load_model_errors(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    model = tiny(tok, hidden_size=32, intermediate_size=64)
    model.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no weights .*model\.safetensors"):
        load_model(tmp_path)
    # a non-causal architecture (an encoder) is named, with the supported list
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"'vit' model.*not a causal LM.*qwen2"):
        load_model(tmp_path)


def test_critic_from_actor_shares_backbone_values_and_round_trips(tok, tmp_path):
    actor = tiny(tok, hidden_size=64, intermediate_size=128)
    value_model = critic(actor)
    assert type(value_model).__name__ == "Qwen2ForTokenClassification"
    assert value_model.score.out_features == 1 and value_model.dropout.p == 0.0
    for name, p in actor.model.named_parameters():
        assert torch.equal(p, value_model.model.get_parameter(name)), name
    x = _ids(len(tok))
    with torch.no_grad():
        values = value_model(x).logits
        # by hand: score(final hidden state of the shared backbone)
        expected = value_model.score(actor.model(x).last_hidden_state)
    assert values.shape == (3, 7, 1)
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-6)

    value_model.save_pretrained(tmp_path / "critic")
    reloaded = critic(tmp_path / "critic")
    with torch.no_grad():
        # not bit-exact: the CPU matmul kernel depends on the memory alignment of the mmapped weights
        torch.testing.assert_close(reloaded(x).logits, values, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="not a causal LM.*critic"):
        load_model(tmp_path / "critic")


def test_critic_from_actor_directory_and_config(tok, tmp_path):
    actor = tiny(tok, hidden_size=64, intermediate_size=128)
    actor.save_pretrained(tmp_path)
    from_dir = critic(tmp_path)
    assert torch.equal(from_dir.model.layers[1].mlp.up_proj.weight, actor.model.layers[1].mlp.up_proj.weight)
    fresh = critic(actor.config, seed=3)
    assert not torch.equal(fresh.model.embed_tokens.weight, actor.model.embed_tokens.weight)
    assert torch.equal(critic(actor.config, seed=3).score.weight, fresh.score.weight)  # seeded


def test_load_model_checks_dtype_and_device(tok, tmp_path):
    tiny(tok, hidden_size=32, intermediate_size=64, num_hidden_layers=1).save_pretrained(tmp_path)
    for dtype in ("bfloat16", "torch.bfloat16", torch.bfloat16):
        assert next(load_model(tmp_path, dtype=dtype).parameters()).dtype == torch.bfloat16
    assert next(load_model(tmp_path, dtype="auto").parameters()).dtype == torch.float32
    for bad in ("bf16", "int8", torch.int64, 16):
        with pytest.raises(ValueError, match=r"load_model: dtype=.* is not a floating dtype.*'bfloat16', 'float16', 'float32'"):
            load_model(tmp_path, dtype=bad)
    with pytest.raises(ValueError, match=r"load_model: device='gpu' is not a device.*'cpu', 'cuda'.*'cuda:0'"):
        load_model(tmp_path, device="gpu")
    assert load_model(tmp_path, device="cpu").device.type == "cpu"
    with pytest.raises(ValueError, match="tiny: dtype='fp32'"):
        tiny(tok, dtype="fp32")


def test_tiny_refuses_unknown_fields_and_bad_head_shapes(tok):
    with pytest.raises(ValueError, match=r"unknown Qwen2Config field\(s\) 'hiden_size' \(did you mean 'hidden_size'"):
        tiny(tok, hiden_size=30)
    with pytest.raises(ValueError, match=r"'num_layers' \(did you mean .*'num_hidden_layers'.*'xyzzy'"):
        tiny_config(tok, num_layers=1, xyzzy=2)
    with pytest.raises(ValueError, match="unknown LlamaConfig field.*'use_sliding_window'"):
        tiny_config(tok, arch="llama", use_sliding_window=True)  # a qwen2 field, not llama's
    with pytest.raises(ValueError, match="hidden_size=30 is not divisible by num_attention_heads=4.*head_dim"):
        tiny(tok, hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="head_dim = hidden_size / num_attention_heads = 7 is odd"):
        tiny(tok, hidden_size=28, num_attention_heads=4)
    with pytest.raises(ValueError, match="num_attention_heads=3 is not a multiple of num_key_value_heads=2"):
        tiny(tok, hidden_size=96, num_attention_heads=3)
    with pytest.raises(ValueError, match="num_attention_heads must be a positive int"):
        tiny(tok, num_attention_heads=0)
    # an explicit head_dim decouples the head width from hidden_size
    model = tiny(tok, hidden_size=30, num_attention_heads=4, head_dim=8, intermediate_size=64)
    assert model.config.head_dim == 8 and model(_ids(len(tok))).logits.shape == (3, 7, len(tok))
