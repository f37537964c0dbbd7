"""A custom policy loss with an ``agg`` parameter gets only the normalisers it declares: one that
declared ``agg`` and ``num_tokens`` (as the tutorial showed) was silently mis-scaled under
``seq-mean-*`` with micro-batches (4 parts: 4x the gradient) and under Dr. GRPO's horizon (the
batch width instead: 2x here). update now warns, naming the missing normaliser; a loss declaring
all three trains exactly as the built-in ppo_clip."""
import copy
import warnings

import pytest
import torch

import rlkit as rk
from rlkit.batch import make_batch


def _batch(char_tok):
    b = make_batch([[1, 5, 6], [1, 5, 6], [1, 8], [1, 8]], [[10, 11, 12, 3], [4], [5, 6], [4, 4, 4]],
                   group=[0, 0, 1, 1], rewards=[1.0, 0.0, 0.0, 1.0], pad_token_id=char_tok.pad_token_id,
                   logprobs=[[-1.0] * n for n in (4, 1, 2, 3)])
    return rk.advantage(b, "grpo")


def _ratio_loss(logprobs, old_logprobs, advantages):
    return -advantages * torch.exp(logprobs - old_logprobs)


def tokens_only(logprobs, old_logprobs, advantages, response_mask, *, agg="token-mean", num_tokens=None):
    return rk.algos.aggregate(_ratio_loss(logprobs, old_logprobs, advantages), response_mask, agg, num_tokens=num_tokens), {}


def all_three(logprobs, old_logprobs, advantages, response_mask, *, agg="token-mean", num_tokens=None, num_seqs=None,
              horizon=None):
    return rk.algos.aggregate(_ratio_loss(logprobs, old_logprobs, advantages), response_mask, agg, num_tokens=num_tokens,
                              num_seqs=num_seqs, horizon=horizon), {}


def _run(model, tok, loss, **kwargs):
    state = rk.init(copy.deepcopy(model), rk.optim.adamw(lr=1e-3), tokenizer=tok)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, metrics = rk.update(state, _batch(tok), loss=loss, max_logprob_gap=None, **kwargs)
    return metrics, [str(w.message) for w in caught if "normalise" in str(w.message) or "horizon" in str(w.message)]


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_seq_mean_loss_without_num_seqs_warns_when_micro_batched(tiny_model, char_tok, agg):
    whole, quiet = _run(tiny_model, char_tok, tokens_only, agg=agg)
    assert quiet == []  # one micro-batch: its own row count is the mini-batch's
    split, said = _run(tiny_model, char_tok, tokens_only, agg=agg, micro_batch_size=1)
    assert split["actor/grad_norm"] > 2 * whole["actor/grad_norm"]  # the defect the warning names
    assert len(said) == 1 and f"'tokens_only' (agg={agg!r}) does not take num_seqs" in said[0]
    assert "micro_batch_size=1 splits each mini-batch into 4 micro-batches" in said[0]
    assert "num_tokens=None, num_seqs=None, horizon=None" in said[0]
    exact, quiet = _run(tiny_model, char_tok, all_three, agg=agg, micro_batch_size=1)
    assert quiet == []
    assert exact["actor/grad_norm"] == pytest.approx(whole["actor/grad_norm"], rel=1e-5)


def test_a_dr_grpo_loss_without_horizon_warns_even_unsplit(tiny_model, char_tok):
    kwargs = dict(agg="seq-mean-token-sum-norm", horizon=8)  # the batch's responses are 4 wide
    mine, said = _run(tiny_model, char_tok, tokens_only, **kwargs)
    assert len(said) == 1 and "does not take horizon" in said[0] and "divides by the batch's response width" in said[0]
    right, quiet = _run(tiny_model, char_tok, all_three, **kwargs)
    assert quiet == []
    assert mine["actor/pg_loss"] == pytest.approx(2 * right["actor/pg_loss"], rel=1e-5)  # width 4, not horizon 8
    # Dr. GRPO's loss by hand: every token's loss summed, over the horizon (no division by the rows, as
    # verl's seq-mean-token-sum-norm); at step 0 the ratio is
    # exp(logprobs + 1) with the policy's own log-probs
    batch = _batch(char_tok)
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    logprobs = rk.compute_old_logprobs(state, batch)["old_logprobs"]
    mask = batch["response_mask"].float()
    by_hand = (_ratio_loss(logprobs, batch["logprobs"], batch["advantages"]) * mask).sum() / 8
    assert right["actor/pg_loss"] == pytest.approx(float(by_hand), rel=1e-4)
    # the horizon left to the batch width: nothing differs, nothing to say
    assert _run(tiny_model, char_tok, tokens_only, agg="seq-mean-token-sum-norm")[1] == []


def test_the_losss_own_default_agg_decides_what_it_needs(tiny_model, char_tok):
    def seq_default(logprobs, old_logprobs, advantages, response_mask, *, agg="seq-mean-token-mean", num_tokens=None):
        return rk.algos.aggregate(_ratio_loss(logprobs, old_logprobs, advantages), response_mask, agg, num_tokens=num_tokens), {}

    _, said = _run(tiny_model, char_tok, seq_default, micro_batch_size=2)
    assert len(said) == 1 and "(agg='seq-mean-token-mean') does not take num_seqs" in said[0]
    # token-mean reads num_tokens only: the same loss under agg="token-mean" is exact and quiet
    assert _run(tiny_model, char_tok, seq_default, agg="token-mean", micro_batch_size=2)[1] == []
