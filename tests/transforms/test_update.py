import copy

import pytest
import torch

import rlkit as rk
from rlkit.batch import make_batch
from rlkit.transforms.forward import model_logprobs


def _batch(model, seed=0, b=8, vocab=18):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(b)]
    responses = [torch.randint(3, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(b)]
    batch = make_batch(prompts, responses, group=[i // 4 for i in range(b)], rewards=torch.rand(b, generator=g).tolist())
    lp, _ = model_logprobs(model, batch)
    batch.set("logprobs", lp + 0.05 * torch.randn(lp.shape, generator=g) * batch["response_mask"])
    batch.set("advantages", torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"])
    return batch


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("loss", ["ppo_clip", "gspo"])
def test_micro_batches_with_accumulation_equal_one_batch(tiny_model, char_tok, agg, loss):
    batch = _batch(tiny_model)
    results = []
    # 3 does not divide the 8 rows: micro-batches of 3, 3 and 2 (it used to be refused); 64 > the
    # batch's rows: one micro-batch, as None
    for micro in (None, 2, 3, 64):
        model = copy.deepcopy(tiny_model)
        # eps=1 makes Adam's first step ~ lr * g (not lr * sign(g)), so the comparison measures
        # the gradients themselves rather than the sign of float noise on near-zero entries
        state = rk.init(model, rk.optim.adamw(lr=1e-2, eps=1.0, weight_decay=0.0), tokenizer=char_tok)
        state, metrics = rk.update(state, batch, loss=loss, agg=agg, micro_batch_size=micro, entropy_coef=0.01)
        results.append((_params(state.actor), metrics))
    (p_full, m_full), *others = results
    for p_micro, m_micro in others:
        for k in p_full:
            torch.testing.assert_close(p_micro[k], p_full[k], atol=1e-7, rtol=1e-6)
        assert m_micro["actor/pg_loss"] == pytest.approx(m_full["actor/pg_loss"], abs=1e-6)
        assert m_micro["actor/grad_norm"] == pytest.approx(m_full["actor/grad_norm"], rel=1e-5)


def test_update_changes_parameters_donates_and_reports(tiny_model, char_tok):
    batch = _batch(tiny_model)
    before = _params(tiny_model)
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-2), tokenizer=char_tok)
    new_state, metrics = rk.update(state, batch)
    assert new_state.step == 1 and new_state.policy_version == 1
    assert any(not torch.equal(before[k], v) for k, v in _params(new_state.actor).items())
    with pytest.raises(rk.DonatedStateError):
        rk.update(state, batch)
    for key in ("actor/pg_loss", "actor/clipfrac", "actor/approx_kl", "actor/entropy", "actor/grad_norm", "actor/lr", "actor/logprob_gap"):
        assert key in metrics, key
    # the batch's behaviour log-probs were perturbed by N(0, 0.05): the gap metric must see it
    assert 0.01 < metrics["actor/logprob_gap"] < 0.1


def test_kl_to_reference_is_zero_for_an_identical_reference(tiny_model, char_tok):
    batch = _batch(tiny_model)
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok, ref="copy")
    _, metrics = rk.update(state, batch, kl=("low_var_kl", 0.1))
    assert abs(metrics["actor/kl_loss"]) < 1e-6


def test_kl_coefficient_must_be_finite_and_not_negative(tiny_model, char_tok):
    """A negative coefficient would reward moving away from the reference, NaN would make every
    loss NaN: both used to be accepted. The state is untouched by the refused calls."""
    batch = _batch(tiny_model)
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok, ref="copy")
    before = _params(state.actor)
    for kl, error, match in ((("low_var_kl", -0.1), ValueError, "finite number >= 0, got -0.1"),
                             (-0.1, ValueError, "finite number >= 0, got -0.1"),
                             (("k3", float("nan")), ValueError, "got nan"),
                             (("k3", "0.1x"), TypeError, "must be a number, got '0.1x'")):
        with pytest.raises(error, match=match):
            rk.update(state, batch, kl=kl)
    after = _params(state.actor)
    assert all(torch.equal(before[k], after[k]) for k in before)
    _, metrics = rk.update(state, batch, kl=("k3", 0))  # 0 is allowed: the penalty is off
    assert "actor/kl_loss" not in metrics and "actor/pg_loss" in metrics


def test_bad_sizes_and_missing_fields_name_the_problem(tiny_model, char_tok):
    batch = _batch(tiny_model)
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    with pytest.raises(ValueError, match="mini_batch_size=5 does not divide"):
        rk.update(state, batch, mini_batch_size=5)
    # 0 used to mean "the whole batch" silently, as None does
    with pytest.raises(ValueError, match="micro_batch_size must be a positive int or None.*got 0"):
        rk.update(state, batch, micro_batch_size=0)
    with pytest.raises(ValueError, match="mini_batch_size must be a positive int or None.*got 2.5"):
        rk.update(state, batch, mini_batch_size=2.5)
    with pytest.raises(TypeError, match="no option"):
        rk.update(state, batch, loss_kw={"clip_ration": 0.2})
    with pytest.raises(ValueError, match="unknown policy loss 'ppo_clipp'"):
        rk.update(state, batch, loss="ppo_clipp")
    del batch["advantages"]
    with pytest.raises(rk.BatchError, match="advantages.*rlkit.advantage"):
        rk.update(state, batch)


def test_user_loss_function_is_accepted(tiny_model, char_tok):
    batch = _batch(tiny_model)
    calls = []

    def reinforce(logprobs, old_logprobs, advantages, response_mask, *, agg="token-mean", num_tokens=None, num_seqs=None):
        calls.append(1)
        loss = -(logprobs * advantages * response_mask).sum() / num_tokens
        return loss, {}

    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    _, metrics = rk.update(state, batch, loss=reinforce, micro_batch_size=4)
    assert len(calls) == 2 and "actor/pg_loss" in metrics


def test_nonfinite_gradient_skips_the_step(tiny_model, char_tok):
    batch = _batch(tiny_model)
    batch.set("advantages", batch["advantages"] * float("nan"))
    before = _params(tiny_model)
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-2), tokenizer=char_tok)
    with pytest.warns(RuntimeWarning, match="non-finite.*step 0"):
        state, metrics = rk.update(state, batch, max_nonfinite_steps=2)
    assert metrics["actor/skipped_steps"] == 1.0
    for k, v in _params(state.actor).items():
        assert torch.equal(before[k], v)
    from rlkit.transforms.update import NonFiniteError

    with pytest.raises(NonFiniteError, match="consecutive"):
        with pytest.warns(RuntimeWarning):
            rk.update(state, batch, max_nonfinite_steps=2)


def test_large_train_vs_rollout_gap_warns(tiny_model, char_tok):
    batch = _batch(tiny_model)
    batch.set("logprobs", batch["logprobs"] - 2.0 * batch["response_mask"])  # a stale engine
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    with pytest.warns(RuntimeWarning, match="differ from the rollout's by 2"):
        rk.update(state, batch)


def test_old_current_equals_a_separate_old_policy_pass_for_one_optimizer_step(tiny_model, char_tok):
    from rlkit.transforms.forward import compute_old_logprobs

    batch = _batch(tiny_model)
    out = {}
    for old in ("batch", "current"):
        model = copy.deepcopy(tiny_model)
        state = rk.init(model, rk.optim.adamw(lr=1e-2, eps=1.0, weight_decay=0.0), tokenizer=char_tok)
        b = compute_old_logprobs(state, batch) if old == "batch" else batch
        state, metrics = rk.update(state, b, old=old, micro_batch_size=2, loss_kw={"clip_ratio": 0.1})
        out[old] = (_params(state.actor), metrics)
    (p_sep, m_sep), (p_cur, m_cur) = out["batch"], out["current"]
    for k in p_sep:
        torch.testing.assert_close(p_cur[k], p_sep[k], atol=1e-7, rtol=1e-6)
    assert m_cur["actor/pg_loss"] == pytest.approx(m_sep["actor/pg_loss"], abs=1e-6)
    assert m_cur["actor/clipfrac"] == m_sep["actor/clipfrac"] == 0.0
    # against the rollout's (perturbed) log-probs the same update differs: the test can tell
    model = copy.deepcopy(tiny_model)
    state = rk.init(model, rk.optim.adamw(lr=1e-2, eps=1.0, weight_decay=0.0), tokenizer=char_tok)
    _, m_roll = rk.update(state, batch, micro_batch_size=2, loss_kw={"clip_ratio": 0.1})
    assert m_roll["actor/clipfrac"] > 0.0


def test_old_current_refuses_updates_of_several_optimizer_steps(tiny_model, char_tok):
    batch = _batch(tiny_model)
    for kw in (dict(epochs=2), dict(mini_batch_size=4)):
        state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-2), tokenizer=char_tok)
        with pytest.raises(ValueError, match="one optimizer step"):
            rk.update(state, batch, old="current", **kw)
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-2), tokenizer=char_tok)
    with pytest.raises(ValueError, match="'batch' or 'current'"):
        rk.update(state, batch, old="rollout")


def test_one_non_finite_mini_batch_skips_only_its_own_step(tiny_model, char_tok):
    """The check read the running sum of the update's losses: after one NaN mini-batch every
    later one looked non-finite too, so all were skipped (and three in a row raised)."""
    from rlkit.algos.losses import ppo_clip

    calls = []

    def flaky(logprobs, old_logprobs, advantages, response_mask, **kw):
        calls.append(1)
        loss, metrics = ppo_clip(logprobs, old_logprobs, advantages, response_mask, **kw)
        return (loss * float("nan") if len(calls) == 1 else loss), metrics

    batch = _batch(tiny_model, b=4)
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-2), tokenizer=char_tok)
    before = _params(tiny_model)
    with pytest.warns(RuntimeWarning, match="non-finite loss or gradient"):
        state, metrics = rk.update(state, batch, loss=flaky, mini_batch_size=1)
    assert len(calls) == 4 and metrics["actor/skipped_steps"] == 1.0
    after = _params(state.actor)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(after[k], before[k]) for k in before)  # the other three steps ran


@pytest.mark.parametrize("sizes", [{"micro_batch_size": 1}, {"mini_batch_size": 1}])
def test_rows_without_response_tokens_train_like_the_rest(tiny_model, char_tok, sizes):
    """A micro-batch holding only such rows had a loss without grad_fn (backward raised); a
    mini-batch of them divided its token mean by zero (NaN, then skipped steps)."""
    batch = make_batch([[5, 6]] * 4, [[5, 6, 7], [], [5], [6, 7]], group=[0, 0, 1, 1], rewards=[1, 0, 1, 0],
                       logprobs=[[-1.0] * 3, [], [-1.0], [-1.0] * 2])
    batch = rk.advantage(batch, "grpo")
    kept = batch[torch.tensor([0, 2, 3])]
    results = []
    for b in (batch, kept):
        model = copy.deepcopy(tiny_model)
        state = rk.init(model, rk.optim.adamw(lr=1e-2, eps=1.0, weight_decay=0.0), tokenizer=char_tok)
        state, metrics = rk.update(state, b, max_logprob_gap=None, **sizes)
        assert metrics["actor/skipped_steps"] == 0.0
        results.append(_params(state.actor))
    # the empty row adds nothing: the same update as without it (its mini-batch takes no step)
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], atol=1e-7, rtol=1e-6)


def test_logprob_gap_is_the_mean_over_the_rows_it_measured(tiny_model, char_tok):
    """With shuffled mini-batches the gap was summed over the shuffled first mini-batch but divided
    by the unshuffled first mini-batch's token count."""
    batch = _batch(tiny_model)
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    order = torch.randperm(8, generator=state.rng("shuffle", 0, device="cpu"))[:4]
    lp, _ = model_logprobs(tiny_model, batch[order])
    rows = batch[order]
    expected = float(((lp - rows["logprobs"]).abs() * rows["response_mask"]).sum() / rows["response_mask"].sum())
    assert float(batch[:4]["response_mask"].sum()) != float(rows["response_mask"].sum())  # the test can tell them apart
    _, metrics = rk.update(state, batch, mini_batch_size=4, shuffle=True, max_logprob_gap=None)
    assert metrics["actor/logprob_gap"] == pytest.approx(expected, rel=1e-5)
