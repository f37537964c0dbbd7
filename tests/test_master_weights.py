"""float32 master weights for bf16/fp16 parameters (rk.optim.MasterWeightAdamW, the default for
such parameters): each step equals AdamW on a float32 copy exactly, small learning rates move
the weights that plain bf16 AdamW leaves unchanged, the master copies survive a checkpoint (a
resumed run equals the uninterrupted one), and rk.init warns only when they are turned off."""
import copy
import warnings

import pytest
import torch

import rlkit as rk
from rlkit import checkpoint as ck
from rlkit.batch import make_batch
from rlkit.optim import MasterWeightAdamW
from rlkit.transforms.forward import model_logprobs


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused", [None, False])
def test_each_step_equals_adamw_on_a_float32_copy(dtype, fused):
    torch.manual_seed(0)
    low = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.LayerNorm(48)).to(dtype)
    ref = copy.deepcopy(low).float()  # the same starting weights, in float32
    o_low, _ = rk.optim.adamw(lr=1e-4, fused=fused, weight_decay=0.1).build(low)
    o_ref, _ = rk.optim.adamw(lr=1e-4, fused=fused, weight_decay=0.1).build(ref)
    assert isinstance(o_low, MasterWeightAdamW) and not isinstance(o_ref, MasterWeightAdamW)
    for step in range(30):
        for model, opt in ((low, o_low), (ref, o_ref)):
            for p, g in zip(model.parameters(), _grads(ref, step)):
                p.grad = g.to(p.dtype)
            opt.step()
            opt.zero_grad()
    for p, r in zip(low.parameters(), ref.parameters()):
        assert p.dtype == dtype
        assert torch.equal(o_low.state[p]["master"], r.detach())  # the float32 trajectory, bit for bit
        assert torch.equal(p.detach(), r.detach().to(dtype))  # the model holds it rounded
        assert o_low.state[p]["exp_avg"].dtype == torch.float32


def test_small_steps_accumulate_where_plain_bf16_loses_them():
    torch.manual_seed(0)
    start = torch.nn.Linear(64, 64).to(torch.bfloat16)
    master, plain = copy.deepcopy(start), copy.deepcopy(start)
    o_master, _ = rk.optim.adamw(lr=1e-6).build(master)
    o_plain, _ = rk.optim.adamw(lr=1e-6, master_weights=False).build(plain)
    assert type(o_plain) is torch.optim.AdamW
    grads = _grads(start, 0)
    for _ in range(400):
        for model, opt in ((master, o_master), (plain, o_plain)):
            for p, g in zip(model.parameters(), grads):  # one direction: Adam steps of about lr each time
                p.grad = g
            opt.step()
            opt.zero_grad()
    changed = lambda m: (m.weight != start.weight).float().mean().item()  # noqa: E731
    assert changed(plain) < 0.05  # 400 steps of 1e-6 are rounded away almost everywhere
    assert changed(master) > 0.5  # 4e-4 in all: past half the spacing of most weights
    assert rk.state.movable_fraction(start, 1e-6) < 0.05


def test_a_bf16_policy_trains_through_update_and_init_does_not_warn(tiny_model, char_tok):
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "changes only 2%" warning: master weights are on
        state = rk.init(model, rk.optim.adamw(lr=1e-6), tokenizer=char_tok)
    assert isinstance(state.optimizer, MasterWeightAdamW)
    before = {k: v.detach().float() for k, v in state.actor.named_parameters()}
    batch = _batch(state.actor)
    for _ in range(3):
        state, metrics = rk.update(state, batch, max_logprob_gap=None)
    masters = {k: state.optimizer.state[v]["master"] for k, v in state.actor.named_parameters()}
    moved = sum(int((before[k] != m).sum()) for k, m in masters.items())
    total = sum(v.numel() for v in before.values())
    assert moved / total > 0.9, moved / total  # every step is kept, in float32
    for k, v in state.actor.named_parameters():  # and the model holds the master copy, rounded
        assert v.dtype == torch.bfloat16 and torch.equal(v.detach(), masters[k].to(torch.bfloat16)), k


def _batch(model):
    prompts, responses = [[1, 5, 6], [1, 7], [1, 8, 9], [1, 11]], [[3, 4, 5], [6, 7], [8], [9, 10, 11]]
    plain = make_batch(prompts, responses, group=[0, 0, 1, 1])
    lp, _ = model_logprobs(model, plain)
    rows = [lp[i, : len(r)].float().tolist() for i, r in enumerate(responses)]
    return rk.advantage(make_batch(prompts, responses, group=[0, 0, 1, 1], logprobs=rows, rewards=[1.0, 0.0, 0.5, 2.0]), "grpo")


def _bf16_state(tiny_model, char_tok, **spec):
    return rk.init(copy.deepcopy(tiny_model).to(torch.bfloat16), rk.optim.adamw(lr=1e-5, **spec), tokenizer=char_tok)


def test_a_resumed_run_equals_the_uninterrupted_one(tiny_model, char_tok, tmp_path):
    """torch's load_state_dict casts floating optimizer state to the parameter's dtype: the master
    copies and moments would come back in bf16 and the resumed run drift from the uninterrupted one."""
    state = _bf16_state(tiny_model, char_tok)
    batch = _batch(state.actor)
    for _ in range(2):
        state, _ = rk.update(state, batch, max_logprob_gap=None)
    path = ck.save(state, tmp_path)
    for _ in range(3):
        state, _ = rk.update(state, batch, max_logprob_gap=None)
    resumed = ck.load(_bf16_state(tiny_model, char_tok), path)
    p0 = next(resumed.actor.parameters())
    assert {k: v.dtype for k, v in resumed.optimizer.state[p0].items() if k != "step"} == {
        "exp_avg": torch.float32, "exp_avg_sq": torch.float32, "master": torch.float32}
    for _ in range(3):
        resumed, _ = rk.update(resumed, batch, max_logprob_gap=None)
    assert resumed.step == state.step == 5
    for (name, a), b in zip(state.actor.named_parameters(), resumed.actor.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(state.optimizer.state[a]["master"], resumed.optimizer.state[b]["master"]), name


def test_the_saved_spec_governs_master_weights_on_resume(tiny_model, char_tok, tmp_path):
    state = _bf16_state(tiny_model, char_tok)
    state, _ = rk.update(state, _batch(state.actor), max_logprob_gap=None)
    path = ck.save(state, tmp_path)
    with pytest.warns(RuntimeWarning, match=r"master_weights \(saved None, given False\)"):
        resumed = ck.load(_bf16_state(tiny_model, char_tok, master_weights=False), path)
    assert isinstance(resumed.optimizer, MasterWeightAdamW) and resumed.optimizer_spec.master_weights is None


def test_master_weights_off_warns_at_init_and_bad_values_are_refused(tiny_model, char_tok):
    with pytest.warns(RuntimeWarning, match=r"built with master_weights=False.*leave master_weights at None"):
        rk.init(copy.deepcopy(tiny_model).to(torch.bfloat16), rk.optim.adamw(lr=1e-6, master_weights=False), tokenizer=char_tok)
    with pytest.raises(ValueError, match="master_weights must be True, False or None"):
        rk.optim.adamw(master_weights="yes")
    # float32 parameters: plain AdamW whatever the setting (nothing to keep a master copy of)
    opt, _ = rk.optim.adamw(master_weights=True).build(torch.nn.Linear(4, 4))
    assert type(opt) is torch.optim.AdamW


def test_weights_changed_outside_the_optimizer_are_kept(tiny_model, char_tok):
    """A master copy, once made, was written back at every step: a rollback (load_state_dict) or an
    SFT warm-up between updates was undone by the next update, in bf16 only."""
    state = _bf16_state(tiny_model, char_tok)
    start = {k: v.detach().clone() for k, v in state.actor.state_dict().items()}
    batch = _batch(state.actor)
    for _ in range(3):
        state, _ = rk.update(state, batch, max_logprob_gap=None)
    state.actor.load_state_dict(start)  # roll back
    for group in state.optimizer.param_groups:
        group["lr"] = 1e-12  # a step too small to move anything: the weights must stay rolled back
    state, _ = rk.update(state, batch, max_logprob_gap=None)
    for name, value in state.actor.state_dict().items():
        # a step of 1e-12 moves only exact zeros (bf16 holds 1e-12); the undone rollback moved ~1e-2
        torch.testing.assert_close(value, start[name], atol=1e-9, rtol=0, msg=name)
    for p in state.actor.parameters():
        assert torch.equal(state.optimizer.state[p]["master"].to(torch.bfloat16), p.detach())


def test_spec_checks_eps_and_normalises_betas():
    with pytest.raises(ValueError, match=r"eps must be a finite number > 0 .*0/0.*got 0"):
        rk.optim.adamw(eps=0.0)
    listed = rk.optim.adamw(betas=[0.9, 0.95])
    assert listed == rk.optim.adamw(betas=(0.9, 0.95)) and hash(listed) == hash(rk.optim.adamw(betas=(0.9, 0.95)))


def test_fp16_training_warns_what_float16_still_costs_under_loss_scaling(tiny_model, char_tok):
    fp16 = copy.deepcopy(tiny_model).to(torch.float16)
    with pytest.warns(RuntimeWarning, match=r"float16\. rk.update scales their loss dynamically.*overflow.*Use bfloat16"):
        rk.init(fp16, rk.optim.adamw(lr=1e-4), tokenizer=char_tok)
    with pytest.warns(RuntimeWarning, match=r"master_weights=False AdamW's second moment"):
        rk.init(copy.deepcopy(fp16), rk.optim.adamw(lr=1e-4, master_weights=False), tokenizer=char_tok)


def _with_unused_head(model):
    model = copy.deepcopy(model)
    model.extra_head = torch.nn.Linear(model.config.hidden_size, 2)  # trainable, never in the forward
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_parameter_without_gradient_at_the_save_resumes_exactly(tiny_model, char_tok, tmp_path, dtype):
    """Its optimizer had no state, and DCP refused the checkpoint as corrupt on load."""
    def fresh():
        return rk.init(_with_unused_head(tiny_model).to(dtype), rk.optim.adamw(lr=1e-4), tokenizer=char_tok)

    state = fresh()
    batch = _batch(state.actor)
    state, _ = rk.update(state, batch, max_logprob_gap=None)
    path = ck.save(state, tmp_path)
    state, _ = rk.update(state, batch, max_logprob_gap=None)
    resumed, _ = rk.update(ck.load(fresh(), path), batch, max_logprob_gap=None)
    for (name, a), b in zip(state.actor.named_parameters(), resumed.actor.parameters()):
        assert torch.equal(a, b), name
    assert resumed.optimizer.state.get(resumed.actor.extra_head.weight, {}) == {}


def test_a_float32_checkpoint_resumes_into_a_bf16_state(tiny_model, char_tok, tmp_path):
    """The bf16 template's optimizer asked the float32 checkpoint for master copies it never had:
    reported as a corrupt checkpoint."""
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-4), tokenizer=char_tok)
    state, _ = rk.update(state, _batch(state.actor), max_logprob_gap=None)
    path = ck.save(state, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dtype change is warned about (the resume is not exact)
        resumed = ck.load(_bf16_state(tiny_model, char_tok), path)
    for a, b in zip(state.actor.parameters(), resumed.actor.parameters()):
        assert torch.equal(a.detach().to(torch.bfloat16), b.detach())
    resumed, _ = rk.update(resumed, _batch(resumed.actor), max_logprob_gap=None)  # masters from the loaded weights
    assert resumed.step == 2
