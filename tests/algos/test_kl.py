import dataclasses
import math

import pytest
import torch

from rlkit.algos.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    kl_penalty,
    straight_through,
)

F64 = torch.float64


# ---------------------------------------------------------------- slow float64 references


def ref_base(mode, lp, ref):
    d = lp - ref
    if mode in ("k1", "kl"):
        return d
    if mode == "abs":
        return abs(d)
    if mode in ("k2", "mse"):
        return 0.5 * d * d
    if mode in ("k3", "low_var_kl"):
        x = min(max(ref - lp, -20.0), 20.0)
        return min(max(math.exp(x) - x - 1, -10.0), 10.0)
    raise KeyError(mode)


def ref_kl(mode, lp, ref):
    out = torch.zeros(lp.shape, dtype=F64)
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            out[i, j] = ref_base(mode.rstrip("+"), float(lp[i, j]), float(ref[i, j]))
    return out


BASES = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]
ALL_NAMES = BASES + [b + "+" for b in BASES]


def test_registry_names():
    assert set(KL_PENALTIES.names()) == set(ALL_NAMES)


def random_logprobs(gen, b=5, t=6):
    lp = -3 * torch.rand(b, t, generator=gen, dtype=F64)
    ref = -3 * torch.rand(b, t, generator=gen, dtype=F64)
    lp[0, 0], ref[0, 0] = -1.0, -40.0  # k3 hits its clamps
    lp[0, 1], ref[0, 1] = -40.0, -1.0
    return lp, ref


@pytest.mark.parametrize("mode", ALL_NAMES)
def test_values_match_reference(mode, gen):
    lp, ref = random_logprobs(gen)
    torch.testing.assert_close(kl_penalty(lp, ref, mode), ref_kl(mode, lp, ref), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("base", BASES)
def test_straight_through_value_of_base_gradient_of_k2(base, gen):
    lp, ref = random_logprobs(gen)
    x = lp.clone().requires_grad_()
    plus = kl_penalty(x, ref, base + "+")
    torch.testing.assert_close(plus, kl_penalty(lp, ref, base), rtol=0, atol=0)
    weights = torch.randn(lp.shape, generator=gen, dtype=F64)
    (grad,) = torch.autograd.grad((plus * weights).sum(), x)
    # k2 = 0.5 d^2 -> d k2 / d logp = d
    torch.testing.assert_close(grad, weights * (lp - ref), rtol=1e-12, atol=1e-12)
    y = ref.clone().requires_grad_()
    (grad_ref,) = torch.autograd.grad((kl_penalty(lp, y, base + "+") * weights).sum(), y)
    torch.testing.assert_close(grad_ref, -weights * (lp - ref), rtol=1e-12, atol=1e-12)


def test_base_gradients_differ_from_k2():
    """So the straight-through test above is not vacuous."""
    lp = torch.tensor([[-1.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-2.0]], dtype=F64)
    (g1,) = torch.autograd.grad(kl_penalty(lp, ref, "k1").sum(), lp)
    (g3,) = torch.autograd.grad(kl_penalty(lp, ref, "k3").sum(), lp)
    (g2,) = torch.autograd.grad(kl_penalty(lp, ref, "k2").sum(), lp)
    assert g1.item() == 1.0 and g2.item() == 1.0
    assert g3.item() == pytest.approx(1 - math.exp(-1.0))  # d/dlogp [e^{-d} + d - 1] = 1 - e^{-d}


def test_hand_values():
    lp = torch.tensor([[0.0, -1.0, -1.0, -41.0]])
    ref = torch.tensor([[math.log(0.5), -1.0, -41.0, -1.0]])
    k3 = kl_penalty(lp, ref, "low_var_kl")[0].tolist()
    # x = log 0.5: 0.5 - log 0.5 - 1 = 0.19315; equal -> 0; x = -40 -> clamp(-20): e^-20 + 19 -> clamp 10; x = 40 -> 10
    assert k3 == pytest.approx([0.5 + math.log(2) - 1, 0.0, 10.0, 10.0], abs=1e-6)
    assert kl_penalty(lp, ref, "k1")[0, 0].item() == pytest.approx(math.log(2))
    assert kl_penalty(lp, ref, "k2")[0, 0].item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty(lp, ref, "abs")[0, 2].item() == pytest.approx(40.0)


def test_default_mode_is_low_var_kl(gen):
    lp, ref = random_logprobs(gen)
    assert torch.equal(kl_penalty(lp, ref), kl_penalty(lp, ref, "k3"))


def test_custom_callable_and_straight_through_helper(gen):
    lp, ref = random_logprobs(gen)
    cube = lambda a, b: (a - b) ** 3  # noqa: E731
    assert torch.equal(kl_penalty(lp, ref, cube), (lp - ref) ** 3)
    x = lp.clone().requires_grad_()
    out = kl_penalty(x, ref, straight_through(cube))
    torch.testing.assert_close(out, (lp - ref) ** 3)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], lp - ref)


def test_bad_input(gen):
    lp, ref = random_logprobs(gen)
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(lp, ref[:, :-1])
    with pytest.raises(ValueError, match="unknown KL penalty 'full'"):
        kl_penalty(lp, ref, "full")


# ---------------------------------------------------------------- KL in reward


@pytest.mark.parametrize("mode", ["kl", "low_var_kl", "abs", "mse"])
def test_apply_kl_to_rewards_matches_reference(mode, gen, make_mask):
    lp, ref = random_logprobs(gen)
    mask = make_mask(5, 6, gen, empty_rows=1)
    rewards = torch.randn(5, 6, generator=gen, dtype=F64)
    shaped, metrics = apply_kl_to_rewards(rewards, lp, ref, mask, kl_coef=0.05, mode=mode)
    expected = rewards.clone()
    row_means = []
    for i in range(5):
        total, count = 0.0, 0
        for j in range(6):
            if mask[i, j]:
                k = ref_base(mode, float(lp[i, j]), float(ref[i, j]))
                expected[i, j] -= 0.05 * k
                total, count = total + k, count + 1
        row_means.append(total / (count + 1e-8))  # verl: empty rows count as 0 in the mean over rows
    torch.testing.assert_close(shaped, expected, rtol=1e-12, atol=1e-12)
    assert metrics["kl"].item() == pytest.approx(sum(row_means) / 5, rel=1e-9)
    assert metrics["kl_coef"].item() == pytest.approx(0.05)


def test_apply_kl_to_rewards_default_is_k1_and_no_grad(gen, make_mask):
    lp, ref = random_logprobs(gen)
    mask = make_mask(5, 6, gen)
    rewards = torch.zeros(5, 6, dtype=F64)
    shaped, _ = apply_kl_to_rewards(rewards, lp.requires_grad_(), ref, mask, kl_coef=1.0)
    torch.testing.assert_close(shaped, torch.where(mask, -(lp.detach() - ref), 0.0))
    assert not shaped.requires_grad


def test_apply_kl_to_rewards_bad_shape(gen):
    lp, ref = random_logprobs(gen)
    with pytest.raises(ValueError, match="response_mask"):
        apply_kl_to_rewards(torch.zeros(5, 6), lp, ref, torch.ones(5, 5, dtype=torch.bool), 0.1)


# ---------------------------------------------------------------- controllers


class MutableAdaptive:
    """Reference: the mutable controller of Ziegler et al. / verl, written out."""

    def __init__(self, init, target, horizon):
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, kl, n):
        err = kl / self.target - 1
        err = -0.2 if err < -0.2 else 0.2 if err > 0.2 else err
        self.value *= 1 + err * n / self.horizon


def test_adaptive_controller_matches_reference_and_is_pure():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    ref = MutableAdaptive(0.1, 0.05, 100)
    history = [ctrl]
    for kl, n in [(0.2, 10), (0.01, 7), (0.051, 3), (torch.tensor(0.3), 32)]:
        ctrl = ctrl.update(kl, n)
        ref.update(float(kl), n)
        history.append(ctrl)
        assert ctrl.value == pytest.approx(ref.value, rel=1e-12)
    assert history[0].value == 0.1  # the original is untouched
    assert len({h.value for h in history}) == len(history)


def test_adaptive_controller_hand_value():
    ctrl = AdaptiveKLController(0.1, 0.1, 100).update(current_kl=0.2, n_steps=10)
    # error clip(0.2 / 0.1 - 1) = 0.2 -> 0.1 * (1 + 0.2 * 10 / 100)
    assert ctrl.value == pytest.approx(0.102)


def test_fixed_controller():
    ctrl = FixedKLController(kl_coef=0.001)
    assert ctrl.value == 0.001
    assert ctrl.update(5.0, 100).value == 0.001


def test_controllers_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FixedKLController(0.1).kl_coef = 0.2
    with pytest.raises(dataclasses.FrozenInstanceError):
        AdaptiveKLController(0.1, 0.1, 10).value = 0.2


def test_adaptive_controller_bad_horizon():
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 0.1, 0)
