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


def _widen(batch, extra):
    """The same rows with ``extra`` more padding columns in every response field."""
    from rlkit.batch import Batch

    out = {}
    for k in batch.keys():
        v = batch[k]
        if isinstance(v, torch.Tensor) and v.dim() == 2 and k not in ("prompt_ids", "prompt_mask"):
            v = torch.cat([v, torch.zeros(v.shape[0], extra, dtype=v.dtype)], 1)
        out[k] = v
    return Batch(out, batch_size=[batch.batch_size[0]])


def test_drgrpo_horizon_is_a_constant_not_the_batch_padding_width(tiny_model, char_tok):
    """Dr. GRPO's normaliser was the batch's response width: the same tokens padded to 3, 6 or 16
    columns gave pg_loss 1/3, 1/6, 1/16 (and gradients to match), and it could not be set."""
    batch = make_batch([[3, 4, 5]] * 4, [[5, 6], [7, 8, 9], [10], [11, 12]], group=[0, 0, 1, 1], rewards=[1.0, 0.0, 1.0, 0.0])
    lp, _ = model_logprobs(tiny_model, batch)
    batch.set("logprobs", lp)
    batch = rk.advantage(batch, "drgrpo")
    mask, adv = batch["response_mask"], batch["advantages"]
    # ratio 1 at the first step: ppo_clip's token loss is -A; Dr. GRPO sums it and divides by the horizon
    token_sum = float(-(adv * mask).sum())
    assert token_sum != 0
    results = []
    for extra in (0, 5):
        state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-2, eps=1.0, weight_decay=0.0), tokenizer=char_tok)
        state, metrics = rk.update(state, _widen(batch, extra), agg="seq-mean-token-sum-norm", horizon=16, max_logprob_gap=None)
        assert metrics["actor/pg_loss"] == pytest.approx(token_sum / 16, rel=1e-5)
        results.append(_params(state.actor))
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], atol=1e-7, rtol=1e-6)
    # None keeps the batch's width (3 columns here)
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-2), tokenizer=char_tok)
    _, metrics = rk.update(state, batch, agg="seq-mean-token-sum-norm", max_logprob_gap=None)
    assert metrics["actor/pg_loss"] == pytest.approx(token_sum / 3, rel=1e-5)
    # refused before anything runs, naming the argument and the fix; the state stays usable
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-2), tokenizer=char_tok)
    with pytest.raises(ValueError, match=r"horizon=2 is below the batch's response width 3.*max_new_tokens"):
        rk.update(state, batch, agg="seq-mean-token-sum-norm", horizon=2)
    for bad in (0, True, 4.0, "16"):
        with pytest.raises(ValueError, match="horizon must be a positive int"):
            rk.update(state, batch, agg="seq-mean-token-sum-norm", horizon=bad)
    assert state.step == 0
    # the recipes pass their max_new_tokens under that aggregation (and only there)
    assert rk.recipes.get("drgrpo", max_new_tokens=12).update_kwargs()["horizon"] == 12
    assert rk.recipes.get("grpo", max_new_tokens=12, agg="seq-mean-token-sum-norm").update_kwargs()["horizon"] == 12
    assert rk.recipes.get("grpo", max_new_tokens=12).update_kwargs()["horizon"] is None


def test_metrics_average_over_the_mini_batches_trained(tiny_model, char_tok):
    """A mini-batch of rows without response tokens is skipped; it was still counted in the
    average (epochs * b / mini), halving every loss and ratio metric here."""
    from rlkit.algos import masked_mean

    batch = make_batch([[3, 4]] * 4, [[5, 6, 7], [8, 9], [], []], group=[0, 0, 1, 1], rewards=[0.0] * 4)
    lp, _ = model_logprobs(tiny_model, batch)
    g = torch.Generator().manual_seed(0)
    batch.set("logprobs", lp + 0.3 * torch.randn(lp.shape, generator=g) * batch["response_mask"])
    batch.set("advantages", torch.randn(lp.shape, generator=g) * batch["response_mask"])
    # the first mini-batch runs before any step: its approx_kl is mean(old - new) over its tokens
    expected_kl = float(masked_mean(batch["logprobs"] - lp, batch["response_mask"]))
    got = {}
    for mini in (None, 2):
        state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
        _, got[mini] = rk.update(state, batch, mini_batch_size=mini, max_logprob_gap=None)
        assert got[mini]["actor/approx_kl"] == pytest.approx(expected_kl, rel=1e-4)
    for key in ("actor/pg_loss", "actor/entropy", "actor/clipfrac"):
        assert got[2][key] == pytest.approx(got[None][key], rel=1e-5, abs=1e-7), key


def test_update_metrics_have_no_step(tiny_model, char_tok):
    """update reported "step": float(state.step + 1), which sinks logged as a float metric next to
    their own int step (Prometheus refused the name). The step is the returned state's."""
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    new, metrics = rk.update(state, _batch(tiny_model, b=4))
    assert "step" not in metrics and new.step == 1
    assert all(isinstance(v, float) for v in metrics.values())


def test_an_interrupt_after_an_optimizer_step_donates_the_state(tiny_model, char_tok):
    """Ctrl-C inside update after the first optimizer step left the input state usable, its
    weights and moments already changed in place (and rk.fit handed it back as the state after
    the previous step). An exception before any step leaves it usable, as it was."""
    batch = _batch(tiny_model)
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-2), tokenizer=char_tok)
    snapshot = state.replace()

    steps = []

    def interrupt_the_second_step(*args):
        steps.append(1)
        if len(steps) == 2:
            raise KeyboardInterrupt

    hook = state.optimizer.register_step_post_hook(interrupt_the_second_step)
    with pytest.raises(KeyboardInterrupt):
        rk.update(state, batch, mini_batch_size=4)  # two optimizer steps: the second is interrupted
    hook.remove()
    for handle in (state, snapshot):
        with pytest.raises(rk.DonatedStateError, match=r"did not finish \(KeyboardInterrupt interrupted it mid-update, "
                                                       r"after 1 optimizer step\(s\) of 2\).*checkpoint"):
            handle.step  # noqa: B018

    def broken_loss(*args, **kwargs):
        raise KeyboardInterrupt

    fresh = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-2), tokenizer=char_tok)
    with pytest.raises(KeyboardInterrupt):
        rk.update(fresh, batch, loss=broken_loss)
    assert fresh.step == 0 and not fresh.is_donated  # nothing changed: usable


def test_fit_does_not_hand_back_a_state_interrupted_mid_update(char_tok):
    task = rk.tasks.arithmetic(n_train=8, n_test=4)
    model = rk.models.tiny(task.tokenizer, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, seed=0)
    state = rk.init(model, rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer)
    steps = []

    def hook(*args):
        steps.append(1)
        if len(steps) == 2:
            raise KeyboardInterrupt

    state.optimizer.register_step_post_hook(hook)
    recipe = rk.recipes.get("grpo", n=2, max_new_tokens=3)
    with pytest.raises(KeyboardInterrupt) as info:
        rk.fit(state, recipe, task.reward, task.train, steps=3, batch_size=2)
    assert info.value.state is None and len(info.value.history) == 1
    assert any("stopped during an update" in note and "no consistent state is left" in note for note in info.value.__notes__)


def test_gmpo_through_update_equals_a_direct_call(tiny_model, char_tok):
    """gmpo divided a direct call by every row (empty ones included) but update passed the rows
    with a valid token: the same batch had two losses."""
    from rlkit.algos import POLICY_LOSSES

    batch = make_batch([[3, 4]] * 4, [[5, 6, 7], [8, 9], [], [10]], group=[0, 0, 1, 1], rewards=[0.0] * 4)
    lp, _ = model_logprobs(tiny_model, batch)
    batch.set("logprobs", lp)
    batch.set("advantages", torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0], [0.0] * 3, [2.0, 0.0, 0.0]]) * batch["response_mask"])
    direct, _ = POLICY_LOSSES.get("gmpo")(lp, lp, batch["advantages"], batch["response_mask"])
    # ratio 1: the mean over the 3 non-empty rows of -(sequence advantage)
    assert direct.item() == pytest.approx(-(1.0 - 0.5 + 2.0) / 3, rel=1e-6)
    state = rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    _, metrics = rk.update(state, batch, loss="gmpo", max_logprob_gap=None)
    assert metrics["actor/pg_loss"] == pytest.approx(direct.item(), rel=1e-5)
