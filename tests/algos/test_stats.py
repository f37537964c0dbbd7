import math

import pytest
import torch

from rlkit.algos.stats import masked_mean, masked_sum, masked_var, masked_whiten


# ---------------------------------------------------------------- slow float64 references


def ref_sum(x, m):
    return sum(float(x[i, j]) * float(m[i, j]) for i in range(x.shape[0]) for j in range(x.shape[1]) if m[i, j] != 0)


def ref_count(m):
    return sum(float(m[i, j]) for i in range(m.shape[0]) for j in range(m.shape[1]))


def ref_mean(x, m):
    return ref_sum(x, m) / (ref_count(m) + 1e-8)


def ref_var(x, m, unbiased=True):
    mu = ref_mean(x, m)
    n = ref_count(m)
    var = ref_sum((x - mu) ** 2, m) / (n + 1e-8)
    return var * n / (n - 1) if unbiased else var


def ref_row_means(x, m):
    out = []
    for i in range(x.shape[0]):
        s = sum(float(x[i, j]) * float(m[i, j]) for j in range(x.shape[1]) if m[i, j] != 0)
        c = sum(float(m[i, j]) for j in range(x.shape[1]))
        out.append(s / (c + 1e-8))
    return out


# ---------------------------------------------------------------- hand-worked values


def test_hand_values():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 50.0, 60.0]])
    m = torch.tensor([[True, True, False], [True, False, False]])
    assert masked_sum(x, m).item() == 6.0
    assert masked_mean(x, m).item() == pytest.approx(2.0, abs=1e-6)
    assert masked_mean(x, m, dim=-1).tolist() == pytest.approx([1.5, 3.0], abs=1e-6)
    # values 1, 2, 3: unbiased variance 1, biased 2/3
    assert masked_var(x, m).item() == pytest.approx(1.0, abs=1e-6)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(2 / 3, abs=1e-6)
    w = masked_whiten(x, m)
    assert w[m].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    w2 = masked_whiten(x, m, shift_mean=False)
    assert w2[m].tolist() == pytest.approx([1.0, 2.0, 3.0], abs=1e-6)


def test_empty_mask_mean_is_zero_not_nan():
    x = torch.ones(2, 3)
    m = torch.zeros(2, 3, dtype=torch.bool)
    assert masked_mean(x, m).item() == 0.0


# ---------------------------------------------------------------- vs references


@pytest.mark.parametrize("float_mask", [False, True])
def test_against_reference(make_mask, gen, float_mask):
    for trial in range(3):
        x = torch.randn(6, 7, generator=gen, dtype=torch.float64)
        m = make_mask(6, 7, gen, empty_rows=1, holes=trial == 2)
        if float_mask:
            m = m.to(torch.float64) * torch.rand(6, 7, generator=gen, dtype=torch.float64)
        assert masked_sum(x, m).item() == pytest.approx(ref_sum(x, m), rel=1e-12)
        assert masked_mean(x, m).item() == pytest.approx(ref_mean(x, m), rel=1e-12)
        assert masked_mean(x, m, dim=-1).tolist() == pytest.approx(ref_row_means(x, m), rel=1e-12, abs=1e-15)
        assert masked_var(x, m).item() == pytest.approx(ref_var(x, m), rel=1e-10)
        assert masked_var(x, m, unbiased=False).item() == pytest.approx(ref_var(x, m, False), rel=1e-10)
        mu, var = ref_mean(x, m), ref_var(x, m)
        expected = [[(float(x[i, j]) - mu) / math.sqrt(var + 1e-8) for j in range(7)] for i in range(6)]
        assert torch.allclose(masked_whiten(x, m), torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- invariances


def test_padding_never_changes_a_result(make_mask, gen):
    x = torch.randn(5, 6, generator=gen)
    m = make_mask(5, 6, gen)
    y = x.clone()
    y[~m] = torch.tensor([float("nan"), float("inf"), -1e30])[torch.arange(int((~m).sum())) % 3]
    assert torch.equal(masked_sum(x, m), masked_sum(y, m))
    assert torch.equal(masked_mean(x, m, dim=-1), masked_mean(y, m, dim=-1))
    assert torch.equal(masked_var(x, m), masked_var(y, m))
    assert torch.equal(masked_whiten(x, m)[m], masked_whiten(y, m)[m])


def test_bool_and_float_masks_agree(make_mask, gen):
    x = torch.randn(4, 5, generator=gen)
    m = make_mask(4, 5, gen)
    assert torch.allclose(masked_mean(x, m), masked_mean(x, m.float()))
    assert torch.allclose(masked_whiten(x, m), masked_whiten(x, m.float()))


# ---------------------------------------------------------------- bad input


def test_shape_mismatch_names_mask():
    with pytest.raises(ValueError, match="mask"):
        masked_sum(torch.ones(2, 3), torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize("n_valid", [0, 1])
def test_unbiased_var_needs_two_tokens(n_valid):
    m = torch.zeros(2, 3, dtype=torch.bool)
    m.view(-1)[:n_valid] = True
    with pytest.raises(ValueError, match="mask"):
        masked_var(torch.randn(2, 3), m)
    with pytest.raises(ValueError):
        masked_whiten(torch.randn(2, 3), m)
