import inspect
import math
import statistics
from collections import defaultdict

import pytest
import torch

from rlkit.algos.advantages import ADVANTAGE_ESTIMATORS

EPS = 1e-6


def call(name, **available):
    """Call an estimator the way the transform does: keyword args, only those it names."""
    fn = ADVANTAGE_ESTIMATORS.get(name)
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in available.items() if k in params})


# ---------------------------------------------------------------- slow float64 references
# Written from verl's loop implementations (core_algos.py), one row / token / group at a time.


def scores_of(r, m):
    return [sum(float(r[i, j]) for j in range(r.shape[1]) if m[i, j]) for i in range(r.shape[0])]


def groups_of(group):
    members = defaultdict(list)
    for i, g in enumerate(group.tolist()):
        members[g].append(i)
    return members


def broadcast(adv, m):
    return [[adv[i] if m[i, j] else 0.0 for j in range(m.shape[1])] for i in range(m.shape[0])]


def whiten_list(vals, m):
    flat = [vals[i][j] for i in range(len(vals)) for j in range(len(vals[0])) if m[i, j]]
    n = len(flat)
    mu = sum(flat) / (n + 1e-8)
    var = sum((v - mu) ** 2 for v in flat) / (n + 1e-8) * n / (n - 1)
    return [[(vals[i][j] - mu) / math.sqrt(var + 1e-8) if m[i, j] else 0.0 for j in range(len(vals[0]))] for i in range(len(vals))]


def ref_grpo(r, m, group, norm_by_std=True, epsilon=EPS):
    s = scores_of(r, m)
    out = [0.0] * len(s)
    for rows in groups_of(group).values():
        vals = [s[i] for i in rows]
        mean, std = (0.0, 1.0) if len(vals) == 1 else (statistics.fmean(vals), statistics.stdev(vals))
        for i in rows:
            out[i] = (s[i] - mean) / (std + epsilon) if norm_by_std else s[i] - mean
    a = broadcast(out, m)
    return a, a


def ref_rloo(r, m, group):
    s = scores_of(r, m)
    out = list(s)
    for rows in groups_of(group).values():
        n = len(rows)
        if n > 1:
            for i in rows:
                out[i] = s[i] - sum(s[j] for j in rows if j != i) / (n - 1)
    a = broadcast(out, m)
    return a, a


def ref_opo(r, m, group):
    s = scores_of(r, m)
    lengths = [int(m[i].sum()) for i in range(len(s))]
    out = list(s)
    for rows in groups_of(group).values():
        if len(rows) > 1:
            baseline = sum(lengths[i] * s[i] for i in rows) / sum(lengths[i] for i in rows)
            for i in rows:
                out[i] = s[i] - baseline
    a = broadcast(out, m)
    return a, a


def ref_gpg(r, m, group, f_norm=1.0):
    s = scores_of(r, m)
    alpha = len(s) / max(sum(1 for v in s if v != 0), 1)
    out = [0.0] * len(s)
    for rows in groups_of(group).values():
        mean = 0.0 if len(rows) == 1 else statistics.fmean(s[i] for i in rows)
        for i in rows:
            out[i] = alpha * (s[i] - mean) / f_norm
    a = broadcast(out, m)
    return a, a


def ref_rpp_baseline(r, m, group):
    s = scores_of(r, m)
    out = [0.0] * len(s)
    for rows in groups_of(group).values():
        mean = 0.0 if len(rows) == 1 else statistics.fmean(s[i] for i in rows)
        for i in rows:
            out[i] = s[i] - mean
    a = whiten_list(broadcast(out, m), m)
    return a, a


def ref_rpp(r, m, gamma=1.0):
    b, t = r.shape
    returns = [[0.0] * t for _ in range(b)]
    for i in range(b):
        running = 0.0
        for j in reversed(range(t)):
            running = (float(r[i, j]) if m[i, j] else 0.0) + gamma * running
            returns[i][j] = running if m[i, j] else 0.0
            if not m[i, j]:
                running = 0.0
    return whiten_list(returns, m), returns


def ref_remax(r, m, baselines):
    b, t = r.shape
    adv = [[0.0] * t for _ in range(b)]
    ret = [[0.0] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            if m[i, j]:
                ret[i][j] = sum(float(r[i, k]) for k in range(j, t) if m[i, k])
                adv[i][j] = ret[i][j] - float(baselines[i])
    return adv, ret


def ref_gae(r, m, v, gamma=1.0, lam=1.0):
    b, t = r.shape
    adv = [[0.0] * t for _ in range(b)]
    ret = [[0.0] * t for _ in range(b)]
    for i in range(b):
        next_value, next_adv = 0.0, 0.0
        for j in reversed(range(t)):
            if not m[i, j]:
                continue  # observation / padding tokens are skipped entirely
            delta = float(r[i, j]) + gamma * next_value - float(v[i, j])
            next_adv = delta + gamma * lam * next_adv
            next_value = float(v[i, j])
            adv[i][j] = next_adv
            ret[i][j] = next_adv + float(v[i, j])
    return whiten_list(adv, m), ret


REFERENCES = {
    "grpo": lambda d, **h: ref_grpo(d["token_rewards"], d["response_mask"], d["group"], **h),
    "drgrpo": lambda d, **h: ref_grpo(d["token_rewards"], d["response_mask"], d["group"], norm_by_std=False, **h),
    "rloo": lambda d: ref_rloo(d["token_rewards"], d["response_mask"], d["group"]),
    "opo": lambda d: ref_opo(d["token_rewards"], d["response_mask"], d["group"]),
    "gpg": lambda d: ref_gpg(d["token_rewards"], d["response_mask"], d["group"]),
    "reinforce++": lambda d: ref_rpp(d["token_rewards"], d["response_mask"]),
    "reinforce++_baseline": lambda d: ref_rpp_baseline(d["token_rewards"], d["response_mask"], d["group"]),
    "remax": lambda d: ref_remax(d["token_rewards"], d["response_mask"], d["reward_baselines"]),
    "gae": lambda d: ref_gae(d["token_rewards"], d["response_mask"], d["values"]),
}
NAMES = sorted(REFERENCES)


def test_every_registered_name_is_tested():
    aliases = {"reinforce_plus_plus", "reinforce_plus_plus_baseline"}
    assert set(ADVANTAGE_ESTIMATORS.names()) == set(NAMES) | aliases


def random_batch(gen, make_mask, to_tokens, b=10, t=6, holes=False, dtype=torch.float64):
    mask = make_mask(b, t, gen, holes=holes)
    # binary-ish and continuous rewards, some zero, groups of sizes 3, 1, 4, 2 with arbitrary ids
    scores = torch.where(torch.rand(b, generator=gen) < 0.3, 0.0, torch.randn(b, generator=gen, dtype=torch.float64))
    ids = torch.tensor([17, 17, -3, 17, 900, 900, 900, 900, 5, 5])[:b]
    perm = torch.randperm(b, generator=gen)
    return {
        "token_rewards": to_tokens(scores, mask).to(dtype),
        "response_mask": mask,
        "group": ids[perm],
        "values": torch.randn(b, t, generator=gen, dtype=torch.float64).to(dtype),
        "reward_baselines": torch.randn(b, generator=gen, dtype=torch.float64).to(dtype),
    }


# ---------------------------------------------------------------- vs references


@pytest.mark.parametrize(
    "name, holes", [(n, False) for n in NAMES] + [(n, True) for n in ("gae", "reinforce++", "remax")]
)
def test_matches_loop_reference(name, holes, gen, make_mask, to_tokens):
    """Holes in the mask (multi-turn observation tokens) matter for the token-level estimators."""
    for _ in range(3):
        data = random_batch(gen, make_mask, to_tokens, holes=holes)
        adv, ret = call(name, **data)
        ref_adv, ref_ret = REFERENCES[name](data)
        assert adv.dtype == torch.float64 and adv.shape == data["response_mask"].shape
        torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_float32_in_float32_out(name, gen, make_mask, to_tokens):
    data = random_batch(gen, make_mask, to_tokens, dtype=torch.float32)
    adv, ret = call(name, **data)
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    ref_adv, ref_ret = REFERENCES[name](data)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float32), rtol=1e-5, atol=1e-5)


def test_gae_hyperparameters_against_reference(gen, make_mask, to_tokens):
    data = random_batch(gen, make_mask, to_tokens, holes=True)
    data["token_rewards"] = torch.randn(data["token_rewards"].shape, generator=gen, dtype=torch.float64)
    adv, ret = call("gae", **data, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = ref_gae(data["token_rewards"], data["response_mask"], data["values"], 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64))
    adv, ret = call("reinforce++", **data, gamma=0.7)
    ref_adv, ref_ret = ref_rpp(data["token_rewards"], data["response_mask"], 0.7)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64))


# ---------------------------------------------------------------- hand-worked values


def one_token(scores, group):
    r = torch.tensor(scores, dtype=torch.float64)[:, None]
    return {"token_rewards": r, "response_mask": torch.ones_like(r, dtype=torch.bool), "group": torch.tensor(group)}


def test_grpo_pair():
    adv, ret = call("grpo", **one_token([1.0, 0.0], [0, 0]))
    # mean 0.5, unbiased std sqrt(0.5) = 0.70711 -> +-0.5 / (0.70711 + 1e-6)
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv.flatten().tolist() == pytest.approx([expected, -expected], abs=1e-12)
    assert expected == pytest.approx(0.7071, abs=1e-4)
    assert torch.equal(adv, ret)


def test_grpo_singleton_and_constant_groups():
    adv, _ = call("grpo", **one_token([2.0, 0.3, 0.3, 0.3], [7, 1, 1, 1]))
    assert adv.flatten().tolist() == [2.0 / (1 + 1e-6), 0.0, 0.0, 0.0]
    adv32, _ = call("grpo", **{**one_token([0.1, 0.1, 0.1], [0, 0, 0]), "token_rewards": torch.full((3, 1), 0.1)})
    assert adv32.abs().max().item() == 0.0  # float64 group statistics: no rounding noise / eps


def test_drgrpo_pair():
    adv, _ = call("drgrpo", **one_token([1.0, 0.0], [3, 3]))
    assert adv.flatten().tolist() == [0.5, -0.5]
    adv2, _ = call("grpo", **one_token([1.0, 0.0], [3, 3]), norm_by_std=False)
    assert torch.equal(adv, adv2)


def test_rloo_hand():
    adv, _ = call("rloo", **one_token([1.0, 0.0, 0.0, 5.0], [0, 0, 0, 1]))
    assert adv.flatten().tolist() == pytest.approx([1.0, -0.5, -0.5, 5.0])


def test_opo_hand():
    r = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    r[0, 0], r[1, 2] = 1.0, 0.0
    m = torch.tensor([[True, False, False], [True, True, True]])
    adv, _ = call("opo", token_rewards=r, response_mask=m, group=torch.tensor([4, 4]))
    # baseline (1 * 1 + 3 * 0) / 4 = 0.25
    assert adv.tolist() == [[0.75, 0.0, 0.0], [-0.25, -0.25, -0.25]]


def test_gpg_hand():
    adv, _ = call("gpg", **one_token([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1]))
    # alpha = 4 / 3 non-zero rewards; group means 0.5 and 1
    assert adv.flatten().tolist() == pytest.approx([2 / 3, -2 / 3, 0.0, 0.0])


def test_gae_hand():
    r = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.2, 9.0]], dtype=torch.float64)
    m = torch.tensor([[True, True, False]])
    adv, ret = call("gae", token_rewards=r, response_mask=m, values=v)
    # A1 = 1 - 0.2 = 0.8; A0 = 0 + 0.2 - 0.5 + 0.8 = 0.5; returns = A + V = 1, 1
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 0.0])
    # whitened [0.5, 0.8]: mean 0.65, unbiased variance 0.045 -> +-0.15 / sqrt(0.045 + 1e-8)
    w = 0.15 / math.sqrt(0.045 + 1e-8)
    assert w == pytest.approx(0.7071, abs=1e-4)
    # (verl's 1e-8 guards in the mean's denominator shift this by ~1e-8)
    assert adv[0].tolist() == pytest.approx([-w, w, 0.0], abs=5e-8)


def test_gae_one_valid_token_and_bad_hyperparameters():
    """A batch whose only valid token is one (PPO, n=1, one new token) crashed in masked_var;
    gamma=2 or lam=nan were accepted."""
    r = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[True, False]])
    adv, ret = call("gae", token_rewards=r, response_mask=m, values=torch.tensor([[0.25, 0.0]], dtype=torch.float64))
    assert adv.tolist() == [[0.0, 0.0]]  # x - mean over one token
    assert ret.tolist() == [[1.0, 0.0]]
    for name, bad in (("gamma", 2.0), ("gamma", -0.1), ("lam", float("nan")), ("lam", "1")):
        with pytest.raises(ValueError, match=rf"gae: {name} must be a number in \[0, 1\], got {bad!r}"):
            call("gae", token_rewards=r, response_mask=m, values=r, **{name: bad})


def test_reinforce_pp_returns_hand():
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[True, True, True, False], [True, True, False, False]])
    _, ret = call("reinforce++", token_rewards=r, response_mask=m, gamma=0.5)
    assert ret.tolist() == [[0.25, 0.5, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]]


def test_remax_hand():
    r = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[True, True, False]])
    adv, ret = call("remax", token_rewards=r, response_mask=m, reward_baselines=torch.tensor([0.25], dtype=torch.float64))
    assert ret.tolist() == [[1.0, 1.0, 0.0]]
    assert adv.tolist() == [[0.75, 0.75, 0.0]]


# ---------------------------------------------------------------- invariances


@pytest.mark.parametrize("name", NAMES)
def test_permutation_equivariant(name, gen, make_mask, to_tokens):
    data = random_batch(gen, make_mask, to_tokens)
    adv, ret = call(name, **data)
    perm = torch.randperm(10, generator=gen)
    relabel = {17: -40, -3: 12345, 900: 0, 5: 2}  # group ids are labels only
    permuted = {k: v[perm] for k, v in data.items()}
    permuted["group"] = torch.tensor([relabel[g] for g in permuted["group"].tolist()])
    adv_p, ret_p = call(name, **permuted)
    torch.testing.assert_close(adv_p, adv[perm], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret_p, ret[perm], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_padding_never_changes_a_result(name, gen, make_mask, to_tokens):
    data = random_batch(gen, make_mask, to_tokens, holes=True)
    adv, ret = call(name, **data)
    pad = ~data["response_mask"]
    noisy = dict(data)
    noisy["token_rewards"] = data["token_rewards"].masked_fill(pad, float("nan"))
    noisy["values"] = torch.where(pad, 1e6 * torch.randn(pad.shape, generator=gen, dtype=torch.float64), data["values"])
    adv_n, ret_n = call(name, **noisy)
    assert torch.equal(adv, adv_n) and torch.equal(ret, ret_n)
    assert adv[pad].abs().max() == 0 and ret[pad].abs().max() == 0


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "opo"])
def test_groups_are_independent(name, gen, make_mask, to_tokens):
    """Per-group estimators: the rows of one group do not depend on another group's rewards."""
    data = random_batch(gen, make_mask, to_tokens)
    adv, _ = call(name, **data)
    other = data["group"] != 900
    changed = dict(data)
    changed["token_rewards"] = torch.where(other[:, None], data["token_rewards"] * 3 + 1, data["token_rewards"])
    adv_c, _ = call(name, **changed)
    keep = data["group"] == 900
    torch.testing.assert_close(adv_c[keep], adv[keep], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- bad input


GROUP_NAMES = ["grpo", "drgrpo", "rloo", "opo", "gpg", "reinforce++_baseline"]


@pytest.mark.parametrize("name", NAMES)
def test_mismatched_mask_shape(name, gen, make_mask, to_tokens):
    data = random_batch(gen, make_mask, to_tokens)
    data["response_mask"] = data["response_mask"][:, :-1]
    with pytest.raises(ValueError, match="response_mask"):
        call(name, **data)


@pytest.mark.parametrize("name", NAMES)
def test_nan_reward(name, gen, make_mask, to_tokens):
    data = random_batch(gen, make_mask, to_tokens)
    data["token_rewards"][-1, 0] = float("nan")  # the last row is full length: a valid token
    with pytest.raises(ValueError, match="token_rewards"):
        call(name, **data)


@pytest.mark.parametrize("name, field", [(n, "group") for n in GROUP_NAMES] + [("gae", "values"), ("remax", "reward_baselines")])
def test_missing_required_input(name, field, gen, make_mask, to_tokens):
    data = random_batch(gen, make_mask, to_tokens)
    del data[field]
    with pytest.raises(ValueError, match=field):
        call(name, **data)


@pytest.mark.parametrize("name, field", [(n, "group") for n in GROUP_NAMES] + [("gae", "values"), ("remax", "reward_baselines")])
def test_wrong_shape_of_extra_input(name, field, gen, make_mask, to_tokens):
    data = random_batch(gen, make_mask, to_tokens)
    data[field] = data[field][:-1]
    with pytest.raises(ValueError, match=field):
        call(name, **data)


def test_float_group_ids_rejected(gen, make_mask, to_tokens):
    data = random_batch(gen, make_mask, to_tokens)
    data["group"] = data["group"].double()
    with pytest.raises(ValueError, match="group"):
        call("grpo", **data)


def test_nan_values_rejected(gen, make_mask, to_tokens):
    data = random_batch(gen, make_mask, to_tokens)
    data["values"][-1, 0] = float("nan")
    with pytest.raises(ValueError, match="values"):
        call("gae", **data)


def test_keyword_only():
    data = one_token([1.0, 0.0], [0, 0])
    with pytest.raises(TypeError):
        ADVANTAGE_ESTIMATORS.get("grpo")(data["token_rewards"], data["response_mask"], data["group"])


# ---------------------------------------------------------------- hyper-parameters and non-finite inputs


def test_hyperparameters_that_made_nan_or_inf_are_refused():
    """grpo(epsilon=0) gave 0/0 = NaN for a group of equal rewards, gpg(f_norm=0) inf and NaN,
    reinforce++(gamma=2 or nan) exploding or NaN returns (gae refused those gammas already)."""
    data = one_token([1.0, 1.0, 0.0, 1.0], [0, 0, 1, 1])
    for bad in (0.0, -1e-6, float("nan"), float("inf"), "1e-6"):
        with pytest.raises(ValueError, match=rf"grpo: epsilon must be a finite number > 0, got {bad!r}"):
            call("grpo", **data, epsilon=bad)
        with pytest.raises(ValueError, match=rf"gpg: f_norm must be a finite number > 0, got {bad!r}"):
            call("gpg", **data, f_norm=bad)
    for bad in (2.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match=rf"reinforce\+\+: gamma must be a number in \[0, 1\], got {bad!r}"):
            call("reinforce++", **data, gamma=bad)
    # the valid edges still work: f_norm scales, gamma=0 keeps each token's own reward
    a1, _ = call("gpg", **data)
    a2, _ = call("gpg", **data, f_norm=2.0)
    torch.testing.assert_close(a2, a1 / 2)
    _, ret = call("reinforce++", **data, gamma=0.0)
    torch.testing.assert_close(ret, data["token_rewards"])


@pytest.mark.parametrize("name", NAMES)
def test_infinite_inputs_are_refused_naming_the_field(name, gen, make_mask, to_tokens):
    """Only NaN was checked: an inf reward (or critic value, or greedy baseline) made its group's
    or the whole batch's advantages NaN or inf."""
    for field, value in (("token_rewards", float("inf")), ("token_rewards", float("-inf")), ("values", float("inf")),
                         ("reward_baselines", float("-inf"))):
        data = random_batch(gen, make_mask, to_tokens)
        if field not in inspect.signature(ADVANTAGE_ESTIMATORS.get(name)).parameters:
            continue
        row = int(data["response_mask"].any(-1).nonzero()[0])
        col = int(data["response_mask"][row].nonzero()[0])
        if data[field].dim() == 2:
            data[field][row, col] = value
        else:
            data[field][row] = value
        with pytest.raises(ValueError, match=rf"{field} contains NaN or inf"):
            call(name, **data)


@pytest.mark.parametrize("name", ["reinforce++", "reinforce++_baseline"])
def test_whitening_estimators_on_fewer_than_two_valid_tokens_give_zeros(name):
    """masked_var raised "the mask selects a single position" (naming neither the estimator nor
    the cause). With one valid token the whitened value x - mean is 0 and with none there is
    nothing to train: zeros, as gae returns."""
    group = torch.tensor([0, 0])
    one = torch.tensor([[True, False, False], [False, False, False]])
    r = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    adv, ret = call(name, token_rewards=r, response_mask=one, group=group)
    assert adv.tolist() == [[0.0] * 3, [0.0] * 3]
    if name == "reinforce++":
        assert ret.tolist() == r.tolist()  # the reward-to-go is still returned
    adv, ret = call(name, token_rewards=torch.zeros(2, 3, dtype=torch.float64), response_mask=torch.zeros(2, 3, dtype=torch.bool), group=group)
    assert adv.abs().sum() == 0 and ret.abs().sum() == 0
