import math

import pytest
import torch

from rlkit.algos.losses import AGGREGATIONS, POLICY_LOSSES, aggregate, entropy_from_logits, value_loss

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
F64 = torch.float64


# ---------------------------------------------------------------- slow float64 references
# Loops over rows and tokens; per-element torch ops only so autograd gives reference gradients.


def ref_aggregate(loss, mask, mode, num_tokens=None, num_seqs=None, horizon=None):
    b, t = mask.shape
    rows = []
    for i in range(b):
        total = sum((loss[i, j] for j in range(t) if mask[i, j]), torch.zeros((), dtype=F64))
        rows.append((total, int(mask[i].sum())))
    if mode == "token-mean":
        n = num_tokens if num_tokens is not None else max(sum(c for _, c in rows), 1)
        return sum(s for s, _ in rows) / n
    if mode == "seq-mean-token-sum-norm":
        return sum(s for s, _ in rows) / (horizon if horizon is not None else t)
    n = num_seqs if num_seqs is not None else max(sum(1 for _, c in rows if c > 0), 1)
    if mode == "seq-mean-token-sum":
        return sum(s for s, _ in rows) / n
    return sum(s / (c + 1e-8) for s, c in rows) / n


def ref_token_mean(x, mask):
    vals = [x[i, j] for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]
    return sum(float(v) for v in vals) / (len(vals) + 1e-8)


def ref_ppo_clip(logp, old, adv, mask, agg, clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0):
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    b, t = logp.shape
    loss = [[None] * t for _ in range(b)]
    clip, lower, kl = torch.zeros(b, t), torch.zeros(b, t), torch.zeros(b, t, dtype=F64)
    for i in range(b):
        for j in range(t):
            d = torch.clamp(logp[i, j] - old[i, j], -20, 20)
            r = torch.exp(d)
            a = adv[i, j]
            l1, l2 = -a * r, -a * torch.clamp(r, 1 - low, 1 + high)
            l = torch.maximum(l1, l2)
            clip[i, j] = float(l2 > l1)
            if a < 0:
                lower[i, j] = float(l > -a * clip_ratio_c)
                l = torch.minimum(l, -a * clip_ratio_c)
            loss[i][j] = l
            kl[i, j] = -d.detach()
    return ref_aggregate(_stack(loss), mask, agg), {
        "clipfrac": ref_token_mean(clip, mask),
        "clipfrac_lower": ref_token_mean(lower, mask),
        "approx_kl": ref_token_mean(kl, mask),
    }


def _stack(rows):
    return torch.stack([torch.stack(r) for r in rows])


def ref_gspo(logp, old, adv, mask, agg, clip_ratio=0.2):
    b, t = logp.shape
    loss = [[None] * t for _ in range(b)]
    clip = torch.zeros(b, t)
    for i in range(b):
        n = max(int(mask[i].sum()), 1)
        seq = sum(float(logp[i, j].detach() - old[i, j]) for j in range(t) if mask[i, j]) / n
        for j in range(t):
            # value exp(seq); gradient d/dlogp_ij = exp(seq) (token-level factor logp - sg[logp])
            log_s = min(seq, 10.0) + logp[i, j] - logp[i, j].detach()
            r = torch.exp(log_s) if seq <= 10.0 else torch.exp(torch.tensor(10.0, dtype=F64)) + 0 * logp[i, j]
            a = adv[i, j]
            l1, l2 = -a * r, -a * torch.clamp(r, 1 - clip_ratio, 1 + clip_ratio)
            clip[i, j] = float(l2 > l1)
            loss[i][j] = torch.maximum(l1, l2)
    kl = -(logp - old).detach()
    return ref_aggregate(_stack(loss), mask, agg), {"clipfrac": ref_token_mean(clip, mask), "approx_kl": ref_token_mean(kl, mask)}


def ref_cispo(logp, old, adv, mask, agg, clip_ratio=0.2):
    b, t = logp.shape
    loss = [[None] * t for _ in range(b)]
    clip = torch.zeros(b, t)
    for i in range(b):
        for j in range(t):
            r = math.exp(max(min(float((logp[i, j] - old[i, j]).detach()), 20), -20))
            w = min(max(r, 1 - clip_ratio), 1 + clip_ratio)
            clip[i, j] = float(w != r)
            loss[i][j] = -w * adv[i, j] * logp[i, j]
    return ref_aggregate(_stack(loss), mask, agg), {"clipfrac": ref_token_mean(clip, mask)}


def ref_gpg(logp, old, adv, mask, agg):
    b, t = logp.shape
    loss = [[-adv[i, j] * logp[i, j] for j in range(t)] for i in range(b)]
    return ref_aggregate(_stack(loss), mask, agg), {}


def ref_gmpo(logp, old, adv, mask, agg, clip_ratio=0.2, num_seqs=None):
    b, t = logp.shape
    per_row = []
    clip_hi, clip_lo = torch.zeros(b, t), torch.zeros(b, t)
    for i in range(b):
        n = int(mask[i].sum())
        total, a_sum = torch.zeros((), dtype=F64), 0.0
        for j in range(t):
            d = logp[i, j] - old[i, j]
            a = float(adv[i, j])
            # clip in log space, only on the side that would increase the objective
            if a > 0:
                dc = torch.minimum(d, torch.tensor(clip_ratio, dtype=F64))
            elif a < 0:
                dc = torch.maximum(d, torch.tensor(-clip_ratio, dtype=F64))
            else:
                dc = 0 * d
            out_of_range = abs(float(d.detach())) > clip_ratio
            clip_hi[i, j] = float(out_of_range and a > 0)
            clip_lo[i, j] = float(out_of_range and a < 0)
            if mask[i, j]:
                total = total + dc
                a_sum += a
        per_row.append(-(a_sum / (n + 1e-8)) * torch.exp(total / (n + 1e-8)))
    # rows with a valid token, as every seq-mean count (verl's torch.mean also counts empty rows)
    n_seqs = num_seqs if num_seqs is not None else max(int((mask.sum(-1) > 0).sum()), 1)
    return sum(per_row) / n_seqs, {"clipfrac": ref_token_mean(clip_hi, mask), "clipfrac_lower": ref_token_mean(clip_lo, mask)}


def ref_clip_cov(logp, old, adv, mask, agg, seed, clip_ratio=0.2, clip_cov_ratio=0.2, lb=0.0, ub=5.0):
    b, t = logp.shape
    valid = [(i, j) for i in range(b) for j in range(t) if mask[i, j]]
    mean_a = sum(float(adv[i, j]) for i, j in valid) / (len(valid) + 1e-8)
    mean_l = sum(float(logp[i, j].detach()) for i, j in valid) / (len(valid) + 1e-8)
    candidates = []
    for i, j in valid:  # row-major order, as torch.nonzero
        r = math.exp(float(logp[i, j].detach() - old[i, j]))
        a = float(adv[i, j])
        clipped = -a * min(max(r, 1 - clip_ratio), 1 + clip_ratio) > -a * r
        cov = (a - mean_a) * (float(logp[i, j].detach()) - mean_l)
        if not clipped and lb < cov < ub:
            candidates.append((i, j))
    k = max(int(clip_cov_ratio * len(valid)), 1)
    perm = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed)).tolist() if candidates else []
    dropped = {candidates[p] for p in perm[:k]}
    loss = [[None] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            r = torch.exp(logp[i, j] - old[i, j])
            a = adv[i, j]
            l = torch.maximum(-a * r, -a * torch.clamp(r, 1 - clip_ratio, 1 + clip_ratio))
            loss[i][j] = 0 * l if (i, j) in dropped else l
    return ref_aggregate(_stack(loss), mask, agg), {"clipfrac": len(dropped) / (len(valid) + 1e-8)}


def ref_kl_cov(logp, old, adv, mask, agg, kl_cov_ratio=0.2, ppo_kl_coef=0.1):
    b, t = logp.shape
    valid = [(i, j) for i in range(b) for j in range(t) if mask[i, j]]
    mean_a = sum(float(adv[i, j]) for i, j in valid) / len(valid)
    mean_l = sum(float(logp[i, j].detach()) for i, j in valid) / len(valid)
    cov = {(i, j): (float(adv[i, j]) - mean_a) * (float(logp[i, j].detach()) - mean_l) for i, j in valid}
    k = max(1, int(len(valid) * kl_cov_ratio))
    top = set(sorted(valid, key=lambda p: -cov[p])[:k])
    loss = [[None] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            d = logp[i, j] - old[i, j]
            l = -adv[i, j] * torch.exp(d)
            loss[i][j] = l + ppo_kl_coef * d.abs() if (i, j) in top else l
    abs_kl = torch.tensor([[abs(float(logp[i, j].detach() - old[i, j])) for j in range(t)] for i in range(b)])
    return ref_aggregate(_stack(loss), mask, agg), {"clipfrac": len(top) / (len(valid) + 1e-8), "abs_kl": ref_token_mean(abs_kl, mask)}


REFERENCES = {
    "ppo_clip": ref_ppo_clip,
    "vanilla": ref_ppo_clip,
    "gspo": ref_gspo,
    "cispo": ref_cispo,
    "gpg": ref_gpg,
    "gmpo": ref_gmpo,
    "geo_mean": ref_gmpo,
    "kl_cov": ref_kl_cov,
}
HYPER = {"kl_cov": {"kl_cov_ratio": 0.2}}


def test_every_registered_name_is_tested():
    assert set(POLICY_LOSSES.names()) == set(REFERENCES) | {"clip_cov"}
    assert AGGREGATIONS.names() == sorted(MODES)


def random_inputs(gen, make_mask, b=6, t=7, empty_rows=1, holes=False):
    mask = make_mask(b, t, gen, empty_rows=empty_rows, holes=holes)
    old = -1 - torch.rand(b, t, generator=gen, dtype=F64)
    logp = old + 0.3 * torch.randn(b, t, generator=gen, dtype=F64)
    adv = torch.randn(b, t, generator=gen, dtype=F64)
    adv[0] = 0.0  # exact zero advantages hit sign(0) / A < 0 branches
    return logp, old, adv, mask


# ---------------------------------------------------------------- aggregation


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_reference(mode, gen, make_mask):
    for holes in (False, True):
        loss = torch.randn(6, 7, generator=gen, dtype=F64)
        mask = make_mask(6, 7, gen, empty_rows=2, holes=holes)
        torch.testing.assert_close(aggregate(loss, mask, mode), ref_aggregate(loss, mask, mode))
        torch.testing.assert_close(
            aggregate(loss, mask, mode, num_tokens=50, num_seqs=9, horizon=11),
            ref_aggregate(loss, mask, mode, num_tokens=50, num_seqs=9, horizon=11),
        )


def test_aggregate_hand_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [99.0, 99.0, 99.0]])
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)  # empty row not counted
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / 3)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", horizon=5).item() == pytest.approx(10 / 5)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_all_padding_is_zero(mode):
    loss = torch.randn(2, 3)
    assert aggregate(loss, torch.zeros(2, 3, dtype=torch.bool), mode).item() == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_sum_to_full_batch(mode, gen, make_mask):
    """Split rows into micro-batches (each trimmed to its own width), pass the mini-batch's
    normalisers, and the micro-batch losses sum to the full-batch loss."""
    loss = torch.randn(9, 8, generator=gen, dtype=F64)
    mask = make_mask(9, 8, gen, empty_rows=2)
    full = aggregate(loss, mask, mode)
    num_tokens = mask.sum()
    num_seqs = (mask.sum(-1) > 0).sum()
    total = torch.zeros((), dtype=F64)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 7), slice(7, 9)):
        width = max(int(mask[rows].sum(-1).max()), 1)
        total = total + aggregate(
            loss[rows, :width], mask[rows, :width], mode, num_tokens=num_tokens, num_seqs=num_seqs, horizon=mask.shape[-1]
        )
    torch.testing.assert_close(total, full)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_ignores_padding_values(mode, gen, make_mask):
    loss = torch.randn(5, 6, generator=gen, dtype=F64)
    mask = make_mask(5, 6, gen, empty_rows=1, holes=True)
    noisy = loss.masked_fill(~mask, float("nan"))
    assert torch.equal(aggregate(loss, mask, mode), aggregate(noisy, mask, mode))


def test_aggregate_bad_input():
    with pytest.raises(ValueError, match="mask"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="unknown loss aggregation 'token_mean'"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), "token_mean")
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), num_tokens=0)


def test_aggregate_accepts_a_callable():
    def max_mode(loss, mask, *, num_tokens=None, num_seqs=None, horizon=None):
        return loss.masked_fill(~mask, -1e9).max()

    loss = torch.tensor([[1.0, 5.0], [3.0, 9.0]])
    assert aggregate(loss, torch.tensor([[True, True], [True, False]]), max_mode).item() == 5.0


# ---------------------------------------------------------------- policy losses vs references


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_policy_loss_matches_reference(name, agg, gen, make_mask):
    logp, old, adv, mask = random_inputs(gen, make_mask)
    hyper = HYPER.get(name, {})
    x = logp.clone().requires_grad_()
    loss, metrics = POLICY_LOSSES.get(name)(x, old, adv, mask, agg=agg, **hyper)
    (grad,) = torch.autograd.grad(loss, x)
    y = logp.clone().requires_grad_()
    ref_loss, ref_metrics = REFERENCES[name](y, old, adv, mask, agg, **hyper)
    (ref_grad,) = torch.autograd.grad(ref_loss, y)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert {"clipfrac", "approx_kl"} <= set(metrics)
    for key, value in ref_metrics.items():
        assert metrics[key].item() == pytest.approx(float(value), abs=1e-6), key
    assert metrics["approx_kl"].item() == pytest.approx(ref_token_mean(-(logp - old), mask), abs=1e-9)
    assert all(not m.requires_grad and m.dim() == 0 for m in metrics.values())


def test_ppo_clip_asymmetric_and_dual_clip_against_reference(gen, make_mask):
    logp, old, adv, mask = random_inputs(gen, make_mask)
    logp = old + 1.5 * torch.randn(old.shape, generator=gen, dtype=F64)  # wide ratios: dual clip active
    hyper = dict(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=2.0)
    x = logp.clone().requires_grad_()
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(x, old, adv, mask, **hyper)
    y = logp.clone().requires_grad_()
    ref_loss, ref_metrics = ref_ppo_clip(y, old, adv, mask, "token-mean", **hyper)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(torch.autograd.grad(loss, x)[0], torch.autograd.grad(ref_loss, y)[0])
    assert metrics["clipfrac_lower"].item() == pytest.approx(ref_metrics["clipfrac_lower"], abs=1e-6)
    assert metrics["clipfrac_lower"].item() > 0


def test_gspo_with_paper_clip_range(gen, make_mask):
    logp, old, adv, mask = random_inputs(gen, make_mask)
    logp = old + torch.randn(old.shape, generator=gen, dtype=F64)
    x = logp.clone().requires_grad_()
    loss, metrics = POLICY_LOSSES.get("gspo")(x, old, adv, mask, clip_ratio=0.05)
    y = logp.clone().requires_grad_()
    ref_loss, ref_metrics = ref_gspo(y, old, adv, mask, "seq-mean-token-mean", clip_ratio=0.05)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(torch.autograd.grad(loss, x)[0], torch.autograd.grad(ref_loss, y)[0])
    assert metrics["clipfrac"].item() == pytest.approx(ref_metrics["clipfrac"], abs=1e-6)
    assert 0 < metrics["clipfrac"].item() < 1
    # default aggregation is seq-mean-token-mean, also for agg=None
    assert POLICY_LOSSES.get("gspo")(logp, old, adv, mask, agg=None)[0].item() == pytest.approx(
        POLICY_LOSSES.get("gspo")(logp, old, adv, mask)[0].item()
    )


def test_gspo_sequence_ratio_hand_values():
    old = torch.zeros(2, 2, dtype=F64)
    logp = torch.tensor([[12.0, 12.0], [0.1, 0.3]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[True, True], [True, True]])
    loss, _ = POLICY_LOSSES.get("gspo")(logp, old, adv, mask, agg="seq-mean-token-mean")
    # row 0: log s = 12 clamped to 10, A < 0 so the unclipped branch wins: loss e^10, no gradient
    # row 1: s = exp(0.2) = 1.2214 > 1.2 and A > 0: clipped to 1.2, no gradient
    assert loss.item() == pytest.approx((math.exp(10) - 1.2) / 2)
    assert torch.autograd.grad(loss, logp)[0].abs().max().item() == 0.0
    loss, _ = POLICY_LOSSES.get("gspo")(logp, old, adv, mask, agg="seq-mean-token-mean", clip_ratio=0.3)
    # row 1 unclipped: value -exp(0.2); d/dlogp_t = -A * s / (2 tokens * 2 rows)
    assert loss.item() == pytest.approx((math.exp(10) - math.exp(0.2)) / 2)
    grad = torch.autograd.grad(loss, logp)[0]
    assert grad[1].tolist() == pytest.approx([-math.exp(0.2) / 4] * 2)


def test_cispo_gradient_flows_through_clipped_tokens(gen, make_mask):
    logp, old, adv, mask = random_inputs(gen, make_mask)
    logp = old + 2.0  # every ratio far above 1 + eps: all clipped
    x = logp.clone().requires_grad_()
    loss, metrics = POLICY_LOSSES.get("cispo")(x, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, x)
    n = mask.sum()
    torch.testing.assert_close(grad, torch.where(mask, -1.2 * adv / n, 0.0))
    assert metrics["clipfrac"].item() == pytest.approx(1.0)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_clip_cov_matches_reference_with_generator(agg, gen, make_mask):
    logp, old, adv, mask = random_inputs(gen, make_mask, b=8, t=9)
    hyper = dict(clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=5.0)
    for seed in (0, 1, 2):
        x = logp.clone().requires_grad_()
        loss, metrics = POLICY_LOSSES.get("clip_cov")(x, old, adv, mask, agg=agg, generator=torch.Generator().manual_seed(seed), **hyper)
        y = logp.clone().requires_grad_()
        ref_loss, ref_metrics = ref_clip_cov(y, old, adv, mask, agg, seed)
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(torch.autograd.grad(loss, x)[0], torch.autograd.grad(ref_loss, y)[0])
        assert metrics["clipfrac"].item() == pytest.approx(ref_metrics["clipfrac"], abs=1e-6)
        assert metrics["clipfrac"].item() > 0


def test_clip_cov_reproducible_and_random(gen, make_mask):
    logp, old, adv, mask = random_inputs(gen, make_mask, b=8, t=9)
    hyper = dict(clip_cov_ratio=0.1, clip_cov_lb=0.0)
    losses = [
        POLICY_LOSSES.get("clip_cov")(logp, old, adv, mask, generator=torch.Generator().manual_seed(s), **hyper)[0].item()
        for s in (7, 7, 8, 9, 10)
    ]
    assert losses[0] == losses[1]
    assert len(set(losses[1:])) > 1  # different seeds drop different tokens


def test_clip_cov_default_drops_nothing_on_small_covariances(gen, make_mask):
    """With verl's defaults (lb=1, ub=5) and small covariances no token is dropped: equals PPO
    without dual clip and without the log-ratio clamp."""
    logp, old, adv, mask = random_inputs(gen, make_mask)
    adv = adv * 0.1
    loss, metrics = POLICY_LOSSES.get("clip_cov")(logp, old, adv, mask)
    ref, _ = ref_clip_cov(logp, old, adv, mask, "token-mean", seed=0, clip_cov_ratio=0.0002, lb=1.0, ub=5.0)
    torch.testing.assert_close(loss, ref)
    assert metrics["clipfrac"].item() == 0.0


# ---------------------------------------------------------------- hand-worked values


def test_ppo_clip_hand_values():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 4.0]]))
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(logp, old, adv, mask)
    # per token: max(-1.5, -1.2) = -1.2 | max(0.5, 0.8) = 0.8 | max(-2.2, -2.2) = -2.2 | min(max(4, 1.2), 3) = 3
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2 + 3.0) / 4, abs=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(2 / 4)
    assert metrics["clipfrac_lower"].item() == pytest.approx(1 / 4)


def test_gmpo_hand_value():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.1, 0.5]])
    adv = torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = POLICY_LOSSES.get("gmpo")(logp, old, adv, mask)
    # log ratios clipped above at 0.2 for A > 0: exp((0.1 + 0.2) / 2)
    assert loss.item() == pytest.approx(-math.exp(0.15), abs=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)


def test_value_loss_hand_values():
    values = torch.tensor([[1.0, 0.0]])
    old_values = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[0.0, 2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = value_loss(values, old_values, returns, mask, cliprange_value=0.5)
    # token 0: max((1-0)^2, (0.5-0)^2) = 1; token 1: max(4, 4) = 4; 0.5 * mean = 1.25
    assert loss.item() == pytest.approx(1.25)
    assert metrics["vf_clipfrac"].item() == 0.0
    loss, metrics = value_loss(torch.tensor([[0.2, 0.0]]), old_values, torch.tensor([[1.0, 0.0]]), mask, cliprange_value=0.1)
    # token 0: max((0.2-1)^2, (0.1-1)^2) = 0.81 (clipped is worse); token 1: 0
    assert loss.item() == pytest.approx(0.5 * 0.81 / 2)
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.5)


def test_value_loss_without_clipping():
    # cliprange_value=None (PPO(value_clip=None)) failed with "Tensor + NoneType"
    values, old, returns = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 5.0]]), torch.tensor([[0.0, 2.0]])
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 2, dtype=torch.bool), cliprange_value=None)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 4.0) / 2)
    assert metrics["vf_clipfrac"].item() == 0.0


def test_value_loss_against_reference(gen, make_mask):
    for agg in MODES:
        v = torch.randn(6, 7, generator=gen, dtype=F64)
        old = v + 0.8 * torch.randn(6, 7, generator=gen, dtype=F64)
        ret = torch.randn(6, 7, generator=gen, dtype=F64)
        mask = make_mask(6, 7, gen, empty_rows=1)
        x = v.clone().requires_grad_()
        loss, metrics = value_loss(x, old, ret, mask, agg=agg)
        rows, clip = [], torch.zeros(6, 7)
        y = v.clone().requires_grad_()
        for i in range(6):
            row = []
            for j in range(7):
                vc = torch.clamp(y[i, j], float(old[i, j]) - 0.5, float(old[i, j]) + 0.5)
                l1, l2 = (y[i, j] - ret[i, j]) ** 2, (vc - ret[i, j]) ** 2
                clip[i, j] = float(l2 > l1)
                row.append(torch.maximum(l1, l2))
            rows.append(row)
        ref = 0.5 * ref_aggregate(_stack(rows), mask, agg)
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(torch.autograd.grad(loss, x)[0], torch.autograd.grad(ref, y)[0])
        assert metrics["vf_clipfrac"].item() == pytest.approx(ref_token_mean(clip, mask), abs=1e-6)


def test_entropy_against_reference(gen):
    logits = 3 * torch.randn(3, 4, 11, generator=gen, dtype=F64)
    logits[0, 0] = torch.tensor([1000.0] + [0.0] * 10, dtype=F64)  # stable for huge logits
    ent = entropy_from_logits(logits)
    assert ent.shape == (3, 4)
    for i in range(3):
        for j in range(4):
            z = [float(v) for v in logits[i, j]]
            top = max(z)
            p = [math.exp(v - top) for v in z]
            total = sum(p)
            expected = -sum(q / total * math.log(q / total) for q in p if q > 0)
            assert ent[i, j].item() == pytest.approx(expected, abs=1e-9)
    uniform = entropy_from_logits(torch.zeros(5))
    assert uniform.item() == pytest.approx(math.log(5))


# ---------------------------------------------------------------- invariances


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES.names()))
def test_policy_loss_ignores_padding_values(name, gen, make_mask):
    logp, old, adv, mask = random_inputs(gen, make_mask, holes=True)
    hyper = {"generator": torch.Generator().manual_seed(3), "clip_cov_lb": 0.0, "clip_cov_ratio": 0.2} if name == "clip_cov" else {}
    loss, metrics = POLICY_LOSSES.get(name)(logp, old, adv, mask, **hyper)
    pad = ~mask
    noise = lambda: 5 * torch.randn(mask.shape, generator=gen, dtype=F64)  # noqa: E731
    if name == "clip_cov":
        hyper["generator"] = torch.Generator().manual_seed(3)
    loss2, metrics2 = POLICY_LOSSES.get(name)(
        torch.where(pad, noise(), logp), torch.where(pad, noise(), old), torch.where(pad, noise(), adv), mask, **hyper
    )
    torch.testing.assert_close(loss2, loss, rtol=1e-12, atol=1e-12)
    for key in metrics:
        torch.testing.assert_close(metrics2[key], metrics[key], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "gpg", "gmpo"])
@pytest.mark.parametrize("agg", MODES)
def test_policy_loss_micro_batches_sum_to_full_batch(name, agg, gen, make_mask):
    logp, old, adv, mask = random_inputs(gen, make_mask, b=8, t=7, empty_rows=1)
    fn = POLICY_LOSSES.get(name)
    x = logp.clone().requires_grad_()
    full, _ = fn(x, old, adv, mask, agg=agg)
    (full_grad,) = torch.autograd.grad(full, x)
    num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()  # gmpo's too: the count update passes
    y = logp.clone().requires_grad_()
    total = sum(
        fn(y[rows], old[rows], adv[rows], mask[rows], agg=agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=7)[0]
        for rows in (slice(0, 3), slice(3, 4), slice(4, 8))
    )
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(torch.autograd.grad(total, y)[0], full_grad)


def test_on_policy_ppo_gradient_is_policy_gradient(gen, make_mask):
    """At ratio 1, PPO's gradient is the plain policy gradient -A / n on valid tokens."""
    _, old, adv, mask = random_inputs(gen, make_mask)
    x = old.clone().requires_grad_()
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(x, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(grad, torch.where(mask, -adv / mask.sum(), 0.0))
    assert metrics["clipfrac"].item() == 0.0 and metrics["approx_kl"].item() == 0.0


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES.names()))
@pytest.mark.parametrize("field", ["old_logprobs", "advantages", "response_mask"])
def test_policy_loss_shape_mismatch(name, field, gen, make_mask):
    inputs = dict(zip(["logprobs", "old_logprobs", "advantages", "response_mask"], random_inputs(gen, make_mask)))
    inputs[field] = inputs[field][:, :-1]
    with pytest.raises(ValueError, match=field):
        POLICY_LOSSES.get(name)(*inputs.values())


def test_bad_hyperparameters(gen, make_mask):
    args = random_inputs(gen, make_mask)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        POLICY_LOSSES.get("ppo_clip")(*args, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        POLICY_LOSSES.get("clip_cov")(*args, clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        POLICY_LOSSES.get("kl_cov")(*args, kl_cov_ratio=0.0)
    with pytest.raises(TypeError):
        POLICY_LOSSES.get("ppo_clip")(*args, cliprange=0.2)  # typo'd hyper-parameters are not swallowed
    with pytest.raises(ValueError, match="returns"):
        value_loss(args[0], args[1], args[2][:, :-1], args[3])


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "gmpo", "clip_cov"])
def test_clip_ratios_must_be_finite_and_not_negative(name, gen, make_mask):
    """clip_ratio=-0.2, clip_ratio_high=-0.5 (an inverted range: every token clipped) and
    clip_ratio=nan (no clipping at all) were accepted. A low bound above 1 stays allowed (CISPO
    sets no lower bound that way)."""
    args = random_inputs(gen, make_mask)
    fn = POLICY_LOSSES.get(name)
    for field, bad in (("clip_ratio", -0.2), ("clip_ratio", float("nan")), ("clip_ratio_low", -0.1),
                       ("clip_ratio_high", -0.5), ("clip_ratio_high", float("inf")), ("clip_ratio", "0.2")):
        with pytest.raises(ValueError, match=rf"{name}: {field} must be a finite number >= 0 \(.*\), got {bad!r}"):
            fn(*args, **{field: bad})
    loss, _ = fn(*args, clip_ratio_low=1.5, clip_ratio_high=0.0)
    assert torch.isfinite(loss)


def test_cispo_low_bound_above_one_clips_only_from_above():
    logp = torch.tensor([[-3.0, 0.0]], dtype=F64)
    old = torch.zeros(1, 2, dtype=F64)
    adv = torch.ones(1, 2, dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = POLICY_LOSSES.get("cispo")(logp, old, adv, mask, clip_ratio_low=5.0, clip_ratio_high=0.2)
    # ratios exp(-3) and 1, both inside [1 - 5, 1.2]: L = -(exp(-3) * -3 + 1 * 0) / 2
    assert loss.item() == pytest.approx(3 * math.exp(-3) / 2, abs=1e-12)


def test_value_loss_cliprange_must_be_positive_and_finite():
    v, vo, ret = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    for bad in (-0.5, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"value_loss: cliprange_value must be a finite number > 0, or None \(no clipping\), got {bad!r}"):
            value_loss(v, vo, ret, mask, cliprange_value=bad)
    # unclipped: 0.5 * mean((0 - 1)^2, (1 - 1)^2)
    assert value_loss(v, vo, ret, mask, cliprange_value=None)[0].item() == pytest.approx(0.25)


def test_entropy_of_logits_with_minus_inf_is_finite_with_a_finite_gradient():
    """A -inf logit (a masked-out token) made 0 * -inf = NaN in the value and the gradient."""
    z = torch.tensor([[0.0, 1.0, float("-inf")], [2.0, float("-inf"), float("-inf")]], dtype=F64, requires_grad=True)
    ent = entropy_from_logits(z)
    p = torch.softmax(torch.tensor([0.0, 1.0], dtype=F64), -1)
    assert ent[0].item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-12)
    assert ent[1].item() == pytest.approx(0.0, abs=1e-12)  # one possible token
    ent.sum().backward()
    assert torch.isfinite(z.grad).all()
    # the finite logits' gradient equals the one without the -inf entry
    y = torch.tensor([0.0, 1.0], dtype=F64, requires_grad=True)
    entropy_from_logits(y).backward()
    torch.testing.assert_close(z.grad[0, :2], y.grad)
    assert z.grad[0, 2] == 0 and z.grad[1].abs().sum() == 0


def test_gmpo_divides_by_the_rows_with_a_valid_token():
    """A direct call divided by every row (empty ones included) while update passed the rows
    with a valid token: the same batch gave two losses."""
    logp = torch.tensor([[0.1, 0.5], [0.0, 0.0]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [False, False]])
    loss, _ = POLICY_LOSSES.get("gmpo")(logp, old, adv, mask)
    assert loss.item() == pytest.approx(-math.exp(0.15), abs=1e-6)  # / 1 row, not / 2
    same, _ = POLICY_LOSSES.get("gmpo")(logp, old, adv, mask, num_seqs=1)
    assert same.item() == loss.item()
