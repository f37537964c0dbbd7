import torch

from rlkit.engines import Engine, HFEngine, SamplingParams, TorchEngine


def test_greedy_same_as_torch_engine(model, tok, prompts):
    hf = HFEngine(model, tok)
    assert isinstance(hf, Engine)
    engine = TorchEngine.from_model(model)
    # stop on the third greedy token of the first prompt: at least that row stops early
    stop = int(engine.generate(prompts[:1], SamplingParams(max_new_tokens=3, temperature=0)).response_ids[0, 2])
    params = SamplingParams(n=2, max_new_tokens=14, temperature=0, stop_token_ids=(stop,))
    a = hf.generate(prompts, params)
    b = engine.generate(prompts, params)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.truncated, b.truncated) and not a.truncated.all()
    assert len(set(a.response_ids[a.response_mask].tolist())) > 4  # varied output
    assert torch.equal(a.prompt_index, b.prompt_index)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert (a.response_ids[~a.response_mask] == tok.pad_token_id).all()


def test_sampled_logprobs_are_of_the_processed_distribution(model, prompts, refs):
    hf = HFEngine(model, tok_pad := 0)
    assert hf.pad_token_id == tok_pad
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.8, top_k=6, top_p=0.7, stop_token_ids=(4,))
    gen = hf.generate(prompts, params, generator=torch.Generator().manual_seed(0))
    expected = refs.behaviour(model, prompts, gen, 0.8, top_k=6, top_p=0.7)
    assert torch.isfinite(expected[gen.response_mask]).all()
    torch.testing.assert_close(gen.logprobs.double(), expected, rtol=0, atol=1e-5)
    assert (gen.logprobs[~gen.response_mask] == 0).all()


def test_seeded_and_isolated_from_the_models_generation_config(model, tok, prompts):
    hf = HFEngine(model, tok)
    # a checkpoint's generation_config must not leak into sampling: top_k=1 here would make it greedy
    model.generation_config.top_k = 1
    model.generation_config.eos_token_id = 5
    try:
        params = SamplingParams(n=3, max_new_tokens=8, temperature=1.0)
        a = hf.generate(prompts, params, generator=torch.Generator().manual_seed(4))
        b = hf.generate(prompts, params, generator=torch.Generator().manual_seed(4))
        greedy = hf.generate(prompts, SamplingParams(n=3, max_new_tokens=8, temperature=0))
        assert model.generation_config.top_k == 1  # restored after each call
    finally:
        model.generation_config.top_k = None
        model.generation_config.eos_token_id = tok.eos_token_id
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, greedy.response_ids)
    assert a.response_mask.all() and a.truncated.all()  # no stop tokens asked for: full length, eos 5 ignored


def test_load_weights(model, tok, prompts, refs):
    other = refs.make_model(tok, seed=3)
    hf = HFEngine(other, tok)
    report = hf.load_weights(model.state_dict(), version=2)
    assert report["bytes"] > 0 and hf.policy_version == 2
    params = SamplingParams(max_new_tokens=6, temperature=0)
    assert torch.equal(hf.generate(prompts, params).response_ids, HFEngine(model, tok).generate(prompts, params).response_ids)
