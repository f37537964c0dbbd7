"""``OptimizerSpec.no_decay``: parameters matched by name get no weight decay (a second AdamW group),
through rk.init, a checkpoint and a resume. Before it every parameter decayed (one group), unlike
transformers' Trainer (and TRL), which leaves biases and norm weights out."""
import warnings

import pytest
import torch

import rlkit as rk
from rlkit import checkpoint as ck


def _linear_state(spec, seed=0):
    torch.manual_seed(seed)
    return rk.init(torch.nn.Linear(4, 3), spec, seed=7)


def _zero_grad_steps(state, n):
    """n optimizer steps on a loss whose gradient is exactly zero: only weight decay moves params."""
    for _ in range(n):
        state.optimizer.zero_grad()
        (0.0 * sum(p.sum() for p in state.actor.parameters())).backward()
        state.optimizer.step()
        state.scheduler.step()
        state = state.replace(step=state.step + 1, policy_version=state.policy_version + 1)
    return state


def test_matched_parameters_do_not_decay_and_the_rest_follow_decoupled_decay():
    lr, wd = 0.1, 0.5
    state = _linear_state(rk.optim.adamw(lr=lr, weight_decay=wd, no_decay=("*bias",)))
    w0, b0 = state.actor.weight.detach().clone(), state.actor.bias.detach().clone()
    state = _zero_grad_steps(state, 3)
    # AdamW's decoupled decay with a zero gradient: p <- p * (1 - lr * wd) each step
    torch.testing.assert_close(state.actor.weight.detach(), w0 * (1 - lr * wd) ** 3)
    assert torch.equal(state.actor.bias.detach(), b0)


def test_norms_and_biases_preset_excludes_exactly_the_norm_weights_and_biases(tiny_model):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3, no_decay=rk.optim.NORMS_AND_BIASES))
    undecayed = {id(p) for g in state.optimizer.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    expected = {id(p) for m in tiny_model.modules() if isinstance(m, Qwen2RMSNorm) for p in m.parameters()}
    expected |= {id(p) for name, p in tiny_model.named_parameters() if name.endswith(".bias")}  # qwen2: q/k/v biases
    assert expected and undecayed == expected
    decayed = [p for g in state.optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]]
    assert len(decayed) + len(undecayed) == len([p for p in tiny_model.parameters() if p.requires_grad])


def test_bad_no_decay_values_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"no_decay must be a tuple .*no_decay=\('\*bias',\)"):
        rk.optim.adamw(no_decay="*bias")
    with pytest.raises(ValueError, match=r"no_decay=\('\*Bias',\) matches no trained parameter .*weight, bias"):
        _linear_state(rk.optim.adamw(no_decay=("*Bias",)))
    with pytest.raises(ValueError, match=r"build\(\) got bare parameters; pass the model"):
        rk.optim.adamw(no_decay=("*bias",)).build(torch.nn.Linear(2, 2).parameters())
    assert rk.optim.adamw(no_decay=["*bias"]).no_decay == ("*bias",)  # a list from a config file


def test_resume_equals_the_uninterrupted_run_and_the_saved_groups_govern(tmp_path):
    spec = rk.optim.adamw(lr=0.1, weight_decay=0.5, no_decay=("*bias",))

    def real_steps(state, n):
        for _ in range(n):
            state.optimizer.zero_grad()
            (state.actor(torch.ones(2, 4)) ** 2).sum().backward()
            state.optimizer.step()
            state.scheduler.step()
            state = state.replace(step=state.step + 1, policy_version=state.policy_version + 1)
        return state

    whole = real_steps(_linear_state(spec), 4)
    half = real_steps(_linear_state(spec), 2)
    ck.Checkpointer(tmp_path, save_on_sigterm=False).save(half)
    # a template built with the default spec (one group): the saved spec and its two groups apply
    with pytest.warns(RuntimeWarning, match=r"differs from the saved one in no_decay"):
        resumed = ck.Checkpointer(tmp_path, save_on_sigterm=False).resume(_linear_state(rk.optim.adamw(lr=0.1, weight_decay=0.5), 1), "auto")
    assert resumed.optimizer_spec.no_decay == ("*bias",)
    assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [0.5, 0.0]
    resumed = real_steps(resumed, 2)
    for a, b in zip(whole.actor.parameters(), resumed.actor.parameters()):
        assert torch.equal(a, b)
    # the same spec given: no warning, the same result
    again = ck.Checkpointer(tmp_path, save_on_sigterm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = real_steps(again.restore(_linear_state(spec, 2), tmp_path / "step_000002"), 2)
    for a, b in zip(whole.actor.parameters(), same.actor.parameters()):
        assert torch.equal(a, b)


def test_a_checkpoint_written_before_no_decay_existed_resumes_without_a_warning(tmp_path, monkeypatch):
    state = _zero_grad_steps(_linear_state(rk.optim.adamw(lr=0.1)), 1)
    plain = rk.optim.OptimizerSpec.to_dict
    monkeypatch.setattr(rk.optim.OptimizerSpec, "to_dict", lambda self: {k: v for k, v in plain(self).items() if k != "no_decay"})
    ck.Checkpointer(tmp_path, save_on_sigterm=False).save(state)
    monkeypatch.setattr(rk.optim.OptimizerSpec, "to_dict", plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = ck.Checkpointer(tmp_path, save_on_sigterm=False).resume(_linear_state(rk.optim.adamw(lr=0.1), 1), "auto")
    assert resumed.step == 1 and resumed.optimizer_spec.no_decay == ()
