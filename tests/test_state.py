import pytest
import torch

import rlkit as rk
from rlkit.state import DonatedStateError


def test_donated_state_refuses_use(tiny_model, char_tok):
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    state2 = state.replace(step=5)
    state.donate("rlkit.update", state2)
    with pytest.raises(DonatedStateError, match="donated to rlkit.update"):
        state.actor
    with pytest.raises(DonatedStateError):
        state.replace(step=1)
    assert state2.step == 5 and state2.actor is tiny_model


def test_rng_is_keyed_by_seed_and_step(tiny_model, char_tok):
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok, seed=3)
    a = torch.rand(4, generator=state.rng("x"))
    b = torch.rand(4, generator=state.rng("x"))
    c = torch.rand(4, generator=state.replace(step=1).rng("x"))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_lr_schedule_warmup_then_cosine():
    spec = rk.optim.adamw(lr=1.0, warmup_steps=2, total_steps=6, schedule="cosine", min_lr_ratio=0.0)
    factors = [spec.lr_factor(s) for s in range(7)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == pytest.approx(1.0) and factors[6] == pytest.approx(0.0, abs=1e-12)
    assert factors[4] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="total_steps"):
        rk.optim.adamw(lr=1e-3, schedule="cosine")
    with pytest.raises(ValueError, match="lr"):
        rk.optim.adamw(lr=-1.0)


def test_cpu_adamw_takes_the_fused_kernel_with_the_loops_values():
    # the spec picks torch's fused AdamW on CPU (one pass per parameter); it must step as torch's
    # CPU default, the per-parameter loop, up to float rounding
    g = torch.Generator().manual_seed(0)
    shapes = [(40, 16), (16,), (16, 16), (64, 16)]
    base = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    spec = rk.optim.adamw(lr=1e-2, weight_decay=0.1)
    runs = []
    for make in (lambda ps: spec.build(ps)[0], lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)):
        params = [torch.nn.Parameter(b.clone()) for b in base]
        opt = make(params)
        for step in grads:
            for p, gr in zip(params, step):
                p.grad = gr.clone()
            opt.step()
        runs.append((opt.defaults.get("fused"), [p.detach() for p in params]))
    (fused, ours), (_, loop) = runs
    assert fused is True
    # three steps of lr 1e-2 moved every parameter by about 3e-2; the two agree to ~1e-7
    assert all((a - b).abs().max() > 1e-2 for a, b in zip(ours, base))
    for a, b in zip(ours, loop):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _greedy_logprobs(state):
    return rk.rollout(state, ["1+2=", "3+4="], max_new_tokens=4, temperature=0)["logprobs"]


def test_replace_actor_samples_the_new_actor(tiny_model, char_tok):
    """The cached engine read the old actor's parameters and, the policy_version being unchanged,
    was never re-synced: a replaced actor kept sampling the old model."""
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    old = _greedy_logprobs(state)
    other = rk.models.tiny(char_tok, hidden_size=32, intermediate_size=64, num_hidden_layers=1, seed=123)
    swapped = state.replace(actor=other)
    expected = _greedy_logprobs(rk.init(other, rk.optim.adamw(lr=1e-3), tokenizer=char_tok))
    assert not torch.allclose(old, expected)
    torch.testing.assert_close(_greedy_logprobs(swapped), expected, rtol=0, atol=0)
    # the old state keeps its own engine, and an unrelated change keeps the cache
    torch.testing.assert_close(_greedy_logprobs(state), old, rtol=0, atol=0)
    assert state.replace(step=1)._cache["engine"] is state._cache["engine"]
    assert state.replace(actor=state.actor)._cache["engine"] is state._cache["engine"]


def test_replace_drops_only_the_caches_of_the_replaced_model(tiny_model, char_tok):
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok, ref="copy")
    marks = {k: object() for k in ("engine", "engine_kind", "actor_module", "ref_module", "critic_module", "release_engine")}
    state = state.replace(_cache=dict(marks))
    assert set(state.replace(ref=rk.models.tiny(char_tok, hidden_size=64, intermediate_size=128))._cache) == set(marks) - {"ref_module"}
    assert set(state.replace(tokenizer=rk.models.char_tokenizer("0123456789+-*= abc"))._cache) == set(marks) - {"engine", "engine_kind"}
    assert set(state.replace(actor=rk.models.tiny(char_tok, hidden_size=32, intermediate_size=64))._cache) == {
        "ref_module", "critic_module", "release_engine"}
    # a lowered state's sharded wrappers cannot be rebuilt by replace: refused, not silently stale
    lowered = state.replace(_cache={**marks, "dp": object()})
    with pytest.raises(ValueError, match=r"replace\(actor=...\).*lowered.*before lowering"):
        lowered.replace(actor=rk.models.tiny(char_tok, hidden_size=32, intermediate_size=64))


def test_init_refuses_the_actor_as_its_own_reference(tiny_model, char_tok):
    with pytest.raises(ValueError, match="ref is the actor itself.*ref='copy'"):
        rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok, ref=tiny_model)
    with pytest.raises(ValueError, match="shares its parameters"):
        rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok, ref=torch.nn.ModuleList([tiny_model.lm_head]))
    assert all(p.requires_grad for p in tiny_model.parameters())  # refused before freezing anything
    with pytest.raises(TypeError, match="ref must be a model, None or 'copy'.*got bool"):
        rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok, ref=True)


def test_init_names_the_bad_argument(tiny_model, char_tok):
    opt = rk.optim.adamw(lr=1e-3)
    with pytest.raises(TypeError, match=r"critic must be a value model.*no critic='copy'.*rk\.models\.critic\(model\)"):
        rk.init(tiny_model, opt, tokenizer=char_tok, critic="copy")
    with pytest.raises(TypeError, match=r"critic_optimizer must be an rlkit OptimizerSpec.*got float"):
        rk.init(tiny_model, opt, tokenizer=char_tok, critic=rk.models.critic(tiny_model), critic_optimizer=1e-3)
    with pytest.raises(TypeError, match=r"not a path \('some/dir'\).*rk\.models\.load_model\(path\)"):
        rk.init("some/dir", opt)
    with pytest.raises(TypeError, match="takes a model, not a TrainState"):
        rk.init(rk.init(tiny_model, opt, tokenizer=char_tok), opt)
    with pytest.raises(TypeError, match=r"tokenizer must be a tokenizer object.*'gpt2'.*AutoTokenizer\.from_pretrained"):
        rk.init(tiny_model, opt, tokenizer="gpt2")


def _moved(model, before) -> float:
    return max(float((p.detach() - before[k]).abs().max()) for k, p in model.named_parameters())


def test_a_replaced_actor_or_critic_trains(char_tok):
    """The optimizers stayed bound to the replaced models' parameters: a swapped-in actor and
    critic reported gradient norms and never changed. Now they get fresh AdamWs from the specs
    (the critic's own), with the LR schedule continued."""
    tiny = lambda seed: rk.models.tiny(char_tok, hidden_size=32, intermediate_size=64, num_hidden_layers=1, seed=seed)  # noqa: E731
    a = tiny(0)
    spec = rk.optim.adamw(lr=1e-2, warmup_steps=4)
    state = rk.init(a, spec, tokenizer=char_tok, critic=rk.models.critic(a), critic_optimizer=rk.optim.adamw(lr=3e-2))
    batch = rk.rollout(state, ["1+2=", "3+4="], n=2, max_new_tokens=3)
    batch.set("advantages", batch["response_mask"].float())
    batch.set("values", torch.zeros(batch["response_mask"].shape))
    batch.set("returns", batch["response_mask"].float())
    state, _ = rk.update(state, batch)
    b = tiny(1)
    cb = rk.models.critic(b)
    swapped = state.replace(actor=b, critic=cb)
    assert swapped.lr == pytest.approx(1e-2 * 2 / 4)  # the warm-up continues: one step done, the next is the second
    assert swapped.critic_optimizer.param_groups[0]["lr"] == pytest.approx(3e-2)
    before_b = {k: v.detach().clone() for k, v in b.named_parameters()}
    before_cb = {k: v.detach().clone() for k, v in cb.named_parameters()}
    rk.update(swapped, batch)
    assert _moved(b, before_b) > 1e-4 and _moved(cb, before_cb) > 1e-4


def test_replace_refuses_what_would_not_train(tiny_model, char_tok):
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    other = rk.models.tiny(char_tok, hidden_size=32, intermediate_size=64, num_hidden_layers=1, seed=1)
    with pytest.raises(ValueError, match="optimizer does not hold the parameters of the actor.*pass optimizer= and scheduler="):
        state.replace(actor=other, optimizer=state.optimizer)
    with pytest.raises(ValueError, match="ref is the actor itself.*copy.deepcopy"):
        state.replace(ref=state.actor)  # the KL to it stayed 0: rk.init refuses it
    no_spec = state.replace(optimizer_spec=None)
    with pytest.raises(ValueError, match="optimizer does not hold the parameters of the actor"):
        no_spec.replace(actor=other)


def _tiny_batch(model):
    from rlkit.batch import make_batch
    from rlkit.transforms.forward import model_logprobs

    batch = make_batch([[3, 4]] * 4, [[5, 6], [7], [8, 9, 10], [11]], group=[0, 0, 1, 1], rewards=[1.0, 0.0, 0.0, 1.0])
    lp, _ = model_logprobs(model, batch)
    batch.set("logprobs", lp)
    return rk.advantage(batch, "grpo")


def test_handles_made_by_replace_are_donated_with_the_state_they_alias(tiny_model, char_tok):
    """``snapshot = state.replace()`` shares the models and optimizer: after the update trained
    them in place it stayed usable, reading step 0 with the trained weights (and saved as such)."""
    batch = _tiny_batch(tiny_model)
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-2), tokenizer=char_tok)
    snapshot = state.replace()
    independent = state.replace(actor=rk.models.tiny(char_tok, hidden_size=64, intermediate_size=128))  # own optimizer
    new, _ = rk.update(state, batch)
    assert snapshot.is_donated and state.is_donated
    with pytest.raises(DonatedStateError, match=r"shares its models and optimizer with a state that was donated to rlkit\.update"):
        snapshot.step  # noqa: B018
    assert not independent.is_donated and independent.step == 0
    # the update's own successor is usable, and so is a handle made of it (rk.fit makes one per step)
    assert new.step == 1 and not new.is_donated
    moved = new.replace(data_position=1)
    newer, _ = rk.update(moved, batch)
    assert new.is_donated and moved.is_donated and newer.step == 2 and newer.data_position == 1
    # donate names its successor (update and load pass the state they return)
    a = newer.replace(step=7)
    b = newer.replace(step=8)
    newer.donate("rlkit.update", b)
    assert a.is_donated and not b.is_donated and b.step == 8
    b.donate("rlkit.update", None)
    assert b.is_donated


def test_donated_state_error_names_what_to_use_for_what_consumed_it(tmp_path, tiny_model, char_tok):
    """The error always recommended `state, metrics = rk.update(state, batch)`, also after a load."""
    import copy

    from rlkit.checkpoint import load, save

    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    path = save(state, tmp_path)
    template = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    alias = template.replace()
    restored = load(template, path)
    assert restored.step == 0 and not restored.is_donated
    for handle in (template, alias):
        with pytest.raises(DonatedStateError, match=r"rlkit\.checkpoint\.load") as info:
            handle.lr  # noqa: B018
        assert "rlkit.checkpoint.load(template, path)" in str(info.value) and "rk.update(state, batch)" not in str(info.value)
    _, _ = rk.update(restored, _tiny_batch(tiny_model))
    with pytest.raises(DonatedStateError, match=r"donated to rlkit\.update.*`state, metrics = rk\.update\(state, batch\)`"):
        restored.lr  # noqa: B018


def test_policy_version_counts_updates_that_stepped_and_the_scheduler_counts_optimizer_steps(tiny_model, char_tok):
    # the TrainState docstring: one version per update that stepped, however many mini-batch steps
    state = rk.init(tiny_model, tokenizer=char_tok)
    batch = rk.rollout(state, ["1+2=", "3+4="], n=4, max_new_tokens=4)
    batch = rk.advantage(rk.score(batch, lambda completions, **_: [float(len(c) % 2) for c in completions]), "grpo")
    for k in range(1, 3):
        state, _ = rk.update(state, batch, mini_batch_size=4, epochs=2)  # 2 x 2 optimizer steps
        assert (state.step, state.policy_version, state.scheduler.last_epoch) == (k, k, 4 * k)
