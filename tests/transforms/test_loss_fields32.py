"""A policy loss receives the batch fields it declares by name (as an estimator does), each
micro-batch's rows of them: a loss declaring ref_logprobs=None or rewards=None had silently got
its default."""
import copy

import torch

import rlkit as rk
from rlkit.batch import make_batch


def _batch(char_tok):
    b = make_batch([[1, 5, 6], [1, 5, 6], [1, 8], [1, 8]], [[10, 11, 12, 3], [4], [5, 6], [4, 4, 4]],
                   group=[0, 0, 1, 1], rewards=[1.0, 0.0, 0.0, 1.0], pad_token_id=char_tok.pad_token_id,
                   logprobs=[[-1.0] * n for n in (4, 1, 2, 3)])
    b = rk.advantage(b, "grpo")
    b.set("ref_logprobs", torch.arange(16, dtype=torch.float32).reshape(4, 4) * b["response_mask"])
    b.set("weight", torch.tensor([0.5, 1.0, 2.0, 4.0]))  # a column of the user's own
    return b


def test_declared_fields_arrive_row_aligned_per_micro_batch(tiny_model, char_tok):
    seen = []

    def weighted(logprobs, old_logprobs, advantages, response_mask, *, num_tokens=None, ref_logprobs=None, rewards=None,
                 weight=None, clip=1.0):
        seen.append((ref_logprobs.clone(), rewards.clone(), weight.clone(), clip))
        loss = -(weight[:, None] * advantages * torch.exp(logprobs - old_logprobs) * response_mask).sum() / num_tokens
        return loss, {}

    batch = _batch(char_tok)
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    rk.update(state, batch, loss=weighted, loss_kw={"clip": 0.5}, micro_batch_size=2, max_logprob_gap=None)
    assert len(seen) == 2
    # the two micro-batches' rows, in order, are the batch's rows (mini-batches are not shuffled with one)
    torch.testing.assert_close(torch.cat([s[0] for s in seen]), batch["ref_logprobs"])
    torch.testing.assert_close(torch.cat([s[1] for s in seen]), batch["rewards"])
    torch.testing.assert_close(torch.cat([s[2] for s in seen]), batch["weight"])
    assert {s[3] for s in seen} == {0.5}


def test_loss_kw_wins_over_a_field_of_the_same_name(tiny_model, char_tok):
    seen = []

    def by_weight(logprobs, old_logprobs, advantages, response_mask, *, num_tokens=None, weight=None):
        seen.append(weight)
        return -(advantages * torch.exp(logprobs - old_logprobs) * response_mask).sum() / num_tokens, {}

    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    rk.update(state, _batch(char_tok), loss=by_weight, loss_kw={"weight": 3.0}, max_logprob_gap=None)
    assert seen == [3.0]
