import copy
import time

import pytest
import torch

from rlkit.batch import make_batch
from rlkit.engines import Engine, SamplingParams, TorchEngine
from rlkit.models import response_logprobs


def _hf_greedy(model, tok, prompts, max_new_tokens, eos):
    """transformers' own greedy generate on the left-padded prompts -> list of token lists (stop included)."""
    enc = tok([tok.decode(p) for p in prompts], return_tensors="pt", padding=True)
    assert enc["attention_mask"].sum(-1).tolist() == [len(p) for p in prompts]
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=eos
    )
    rows = []
    for seq in out[:, enc["input_ids"].shape[1] :].tolist():
        row = []
        for token in seq:
            row.append(token)
            if token == eos:
                break
        rows.append(row)
    return rows


def _rows(gen):
    return [r[m].tolist() for r, m in zip(gen.response_ids, gen.response_mask)]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_greedy_matches_transformers_generate(tok, prompts, refs, arch):
    model = refs.make_model(tok, arch=arch, rope_theta=500.0)
    engine = TorchEngine.from_model(model)
    assert isinstance(engine, Engine)
    # a frequent token of this random model as the stop token, so some rows stop early and some do not
    stop = 4
    gen = engine.generate(prompts, SamplingParams(max_new_tokens=14, temperature=0, stop_token_ids=(stop,)))
    expected = _hf_greedy(model, tok, prompts, 14, stop)
    assert _rows(gen) == expected
    assert len({t for row in expected for t in row}) > 4  # varied output, not one repeated token
    lengths = [len(r) for r in expected]
    assert gen.response_ids.shape[1] == max(lengths)
    assert gen.truncated.tolist() == [row[-1] != stop for row in expected]
    assert gen.truncated.any() and not gen.truncated.all()  # rows that stop and rows that run out
    # greedy reports the plain log-softmax of the chosen tokens
    torch.testing.assert_close(gen.logprobs.double(), refs.behaviour(model, prompts, gen, 1.0), rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_training_logprobs(model, prompts, temperature):
    engine = TorchEngine.from_model(model)
    g = torch.Generator().manual_seed(0)
    gen = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=10, temperature=temperature), generator=g)
    assert gen.prompt_index.tolist() == [i for i in range(len(prompts)) for _ in range(3)]
    batch = make_batch([prompts[i] for i in gen.prompt_index.tolist()], _rows(gen))
    with torch.no_grad():
        train_lp, _ = response_logprobs(
            model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"], temperature=temperature
        )
    assert gen.logprobs.dtype == torch.float32
    torch.testing.assert_close(gen.logprobs, train_lp, rtol=0, atol=1e-5)
    assert (gen.logprobs[~gen.response_mask] == 0).all()


def test_top_k_top_p_logprobs_are_of_the_processed_distribution(model, prompts, refs):
    engine = TorchEngine.from_model(model)
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.8, top_k=6, top_p=0.7)
    gen = engine.generate(prompts, params, generator=torch.Generator().manual_seed(1))
    expected = refs.behaviour(model, prompts, gen, 0.8, top_k=6, top_p=0.7)
    assert torch.isfinite(expected[gen.response_mask]).all()  # every sampled token survived the filters
    torch.testing.assert_close(gen.logprobs.double(), expected, rtol=0, atol=1e-5)


def test_top_k_1_equals_greedy(model, prompts):
    engine = TorchEngine.from_model(model)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0))
    top1 = engine.generate(
        prompts, SamplingParams(max_new_tokens=10, temperature=1.3, top_k=1), generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(top1.response_ids, greedy.response_ids)
    # a one-token distribution: the behaviour log-prob is log 1 = 0
    assert (top1.logprobs == 0).all()


def test_same_seed_same_samples_and_n_rows(model, prompts):
    engine = TorchEngine.from_model(model)
    params = SamplingParams(n=4, max_new_tokens=8, temperature=1.0)
    a = engine.generate(prompts, params, generator=torch.Generator().manual_seed(11))
    b = engine.generate(prompts, params, generator=torch.Generator().manual_seed(11))
    c = engine.generate(prompts, params, generator=torch.Generator().manual_seed(12))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    assert a.response_ids.shape[0] == 4 * len(prompts)
    # samples of one prompt differ from each other (independent noise per row)
    assert len({tuple(r) for r in a.response_ids[:4].tolist()}) > 1


def test_sampling_frequencies_match_the_model(model, prompts):
    """The exponential-race sampler draws from softmax(logits / T): compare empirical first-token frequencies."""
    engine = TorchEngine.from_model(model)
    n = 4000
    gen = engine.generate(
        [prompts[0]], SamplingParams(n=n, max_new_tokens=1, temperature=1.5), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompts[0]])).logits[0, -1].double() / 1.5, -1)
    freq = torch.bincount(gen.response_ids[:, 0], minlength=probs.numel()).double() / n
    # 4 standard errors of a binomial frequency
    tolerance = 4 * torch.sqrt(probs * (1 - probs) / n) + 1e-3
    assert ((freq - probs).abs() <= tolerance).all(), (freq - probs).abs().max()
    assert probs.max() < 0.9  # not a degenerate distribution


def test_stop_tokens_end_rows_and_mask_covers_them(model, prompts):
    engine = TorchEngine.from_model(model)
    params = SamplingParams(n=4, max_new_tokens=12, temperature=1.0, stop_token_ids=(4, 7))
    gen = engine.generate(prompts, params, generator=torch.Generator().manual_seed(3))
    stops_seen = 0
    for ids, mask, lp, truncated in zip(gen.response_ids, gen.response_mask, gen.logprobs, gen.truncated):
        n_real = int(mask.sum())
        assert mask[:n_real].all() and not mask[n_real:].any()  # right-padded
        real = ids[:n_real].tolist()
        assert not any(t in (4, 7) for t in real[:-1])  # no stop token before the end
        if real[-1] in (4, 7):
            stops_seen += 1
            assert not truncated
        else:
            assert truncated and n_real == 12
        assert (ids[n_real:] == engine.pad_token_id).all() and (lp[n_real:] == 0).all()
        assert (lp[:n_real] < 0).all()
    assert stops_seen > 0 and gen.truncated.any()  # both cases occurred
    ignored = engine.generate(
        prompts, SamplingParams(n=4, max_new_tokens=12, stop_token_ids=(4, 7), ignore_stop=True), generator=torch.Generator().manual_seed(3)
    )
    assert ignored.response_mask.all() and ignored.truncated.all()


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.8),
                                      dict(temperature=0.0)])
def test_dropping_finished_rows_on_cpu_changes_no_sample(model, prompts, monkeypatch, sampling):
    """The CPU decode drops finished rows from the step (``COMPACT_FINISHED_ROWS``): with the same
    seed it must sample exactly what the full batch samples, with the same log-probs and flags."""
    from rlkit.engines import torch_engine as te

    params = SamplingParams(n=8, max_new_tokens=12, stop_token_ids=(4, 7, 9), **sampling)
    sizes = []
    compact = te.TorchEngine._compact

    def spy(view, state):
        out = compact(view, state)
        sizes.append(out.tokens.shape[0])
        return out

    monkeypatch.setattr(te.TorchEngine, "_compact", staticmethod(spy))
    dropped = TorchEngine.from_model(model).generate(prompts, params, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(te, "COMPACT_FINISHED_ROWS", 0.0)
    n_compactions = len(sizes)
    full = TorchEngine.from_model(model).generate(prompts, params, generator=torch.Generator().manual_seed(5))
    assert len(sizes) == n_compactions  # off: no compaction
    assert n_compactions >= 1 and sizes == sorted(sizes, reverse=True) and sizes[-1] < len(prompts) * 8 * 3 // 4, sizes
    assert torch.equal(dropped.response_ids, full.response_ids)
    assert torch.equal(dropped.response_mask, full.response_mask)
    assert torch.equal(dropped.truncated, full.truncated)
    torch.testing.assert_close(dropped.logprobs, full.logprobs, rtol=0, atol=1e-5)
    assert 0 < int(full.response_mask.sum()) < full.response_mask.numel() and full.truncated.any() and not full.truncated.all()


def test_cpu_decode_stops_once_every_row_has_finished(model, prompts, tok):
    """With the rows dropped as they finish, the loop ends at the step after the last one finishes."""
    every = tuple(range(len(tok)))  # any token stops: every row finishes at its first token
    gen = TorchEngine.from_model(model).generate(prompts, SamplingParams(n=3, max_new_tokens=10, stop_token_ids=every),
                                                 generator=torch.Generator().manual_seed(0))
    assert gen.metrics["decode_steps"] == 1 and gen.response_mask.sum(-1).tolist() == [1] * 15
    assert not gen.truncated.any()


def test_shares_storage_and_sees_optimizer_steps(tok, prompts, refs):
    model = refs.make_model(tok)
    engine = TorchEngine.from_model(model)
    for name, p in model.named_parameters():
        assert engine.weights[name].data_ptr() == p.data_ptr(), name
    params = SamplingParams(max_new_tokens=10, temperature=0)
    before = engine.generate(prompts, params)
    # one in-place optimizer step that changes the greedy outputs
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    lp, _ = response_logprobs(model, *_batch_args(before, prompts))
    lp.sum().backward()
    optimizer.step()
    after = engine.generate(prompts, params)
    assert not torch.equal(after.response_ids, before.response_ids)
    fresh = TorchEngine(model.config, {n: p.detach().clone() for n, p in model.named_parameters()})
    assert torch.equal(after.response_ids, fresh.generate(prompts, params).response_ids)
    # sharing the storage, load_weights copies nothing and only bumps the version
    report = engine.load_weights(dict(model.named_parameters()), version=1)
    assert report["bytes"] == 0 and engine.policy_version == 1


def test_generate_returns_ordinary_tensors_under_inference_mode(model, prompts):
    """The engine decodes under torch.inference_mode; what it returns must not be inference
    tensors, which autograd refuses to save (an embedding's backward saves its indices) and
    which cannot be changed in place outside inference mode."""
    engine = TorchEngine.from_model(model)
    gen = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6), generator=torch.Generator().manual_seed(0))
    for name in ("response_ids", "response_mask", "logprobs", "truncated", "prompt_index"):
        assert not getattr(gen, name).is_inference(), name
    hidden = model.get_input_embeddings()(gen.response_ids)  # saves the ids for the backward
    (hidden.sum() * gen.logprobs.sum()).backward()
    assert model.get_input_embeddings().weight.grad is not None
    gen.logprobs.mul_(2.0)
    gen.response_mask &= gen.response_mask  # in place, outside inference mode
    # and the same engine serves the training loop's next call, whose outputs are as before
    again = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.response_ids, gen.response_ids)


def _batch_args(gen, prompts):
    batch = make_batch([prompts[i] for i in gen.prompt_index.tolist()], _rows(gen))
    return batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"]


def test_load_weights_into_separate_engine(tok, prompts, refs):
    model = refs.make_model(tok)
    other = refs.make_model(tok, seed=1)
    engine = TorchEngine.from_model(copy.deepcopy(other))
    params = SamplingParams(max_new_tokens=10, temperature=0)
    target = TorchEngine.from_model(model).generate(prompts, params)
    assert not torch.equal(engine.generate(prompts, params).response_ids, target.response_ids)
    report = engine.load_weights(list(model.state_dict().items()), version=7)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report["bytes"] == total and report["seconds"] >= 0 and engine.policy_version == 7
    assert torch.equal(engine.generate(prompts, params).response_ids, target.response_ids)
    with pytest.raises(KeyError, match="unknown parameter 'model.nope'"):
        engine.load_weights({"model.nope": torch.zeros(1)}, version=8)


def test_unsupported_architecture_suggests_hf_engine():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=20, n_positions=32))
    with pytest.raises(ValueError, match="'gpt2'.*HFEngine"):
        TorchEngine.from_model(gpt2)


def test_bad_prompts(model):
    engine = TorchEngine.from_model(model)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[5], []], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[5, 10_000]], SamplingParams())


def test_speed_64_rows_16_tokens(model, prompts):
    engine = TorchEngine.from_model(model)
    params = SamplingParams(n=16, max_new_tokens=16, temperature=1.0, ignore_stop=True)
    rows = prompts[:4]
    threads = torch.get_num_threads()
    # one thread: on a shared, oversubscribed CPU, spinning intra-op threads make timings meaningless
    torch.set_num_threads(1)
    try:
        engine.generate(rows, params, generator=torch.Generator().manual_seed(0))  # warm-up (first kernels, rope table)
        start = time.perf_counter()
        gen = engine.generate(rows, params, generator=torch.Generator().manual_seed(0))
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    assert gen.response_ids.shape == (64, 16)
    assert seconds < 2.0, f"64 rows x 16 tokens took {seconds:.2f}s (expected well under a second)"


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.8)])
@pytest.mark.parametrize("split", [(2, 3), (1, 1, 1, 1, 1)])
def test_shares_sampled_with_rows_equal_the_whole_batch(model, prompts, sampling, split):
    """Prompts split over generation replicas: each share, sampled with ``rows=(start, total)`` and
    a generator in the whole batch's state, samples what the whole batch samples for those rows
    (the noise of the whole batch is drawn, the share's rows kept), finished-row compaction,
    uneven prompt widths and several samples per prompt included. Without ``rows`` a share draws
    the noise of its own rows only, and samples other responses."""
    assert sum(split) == len(prompts)
    params = SamplingParams(n=3, max_new_tokens=12, stop_token_ids=(4, 7, 9), **sampling)
    engine = TorchEngine.from_model(model)
    whole = engine.generate(prompts, params, generator=torch.Generator().manual_seed(11))
    total, start, width = len(prompts) * 3, 0, whole.response_ids.shape[1]
    alone = []
    for size in split:
        share = prompts[start : start + size]
        part = engine.generate(share, params, generator=torch.Generator().manual_seed(11), rows=(start * 3, total))
        rows = slice(start * 3, (start + size) * 3)
        w = part.response_ids.shape[1]
        assert torch.equal(part.response_ids, whole.response_ids[rows, :w]) and not whole.response_mask[rows, w:].any()
        assert torch.equal(part.response_mask, whole.response_mask[rows, :w])
        assert torch.equal(part.truncated, whole.truncated[rows])
        torch.testing.assert_close(part.logprobs, whole.logprobs[rows, :w], rtol=0, atol=1e-5)
        own = engine.generate(share, params, generator=torch.Generator().manual_seed(11))
        alone.append(torch.equal(own.response_ids, whole.response_ids[rows, : own.response_ids.shape[1]]))
        start += size
    assert not all(alone[1:])  # the later shares, without rows, sample from the start of the noise
    assert 0 < int(whole.response_mask.sum()) < whole.response_mask.numel()
    assert width == max(int(m.sum()) for m in whole.response_mask)


def test_rows_outside_the_batch_are_refused(model, prompts):
    engine = TorchEngine.from_model(model)
    params = SamplingParams(n=2, max_new_tokens=3)
    for rows in [(9, 10), (-1, 20), (0,), (0.5, 20)]:
        with pytest.raises(ValueError, match=r"rows must be \(start, total\)"):
            engine.generate(prompts, params, rows=rows)
