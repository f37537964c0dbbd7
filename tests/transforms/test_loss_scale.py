"""Dynamic loss scaling of float16 parameters in rk.update (rlkit.transforms.update.LossScale)."""
import copy
import warnings

import pytest
import torch

import rlkit as rk
from rlkit.batch import make_batch
from rlkit.transforms.forward import model_logprobs
from rlkit.transforms.update import LOSS_SCALE_INIT, LOSS_SCALE_MAX, NonFiniteError

FLOAT16_TINY = 2.0**-24  # float16's smallest subnormal: smaller magnitudes flush to zero


def _batch(model, seed=0, b=8, vocab=18, advantage_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(b)]
    responses = [torch.randint(3, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(b)]
    batch = make_batch(prompts, responses, group=[i // 4 for i in range(b)], rewards=torch.rand(b, generator=g).tolist())
    lp, _ = model_logprobs(copy.deepcopy(model).float(), batch)
    batch.set("logprobs", lp)
    batch.set("advantages", advantage_scale * torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"])
    return batch


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _fp16_state(model, char_tok, lr=1e-3, **spec):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # rk.init's float16 warning
        return rk.init(copy.deepcopy(model).to(torch.float16), rk.optim.adamw(lr=lr, **spec), tokenizer=char_tok)


def _with_extras(state, **entries):
    return state.replace(extras={**state.extras, **{k.replace("__", "/"): v for k, v in entries.items()}})


def test_scaled_float16_update_matches_a_float32_reference_where_unscaled_gradients_flush(tiny_model, char_tok):
    """Advantages of 1e-5 make most true gradient entries smaller than float16's smallest number:
    unscaled, float16 backward flushed them to zero and the step moved (almost) nothing."""
    fp16 = copy.deepcopy(tiny_model).to(torch.float16)
    reference = copy.deepcopy(fp16).float()  # the same weights, trained in float32
    batch = _batch(reference, advantage_scale=1e-5)
    spec = rk.optim.adamw(lr=1e-3, weight_decay=0.0)
    start = {k: v.float() for k, v in _params(reference).items()}

    ref_state = rk.init(reference, spec, tokenizer=char_tok)
    ref_state, ref_metrics = rk.update(ref_state, batch, max_logprob_gap=None)
    grads = torch.cat([p.grad.flatten() for p in ref_state.actor.parameters() if p.grad is not None]).abs()
    # the premise: most true gradient entries are nonzero, yet below what float16 can hold
    assert ((grads > 0) & (grads < FLOAT16_TINY)).float().mean() > 0.8
    assert "actor/loss_scale" not in ref_metrics

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        state = rk.init(fp16, spec, tokenizer=char_tok)
    state, metrics = rk.update(state, batch, max_logprob_gap=None)
    ref_after = dict(ref_state.actor.named_parameters())
    err = ref = err16 = 0.0
    for name, p in state.actor.named_parameters():
        assert p.dtype == torch.float16 and (p.grad is None or p.grad.dtype == torch.float16), name
        expected = ref_after[name].detach() - start[name]
        master = state.optimizer.state[p]["master"]  # the float32 copy the optimizer stepped
        err += (master - start[name] - expected).pow(2).sum().item()
        ref += expected.pow(2).sum().item()
        # the float16 weights themselves, against the reference's rounded to float16
        err16 += (p.detach().float() - ref_after[name].detach().to(torch.float16).float()).pow(2).sum().item()
    # 0.0013 and 0.0036 here; unscaled (the old update) both were 0.999: the step had (nearly) no gradient to follow
    assert (err / ref) ** 0.5 < 0.01
    assert (err16 / ref) ** 0.5 < 0.03

    assert metrics["actor/loss_scale"] == LOSS_SCALE_INIT and metrics["actor/loss_scale_overflows"] == 0.0
    assert state.extras["loss_scale/actor"] == LOSS_SCALE_INIT and state.extras["loss_scale/actor_good_steps"] == 1
    # the grad norm is of the true (unscaled) gradients
    assert metrics["actor/grad_norm"] == pytest.approx(ref_metrics["actor/grad_norm"], rel=1e-2)


def test_an_overflow_skips_the_step_halves_the_scale_and_is_no_nonfinite_step(tiny_model, char_tok):
    state = _with_extras(_fp16_state(tiny_model, char_tok), loss_scale__actor=LOSS_SCALE_MAX)  # ~1.7e7: gradients ~1 overflow
    before = _params(state.actor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no non-finite warning, no NonFiniteError at max_nonfinite_steps=1
        state, metrics = rk.update(state, _batch(tiny_model), max_nonfinite_steps=1, max_logprob_gap=None)
    assert all(torch.equal(before[k], v) for k, v in _params(state.actor).items())  # the step was skipped
    assert metrics["actor/loss_scale"] == LOSS_SCALE_MAX / 2 and metrics["actor/loss_scale_overflows"] == 1.0
    assert metrics["actor/skipped_steps"] == 0.0 and "actor/grad_norm" not in metrics  # no inf norm averaged in
    assert state.extras["nonfinite_streak"] == 0 and state.policy_version == 0
    assert state.extras["loss_scale/actor"] == LOSS_SCALE_MAX / 2 and state.extras["loss_scale/actor_good_steps"] == 0

    # within one update: each overflow halves the scale for the next mini-batch, until steps run
    state = _with_extras(state, loss_scale__actor=LOSS_SCALE_MAX)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, metrics = rk.update(state, _batch(tiny_model, b=16), mini_batch_size=1, max_nonfinite_steps=1, max_logprob_gap=None)
    overflowed = int(metrics["actor/loss_scale_overflows"])
    assert 1 <= overflowed < 16 and metrics["actor/loss_scale"] == LOSS_SCALE_MAX / 2**overflowed
    assert state.policy_version == 1 and 1 <= state.extras["loss_scale/actor_good_steps"] <= 16 - overflowed


def test_a_nonfinite_loss_is_still_a_nonfinite_step_under_loss_scaling(tiny_model, char_tok):
    batch = _batch(tiny_model)
    batch.set("advantages", batch["advantages"] * float("nan"))
    state = _with_extras(_fp16_state(tiny_model, char_tok), loss_scale__actor=2.0**10, loss_scale__actor_good_steps=5)
    with pytest.warns(RuntimeWarning, match=r"non-finite loss or gradient at step 0.*\(1 in a row\)"):
        state, metrics = rk.update(state, batch, max_nonfinite_steps=2, max_logprob_gap=None)
    # the scale did not cause it: kept; the run of finite steps starts again
    assert metrics["actor/skipped_steps"] == 1.0 and metrics["actor/loss_scale_overflows"] == 0.0
    assert metrics["actor/loss_scale"] == 2.0**10 and state.extras["loss_scale/actor_good_steps"] == 0
    with pytest.raises(NonFiniteError, match="2 consecutive updates"), pytest.warns(RuntimeWarning, match=r"\(2 in a row\)"):
        rk.update(state, batch, max_nonfinite_steps=2, max_logprob_gap=None)


def test_an_overflow_at_scale_one_is_a_nonfinite_step(tiny_model, char_tok):
    """A finite loss whose float16 gradients overflow even unscaled: the scale halves to 1, and
    from there the skipped steps count towards NonFiniteError (it would otherwise never raise)."""
    from rlkit.algos.losses import ppo_clip

    def huge(logprobs, old_logprobs, advantages, response_mask, **kw):
        loss, metrics = ppo_clip(logprobs, old_logprobs, advantages, response_mask, **kw)
        return loss * 1e9, metrics  # finite in float32; its gradients are not in float16

    state = _with_extras(_fp16_state(tiny_model, char_tok), loss_scale__actor=2.0)
    with pytest.raises(NonFiniteError, match="2 consecutive updates"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rk.update(state, _batch(tiny_model), loss=huge, mini_batch_size=2, max_nonfinite_steps=2, max_logprob_gap=None)
    # mini-batch 0 overflowed at scale 2 (silently, halving it), 1 and 2 at scale 1 (warned; 2 raised)
    assert [str(w.message) for w in caught if "non-finite" in str(w.message)] == [
        "rlkit.update: non-finite loss or gradient at step 0 (mini-batch 1); optimizer step skipped (1 in a row)",
        "rlkit.update: non-finite loss or gradient at step 0 (mini-batch 2); optimizer step skipped (2 in a row)",
    ]


def test_the_scale_doubles_after_growth_interval_finite_steps(tiny_model, char_tok):
    batch = _batch(tiny_model, advantage_scale=1e-3)
    state = _with_extras(_fp16_state(tiny_model, char_tok), loss_scale__actor=2.0**4)
    state, metrics = rk.update(state, batch, mini_batch_size=2, loss_scale_growth_interval=2, max_logprob_gap=None)
    assert metrics["actor/loss_scale"] == 2.0**6 and state.extras["loss_scale/actor_good_steps"] == 0  # 4 steps: 2 doublings
    state, metrics = rk.update(state, batch, mini_batch_size=2, loss_scale_growth_interval=3, max_logprob_gap=None)
    assert metrics["actor/loss_scale"] == 2.0**7 and state.extras["loss_scale/actor_good_steps"] == 1
    # capped
    state = _with_extras(state, loss_scale__actor=LOSS_SCALE_MAX)
    state, metrics = rk.update(state, _batch(tiny_model, advantage_scale=1e-6), loss_scale_growth_interval=1, max_logprob_gap=None)
    assert metrics["actor/loss_scale_overflows"] == 0.0 and metrics["actor/loss_scale"] == LOSS_SCALE_MAX


@pytest.mark.parametrize("kw,match", [
    (dict(loss_scale_growth_interval=0), r"loss_scale_growth_interval must be a positive int .*got 0"),
    (dict(loss_scale_growth_interval=2.5), r"loss_scale_growth_interval must be a positive int .*got 2\.5"),
    (dict(extras={"loss_scale/actor": 0.5}), r"state\.extras\['loss_scale/actor'\] .*must be a number from 1 to 2\*\*24 .*got 0\.5"),
    (dict(extras={"loss_scale/actor": 2.0**30}), r"state\.extras\['loss_scale/actor'\] .*from 1 to 2\*\*24"),
    (dict(extras={"loss_scale/actor": float("nan")}), r"state\.extras\['loss_scale/actor'\]"),
    (dict(extras={"loss_scale/actor_good_steps": -1}), r"state\.extras\['loss_scale/actor_good_steps'\] .*int >= 0, got -1"),
])
def test_bad_loss_scale_settings_are_refused_before_any_work(tiny_model, char_tok, kw, match):
    state = _fp16_state(tiny_model, char_tok)
    extras = kw.pop("extras", None)
    if extras:
        state = state.replace(extras=extras)
    before = _params(state.actor)
    with pytest.raises(ValueError, match=match):
        rk.update(state, _batch(tiny_model), max_logprob_gap=None, **kw)
    assert all(torch.equal(before[k], v) for k, v in _params(state.actor).items())
    state._check()  # not donated


def test_the_scale_survives_a_checkpoint_and_the_resumed_update_goes_on_with_it(tiny_model, char_tok, tmp_path):
    batch = _batch(tiny_model, advantage_scale=1e-3)
    state = _with_extras(_fp16_state(tiny_model, char_tok), loss_scale__actor=2.0**10)
    state, metrics = rk.update(state, batch, loss_scale_growth_interval=2, max_logprob_gap=None)
    assert metrics["actor/loss_scale"] == 2.0**10 and state.extras["loss_scale/actor_good_steps"] == 1
    path = rk.checkpoint.save(state, tmp_path)
    restored = rk.checkpoint.load(_fp16_state(tiny_model, char_tok), path)
    assert restored.extras["loss_scale/actor"] == 2.0**10 and restored.extras["loss_scale/actor_good_steps"] == 1
    # the second finite step at 2**10 doubles it: a fresh state would have started from 2**16
    restored, metrics = rk.update(restored, batch, loss_scale_growth_interval=2, max_logprob_gap=None)
    assert metrics["actor/loss_scale"] == 2.0**11
    state, expected = rk.update(state, batch, loss_scale_growth_interval=2, max_logprob_gap=None)
    assert metrics["actor/loss_scale"] == expected["actor/loss_scale"]
    for name, value in _params(restored.actor).items():
        assert torch.equal(value, state.actor.get_parameter(name).detach()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_and_float32_train_unscaled(tiny_model, char_tok, dtype):
    """A stale scale in the extras (say from a float16 run) changes nothing for other dtypes."""
    batch = _batch(tiny_model)
    results = []
    for extras in ({}, {"loss_scale/actor": 2.0**10, "loss_scale/actor_good_steps": 3}):
        state = rk.init(copy.deepcopy(tiny_model).to(dtype), rk.optim.adamw(lr=1e-2), tokenizer=char_tok)
        state = state.replace(extras=extras)
        state, metrics = rk.update(state, batch, mini_batch_size=4, max_logprob_gap=None)
        assert not any("loss_scale" in k for k in metrics)
        assert dict(state.extras) == {**extras, "nonfinite_streak": 0}
        results.append((_params(state.actor), metrics))
    (first, m1), (second, m2) = results
    assert m1 == m2 and all(torch.equal(first[k], second[k]) for k in first)


def test_a_float16_critic_has_its_own_scale(tiny_model, char_tok):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fp16 = copy.deepcopy(tiny_model).to(torch.float16)
        state = rk.init(fp16, rk.optim.adamw(lr=1e-3), tokenizer=char_tok, critic=rk.models.critic(copy.deepcopy(fp16)))
    batch = rk.advantage(rk.compute_values(state, _batch(tiny_model)), "gae")
    state = _with_extras(state, loss_scale__critic=LOSS_SCALE_MAX)  # the critic overflows; the actor does not
    actor_before, critic_before = _params(state.actor), _params(state.critic)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, metrics = rk.update(state, batch, max_nonfinite_steps=1, max_logprob_gap=None)
    assert metrics["critic/loss_scale"] == LOSS_SCALE_MAX / 2 and metrics["critic/loss_scale_overflows"] == 1.0
    assert metrics["actor/loss_scale"] == LOSS_SCALE_INIT and metrics["actor/loss_scale_overflows"] == 0.0
    assert metrics["critic/skipped_steps"] == 0.0 and state.extras["critic_nonfinite_streak"] == 0
    assert all(torch.equal(critic_before[k], v) for k, v in _params(state.critic).items())
    assert any(not torch.equal(actor_before[k], v) for k, v in _params(state.actor).items())
    state = _with_extras(state, loss_scale__critic=2.0**8)
    state, metrics = rk.update(state, batch, max_logprob_gap=None)  # a scale that fits: the critic trains
    assert metrics["critic/loss_scale_overflows"] == 0.0 and state.extras["loss_scale/critic_good_steps"] == 1
    assert any(not torch.equal(critic_before[k], v) for k, v in _params(state.critic).items())


def test_float16_without_master_weights_is_scaled_and_unscaled_in_place(tiny_model, char_tok):
    state = _fp16_state(tiny_model, char_tok, master_weights=False)
    assert not isinstance(state.optimizer, rk.optim.MasterWeightAdamW)
    before = _params(state.actor)
    state, metrics = rk.update(state, _batch(tiny_model), max_logprob_gap=None)
    assert metrics["actor/loss_scale"] == LOSS_SCALE_INIT and metrics["actor/loss_scale_overflows"] == 0.0
    # the reported norm is of the unscaled gradients (2**16 times larger scaled)
    assert 0 < metrics["actor/grad_norm"] < 100
    after = _params(state.actor)
    assert all(torch.isfinite(v).all() for v in after.values()) and any(not torch.equal(before[k], after[k]) for k in before)


class _Adapter(torch.nn.Module):
    """A LoRA-style float32 adapter over a frozen linear layer (PEFT keeps adapters in float32)."""

    def __init__(self, base, r=4):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.base = base
        self.A = torch.nn.Parameter(torch.randn(base.in_features, r, generator=g) * 0.1)
        self.B = torch.nn.Parameter(torch.randn(r, base.out_features, generator=g) * 0.1)

    def forward(self, x):
        return self.base(x) + (x.to(self.A.dtype) @ self.A @ self.B).to(x.dtype)


def _adapted(model, dtype):
    model = copy.deepcopy(model).to(dtype).requires_grad_(False)
    attn = model.model.layers[0].self_attn
    attn.q_proj = _Adapter(attn.q_proj)
    return model


def test_float32_adapters_on_a_frozen_float16_base_are_scaled(tiny_model, char_tok):
    """PEFT's default layout: a frozen float16 model, float32 trainable adapters. Their gradients
    pass through float16 activations and flushed to zero unscaled, while scaling was decided by
    the trained parameters' dtype alone (none float16: no scale)."""
    base = copy.deepcopy(tiny_model).half().float()  # weights float16 can hold: the two runs start equal
    fp16, reference = _adapted(base, torch.float16), _adapted(base, torch.float32)
    batch = _batch(reference, advantage_scale=1e-5)
    spec = rk.optim.adamw(lr=1e-3, weight_decay=0.0)
    grads = {}
    for name, model in (("reference", reference), ("fp16", fp16)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            state, metrics = rk.update(rk.init(model, spec, tokenizer=char_tok), batch, max_logprob_gap=None, max_grad_norm=None)
        grads[name] = torch.cat([p.grad.flatten().float() for p in state.actor.parameters() if p.requires_grad])
        grads[name + "_metrics"] = metrics
    assert all(p.dtype == torch.float32 for p in fp16.parameters() if p.requires_grad)
    assert grads["fp16_metrics"]["actor/loss_scale"] == LOSS_SCALE_INIT
    assert "actor/loss_scale" not in grads["reference_metrics"]
    # unscaled: 78% error, 9% of the entries flushed to exactly 0
    assert (grads["fp16"] == 0).float().mean() < 0.01
    assert (grads["fp16"] - grads["reference"]).norm() / grads["reference"].norm() < 0.05


def test_recipes_pass_the_growth_interval_to_update(tiny_model, char_tok):
    recipe = rk.recipes.get("grpo", loss_scale_growth_interval=3)
    assert recipe.update_kwargs()["loss_scale_growth_interval"] == 3
    assert rk.recipes.get("grpo").update_kwargs()["loss_scale_growth_interval"] == 2000


def test_without_grad_dtype_float16_gradients_are_unscaled_in_float16_and_still_step_correctly(tiny_model, char_tok, monkeypatch):
    """torch < 2.9 has no ``grad_dtype``: a float16 parameter cannot hold a float32 gradient, so
    _unscaled_gradients divides its scaled float16 gradient in float16, in place, even for
    MasterWeightAdamW. Simulated here through the _can_widen seam on a torch that has it: the
    optimizer must be handed float16 gradients (the fallback ran), and the step must still be the
    float32 reference's. eps=1 makes AdamW's first step about lr * gradient (with the default eps
    it is lr * sign(gradient), blind to a gradient unscaled twice or not at all)."""
    from rlkit.transforms import update as update_module

    monkeypatch.setattr(update_module, "_can_widen", lambda p: False)
    fp16 = copy.deepcopy(tiny_model).to(torch.float16)
    reference = copy.deepcopy(fp16).float()  # the same weights, trained in float32
    batch = _batch(reference)  # advantages ~1: the true gradients are within float16's range
    spec = rk.optim.adamw(lr=0.1, weight_decay=0.0, eps=1.0)
    start = {k: v.float() for k, v in _params(reference).items()}
    ref_state, ref_metrics = rk.update(rk.init(reference, spec, tokenizer=char_tok), batch, max_logprob_gap=None, max_grad_norm=None)

    state = _fp16_state(tiny_model, char_tok, lr=0.1, weight_decay=0.0, eps=1.0)
    assert isinstance(state.optimizer, rk.optim.MasterWeightAdamW)
    # the dtypes of the gradients the optimizer is handed (its own step runs the hook again, inside,
    # on the float32 gradients it swaps in for the master copies: the first call is update's)
    handed = []
    state.optimizer.register_step_pre_hook(
        lambda *_: handed.append({p.grad.dtype for p in state.actor.parameters() if p.grad is not None}))
    state, metrics = rk.update(state, batch, max_logprob_gap=None, max_grad_norm=None)
    assert handed[0] == {torch.float16}  # the float16 fallback, not the float32 widening
    assert metrics["actor/loss_scale"] == LOSS_SCALE_INIT and metrics["actor/loss_scale_overflows"] == 0.0
    # the true gradient, not 2**16 times it (nor 2**-16 times)
    assert metrics["actor/grad_norm"] == pytest.approx(ref_metrics["actor/grad_norm"], rel=1e-3)
    ref_after = dict(ref_state.actor.named_parameters())
    err = ref = g_err = g_ref = 0.0
    for name, p in state.actor.named_parameters():
        expected = ref_after[name].detach() - start[name]
        err += (state.optimizer.state[p]["master"] - start[name] - expected).pow(2).sum().item()
        ref += expected.pow(2).sum().item()
        g_err += (p.grad.float() - ref_after[name].grad).pow(2).sum().item()
        g_ref += ref_after[name].grad.pow(2).sum().item()
    # 7e-4 each here; a gradient left scaled or divided twice is off by ~1
    assert (g_err / g_ref) ** 0.5 < 5e-3
    assert (err / ref) ** 0.5 < 5e-3


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_the_nonfinite_step_warning_points_at_the_callers_line(tiny_model, char_tok, role):
    """update's warnings name the line that called rk.update (stacklevel), for the actor's and the
    critic's skipped steps alike, wherever inside update the step is decided."""
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok,
                    critic=rk.models.critic(copy.deepcopy(tiny_model)) if role == "critic" else None)
    batch = _batch(tiny_model)
    if role == "critic":
        batch = rk.advantage(rk.compute_values(state, batch), "gae")
        batch.set("returns", batch["returns"] * float("nan"))
    else:
        batch.set("advantages", batch["advantages"] * float("nan"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rk.update(state, batch, max_nonfinite_steps=2, max_logprob_gap=None)
    noun = "critic " if role == "critic" else ""
    (warning,) = [w for w in caught if f"non-finite {noun}loss" in str(w.message)]
    assert str(warning.message) == (f"rlkit.update: non-finite {noun}loss or gradient at step 0 (mini-batch 0); "
                                    f"{noun}optimizer step skipped (1 in a row)")
    assert warning.filename == __file__
