"""The rollout's recorded temperature (old/ref log-probs and update at it by default, and the old
log-probs' gap), update's refusal of an agg a custom loss cannot receive, the policy-loss return
contract, and fit's check of a step's (state, metrics)."""
import copy
import warnings
from dataclasses import dataclass

import pytest
import torch

import rlkit as rk
from rlkit.batch import make_batch
from rlkit.transforms.forward import model_logprobs

T = 0.6
PROMPTS = ["1+2=", "3*4=", "ab", "9-7="]


def _rewarded(state, temperature=T, seed=0, prompts=PROMPTS):
    batch = rk.rollout(state, prompts, n=4, max_new_tokens=6, temperature=temperature, seed=seed)
    batch = batch.set("rewards", torch.arange(batch.batch_size[0], dtype=torch.float32) % 3)  # non-degenerate groups
    return rk.advantage(batch, "grpo")


def _token_mean(x, mask):
    return float((x * mask).sum() / mask.sum())


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_recomputed_old_logprobs_are_at_the_rollout_temperature(tiny_model, char_tok):
    """The tutorial's verl-style recompute, rk.compute_old_logprobs(state, batch), used T=1.0 whatever
    the rollout sampled at: with rollout and update at 0.6 the on-policy first update clipped 13% of
    the tokens (approx_kl -0.06), without a warning."""
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-4), tokenizer=char_tok)
    batch = _rewarded(state)
    mask = batch["response_mask"]
    given, warned = _caught(lambda: rk.compute_old_logprobs(state, batch))
    assert warned == []
    at_t, _ = model_logprobs(tiny_model, batch, temperature=T)
    at_1, _ = model_logprobs(tiny_model, batch, temperature=1.0)
    assert _token_mean((at_t - at_1).abs(), mask) > 0.05  # the test means something: 0.6 and 1.0 differ
    expected = -_token_mean(batch["advantages"], mask)  # ratio 1: ppo_clip's token-mean loss is -mean(A)
    (_, metrics), warned = _caught(lambda: rk.update(state, given, temperature=T))  # as the recipes call it
    assert metrics["actor/clipfrac"] == 0.0
    assert abs(metrics["actor/approx_kl"]) < 1e-6
    assert metrics["actor/pg_loss"] == pytest.approx(expected, abs=1e-6)
    assert metrics["actor/old_logprob_gap"] < 1e-5  # the new metric: the old log-probs the ratio uses
    assert warned == []
    torch.testing.assert_close(given["old_logprobs"], at_t, atol=1e-5, rtol=0)
    assert batch["temperature"].dtype == torch.float32 and batch["temperature"].tolist() == pytest.approx([T] * 16)


def test_update_and_ref_logprobs_default_to_the_recorded_temperature(tiny_model, char_tok):
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-4), tokenizer=char_tok, ref="copy")
    batch = _rewarded(state)
    mask = batch["response_mask"]
    ref = rk.compute_ref_logprobs(state, batch)["ref_logprobs"]
    # no temperature anywhere: the trainer's log-probs are the rollout's (update used 1.0: gap ~0.3)
    (_, metrics), warned = _caught(lambda: rk.update(state, batch, max_logprob_gap=0.01))
    assert metrics["actor/logprob_gap"] < 1e-5
    assert metrics["actor/clipfrac"] == 0.0
    assert metrics["actor/pg_loss"] == pytest.approx(-_token_mean(batch["advantages"], mask), abs=1e-6)
    assert warned == []
    torch.testing.assert_close(ref, model_logprobs(tiny_model, batch, temperature=T)[0], atol=1e-5, rtol=0)
    # an explicit temperature other than the recorded one is used, with a warning naming both
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-4), tokenizer=char_tok)
    (_, metrics), warned = _caught(lambda: rk.update(state, batch, temperature=1.0, max_logprob_gap=None))
    assert metrics["actor/logprob_gap"] > 0.05
    assert len(warned) == 1 and "temperature=1.0" in warned[0] and "0.6" in warned[0] and "not be 1" in warned[0]


def test_greedy_rows_record_one_and_hand_made_or_mixed_batches(tiny_model, char_tok):
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-4), tokenizer=char_tok)
    greedy = rk.rollout(state, PROMPTS[:2], n=1, max_new_tokens=5, temperature=0)
    assert greedy["temperature"].tolist() == [1.0, 1.0]  # greedy log-probs are the plain log-softmax
    torch.testing.assert_close(rk.compute_old_logprobs(state, greedy)["old_logprobs"],
                               greedy["logprobs"] * greedy["response_mask"], atol=1e-5, rtol=0)
    # a hand-made batch has no temperature column: 1.0, as before
    hand = make_batch([[5, 6], [7]], [[8, 9, 10], [11]], group=[0, 0], logprobs=[[-1.0] * 3, [-1.0]])
    torch.testing.assert_close(rk.compute_old_logprobs(state, hand)["old_logprobs"], model_logprobs(tiny_model, hand)[0])
    # a batch without the column, concatenated with one that has it, counts as 1.0; rows of two
    # temperatures need an explicit one
    sampled = rk.rollout(state, PROMPTS[:1], n=2, max_new_tokens=4, temperature=T)
    unrecorded = rk.rollout(state, PROMPTS[1:2], n=2, max_new_tokens=4, temperature=1.0).exclude("temperature")
    mixed = rk.concat([sampled, unrecorded])
    assert mixed["temperature"].tolist() == pytest.approx([T, T, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"different temperatures \[0\.6, 1\.0\].*temperature=\.\.\. explicitly"):
        rk.compute_old_logprobs(state, mixed)
    with pytest.raises(ValueError, match="different temperatures"):
        rk.update(state, rk.advantage(mixed.set("rewards", torch.tensor([0.0, 1.0, 0.0, 1.0])), "grpo"))
    out, warned = _caught(lambda: rk.compute_old_logprobs(state, mixed, temperature=T))
    assert "old_logprobs" in out.keys() and len(warned) == 1 and "[0.6, 1.0]" in warned[0]


def test_old_logprobs_at_a_wrong_explicit_temperature_are_measured_and_warned(tiny_model, char_tok):
    """update's gap compared the trainer with batch['logprobs'] only, not with the old_logprobs the
    ratio uses: old log-probs recomputed at 1.0 for a rollout at 0.6 went unnoticed."""
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-4), tokenizer=char_tok)
    batch = _rewarded(state)
    mask = batch["response_mask"]
    wrong, warned = _caught(lambda: rk.compute_old_logprobs(state, batch, temperature=1.0))
    assert len(warned) == 1 and "temperature=1.0" in warned[0] and "sampled at temperature 0.6" in warned[0]
    at_t, _ = model_logprobs(tiny_model, batch, temperature=T)
    expected = _token_mean((at_t - wrong["old_logprobs"]).abs(), mask)
    assert expected > 0.1
    (_, metrics), warned = _caught(lambda: rk.update(state, wrong, temperature=T, max_logprob_gap=0.1, micro_batch_size=5))
    assert metrics["actor/old_logprob_gap"] == pytest.approx(expected, rel=1e-4)
    assert metrics["actor/logprob_gap"] < 1e-5  # the rollout's log-probs are fine: only the old ones are off
    assert metrics["actor/clipfrac"] > 0.0
    old_warnings = [w for w in warned if "old_logprobs differ from the current policy" in w]
    assert len(old_warnings) == 1 and "another temperature" in old_warnings[0]
    # old="current" does not use them: no such metric
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-4), tokenizer=char_tok)
    _, metrics = rk.update(state, wrong, old="current", max_logprob_gap=None)
    assert "actor/old_logprob_gap" not in metrics


def _batch(char_tok):
    b = make_batch([[1, 5, 6], [1, 5, 6], [1, 8], [1, 8]], [[10, 11, 12, 3], [4], [5, 6], [4, 4, 4]],
                   group=[0, 0, 1, 1], rewards=[1.0, 0.0, 0.0, 1.0], pad_token_id=char_tok.pad_token_id,
                   logprobs=[[-1.0] * n for n in (4, 1, 2, 3)])
    return rk.advantage(b, "grpo")


def test_agg_a_custom_loss_cannot_receive_is_refused(tiny_model, char_tok):
    def my_pg(logprobs, old_logprobs, advantages, response_mask, *, num_tokens=None):
        ratio = torch.exp(logprobs - old_logprobs)
        return -(ratio * advantages * response_mask).sum() / num_tokens, {}

    def my_pg_agg(logprobs, old_logprobs, advantages, response_mask, *, agg="token-mean", num_tokens=None, num_seqs=None, horizon=None):
        loss_mat = -torch.exp(logprobs - old_logprobs) * advantages
        return rk.algos.aggregate(loss_mat, response_mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon), {}

    batch = _batch(char_tok)

    def run(loss, agg):
        state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-9), tokenizer=char_tok)
        return rk.update(state, batch, loss=loss, agg=agg, max_logprob_gap=None)[1]["actor/pg_loss"]

    with pytest.raises(TypeError, match=r"agg='seq-mean-token-sum' cannot reach the policy loss 'my_pg'.*Add an 'agg' parameter.*agg=None"):
        run(my_pg, "seq-mean-token-sum")
    assert run(my_pg, None) == pytest.approx(run(my_pg_agg, None), abs=1e-6)  # agg=None: the loss's own (token-mean)
    # a loss that takes agg (or **kwargs) receives it
    by_seq = run(my_pg_agg, "seq-mean-token-sum")
    assert abs(by_seq - run(my_pg_agg, "token-mean")) > 1e-3
    assert run(lambda lp, old, adv, m, **kw: my_pg_agg(lp, old, adv, m, **kw), "seq-mean-token-sum") == pytest.approx(by_seq, abs=1e-6)


def _bare(lp, old, adv, m):
    return -(lp * adv * m).sum()


def _per_token(lp, old, adv, m):
    return -(lp * adv * m), {}


def _one_element(lp, old, adv, m):
    return -(lp * adv * m).sum().reshape(1), {}


def _vector_metric(lp, old, adv, m):
    return -(lp * adv * m).sum(), {"ratio": torch.exp(lp - old).detach()}


def _list_metrics(lp, old, adv, m):
    return -(lp * adv * m).sum(), [0.0]


@pytest.mark.parametrize("loss, error, says", [
    (_bare, TypeError, r"returned a 0-d tensor.*return loss, \{\}"),
    (_per_token, ValueError, r"returned a loss of shape \(4, 4\).*aggregate"),
    (_one_element, ValueError, r"returned a loss of shape \(1,\)"),
    (_vector_metric, ValueError, r"returned metric 'ratio' of shape \(4, 4\)"),
    (_list_metrics, TypeError, r"returned metrics that are a list"),
], ids=["bare", "per_token", "one_element", "vector_metric", "list_metrics"])
def test_a_policy_loss_returning_the_wrong_thing_is_named(tiny_model, char_tok, loss, error, says):
    """These failed in torch ("iteration over a 0-d tensor", "grad can be implicitly created only
    for scalar outputs", "stack expects each tensor to be equal size"), naming neither."""
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    with pytest.raises(error, match=rf"policy loss '{loss.__name__}' {says}") as info:
        rk.update(state, _batch(char_tok), loss=loss)
    assert "must return (loss, metrics)" in str(info.value)
    assert state.step == 0  # refused before any optimizer step: the state is still usable


def test_fit_refuses_a_step_returning_metrics_first(tiny_model, char_tok):
    @dataclass(frozen=True)
    class MyAlgo(rk.recipes.Recipe):
        def step(self, state, prompts, reward):
            batch = rk.advantage(self.score(state, self.sample(state, prompts), reward), "grpo")
            state, metrics = rk.update(state, batch)
            return metrics, state  # swapped

    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-4), tokenizer=char_tok)
    reward = lambda completions, **_: [float(len(c) % 2) for c in completions]  # noqa: E731
    with pytest.raises(TypeError, match=r"MyAlgo\.step returned a tuple \(dict, TrainState\).*\(state, metrics\).*swapped") as info:
        rk.fit(state, MyAlgo(n=2, max_new_tokens=4), reward, PROMPTS, steps=1, batch_size=2)
    assert info.value.state.step == 1  # the state the step returned, for the run to go on from


def test_a_loss_that_cannot_normalise_by_the_mini_batch_warns_when_micro_batched(tiny_model, char_tok):
    """A loss declaring agg but neither num_tokens nor num_seqs averages over its own micro-batch:
    with 4 rows in micro-batches of 1 the summed means gave about 4x (here 2x and more) the
    full-batch loss and gradient, silently; update now says so. Unsplit, or with the counts
    declared, there is nothing to warn about and the gradient is the full batch's."""
    def own_mean(logprobs, old_logprobs, advantages, response_mask, *, agg="token-mean"):
        return rk.algos.aggregate(-advantages * torch.exp(logprobs - old_logprobs), response_mask, agg), {}

    def counted(logprobs, old_logprobs, advantages, response_mask, *, agg="token-mean", num_tokens=None):
        return rk.algos.aggregate(-advantages * torch.exp(logprobs - old_logprobs), response_mask, agg,
                                  num_tokens=num_tokens), {}

    def run(loss, micro):
        state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
        return _caught(lambda: rk.update(state, _batch(char_tok), loss=loss, micro_batch_size=micro,
                                         max_logprob_gap=None)[1])

    whole, quiet = run(own_mean, None)
    assert not [w for w in quiet if "normalise" in w]
    split, said = run(own_mean, 1)
    assert split["actor/grad_norm"] > 1.5 * whole["actor/grad_norm"]  # the defect the warning names
    assert any("'own_mean' (agg='token-mean') does not take num_tokens" in w and "micro_batch_size=1 splits each mini-batch "
               "into 4 micro-batches" in w for w in said)
    exact, quiet = run(counted, 1)
    assert not [w for w in quiet if "normalise" in w]
    assert exact["actor/grad_norm"] == pytest.approx(whole["actor/grad_norm"], rel=1e-5)


def test_a_loss_with_its_tensors_in_another_order_is_refused(tiny_model, char_tok):
    """update passes the four tensors by position: a loss naming them in another order (as an
    estimator gets batch fields by name) trained on the old log-probs as its advantages, silently;
    one taking three failed with Python's bare 'takes 3 positional arguments'."""
    def reordered(logprobs, advantages, response_mask, old_logprobs, *, num_tokens=None):
        ratio = torch.exp(logprobs - old_logprobs)
        return -(ratio * advantages * response_mask).sum() / num_tokens, {}

    def three(logprobs, advantages, response_mask, *, num_tokens=None):
        return -(logprobs * advantages * response_mask).sum() / num_tokens, {}

    def own_names(lp, old_lp, adv, mask, *, num_tokens=None):  # any names, in the right places
        return -(torch.exp(lp - old_lp) * adv * mask).sum() / num_tokens, {}

    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    with pytest.raises(TypeError, match=r"its 'advantages' would receive the old_logprobs; its 'response_mask' would "
                                        r"receive the advantages; its 'old_logprobs' would receive the response_mask"):
        rk.update(state, _batch(char_tok), loss=reordered)
    with pytest.raises(TypeError, match=r"takes 3 positional argument\(s\) \(logprobs, advantages, response_mask\); "
                                        r"update passes four"):
        rk.update(state, _batch(char_tok), loss=three)
    state, metrics = rk.update(state, _batch(char_tok), loss=own_names, max_logprob_gap=None)
    assert state.step == 1 and metrics["actor/grad_norm"] > 0
