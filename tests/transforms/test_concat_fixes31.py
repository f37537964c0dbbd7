"""rk.concat: rows of one rollout keep their groups (a group cut between parts rejoins), rows of
different rollouts stay apart; padding is made on the parts' device."""
import math

import pytest
import torch

import rlkit as rk
from rlkit.batch import ROLLOUT_ROW, ROW_BITS, make_batch, split, validate

REWARDS = [1.0, 0.0, 1.0, 2.0, 1.0, 0.0, 2.0, 0.0]


@pytest.fixture
def state(tiny_model, char_tok):
    return rk.init(tiny_model, rk.optim.adamw(lr=1e-3), tokenizer=char_tok)


def _sampled(state, seed=1, prompts=("1+2=", "3*4=")):
    """2 prompts x 4 responses (groups [0]*4 + [1]*4) with REWARDS."""
    batch = rk.rollout(state, list(prompts), n=4, max_new_tokens=4, seed=seed)
    return batch.set("rewards", torch.tensor(REWARDS))


def _grpo(rewards):
    """GRPO by hand: (r - mean) / (unbiased std) within each group of 4."""
    out = []
    for g in range(len(rewards) // 4):
        r = rewards[4 * g: 4 * g + 4]
        mean = sum(r) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / 3)
        out += [(x - mean) / std for x in r]
    return out


def _advantages(batch):
    return rk.advantage(batch, "grpo")["advantages"][:, 0].tolist()


def _partition(groups):
    """Which rows share a group, whatever the labels."""
    return [[j for j, h in enumerate(groups) if h == g] for g in groups]


def test_rejoining_pieces_of_one_rollout_keeps_its_groups_and_advantages(state):
    b = _sampled(state)
    expected = _grpo(REWARDS)  # group 0: 0, -1.225, 0, 1.225; group 1: 0.261, -0.783, 1.306, -0.783
    assert _advantages(b) == pytest.approx(expected, abs=1e-4)
    halves = rk.concat(split(b, 2))  # renumbered per part: [0,0,1,1,2,2,3,3], advantages +-0.707
    assert halves["group"].tolist() == [0] * 4 + [1] * 4
    assert torch.equal(halves[ROLLOUT_ROW], b[ROLLOUT_ROW])
    assert _advantages(halves) == pytest.approx(expected, abs=1e-4)
    # unequal pieces refused with a complaint about group sizes; now the groups are whole again
    assert _advantages(rk.concat([b[:3], b[3:5], b[5:]])) == pytest.approx(expected, abs=1e-4)
    # shuffled rows rejoined: each row keeps its own group
    perm = torch.tensor([1, 6, 0, 3, 7, 2, 5, 4])
    shuffled = b[perm]
    rejoined = rk.concat([shuffled[:4], shuffled[4:]])
    assert rejoined["group"].tolist() == shuffled["group"].tolist() == [0, 1, 0, 0, 1, 0, 1, 1]
    assert _advantages(rejoined) == pytest.approx([expected[i] for i in perm.tolist()], abs=1e-4)


def test_rollouts_of_the_same_prompts_stay_distinct_groups(state):
    """DAPO's dynamic sampling concatenates several rollouts of one step's prompts: groups 0 and 1
    of each are other samples, never merged (the groups concat always gave them: blocks in order)."""
    a, b = _sampled(state, seed=1), _sampled(state, seed=2)
    assert a[ROLLOUT_ROW][0] >> ROW_BITS != b[ROLLOUT_ROW][0] >> ROW_BITS
    both = rk.concat([a, b])
    assert both["group"].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert _advantages(both) == pytest.approx(_grpo(REWARDS) * 2, abs=1e-4)
    # pieces of a around b: a's cut group rejoins, b's groups stay its own
    mixed = rk.concat([a[:2], b, a[2:]])
    assert _partition(mixed["group"].tolist()) == _partition([0, 0, 2, 2, 2, 2, 3, 3, 3, 3, 0, 0, 1, 1, 1, 1])
    # the result is a batch of its own: new ids, and its pieces rejoin in turn
    keys = set((mixed[ROLLOUT_ROW] >> ROW_BITS).tolist())
    assert len(keys) == 1 and keys.isdisjoint(set((torch.cat([a[ROLLOUT_ROW], b[ROLLOUT_ROW]]) >> ROW_BITS).tolist()))
    again = rk.concat(split(mixed, 3))
    assert again["group"].tolist() == mixed["group"].tolist()
    assert validate(again)[ROLLOUT_ROW].tolist() == mixed[ROLLOUT_ROW].tolist()


def test_a_batch_concatenated_with_itself_is_a_second_copy_not_bigger_groups(state):
    """Merged, each group of 4 became 8 rows holding every response twice: GRPO's std and RLOO's
    leave-one-out baseline counted each response's own copy."""
    a = _sampled(state)
    twice = rk.concat([a, a.clone()])
    assert twice["group"].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert _advantages(twice) == pytest.approx(_grpo(REWARDS) * 2, abs=1e-4)
    # an overlapping piece is a copy too: no group of more than 4 rows
    overlap = rk.concat([a[:6], a[4:]])
    _, counts = torch.unique(overlap["group"], return_counts=True)
    assert counts.max() <= 4


def test_rollout_records_rollout_row_without_moving_the_seeded_sampling(state):
    a = rk.rollout(state, ["1+2=", "3*4="], n=3, max_new_tokens=4, seed=5)
    b = rk.rollout(state, ["1+2=", "3*4="], n=3, max_new_tokens=4, seed=5)
    assert torch.equal(a["response_ids"], b["response_ids"])  # the ids came from no seeded generator
    rows = a[ROLLOUT_ROW]
    assert rows.dtype == torch.long and (rows & ((1 << ROW_BITS) - 1)).tolist() == list(range(6))
    assert len(set((rows >> ROW_BITS).tolist())) == 1
    assert (rows >> ROW_BITS)[0] != (b[ROLLOUT_ROW] >> ROW_BITS)[0]  # another call, another key
    assert torch.equal(split(a, 4)[1][ROLLOUT_ROW], rows[4:])


def test_hand_made_batches_concatenate_as_before():
    """No rollout identity: each part's groups apart, and no rollout_row field added (gather_rows
    must equal this concatenation, tests/parallel/test_reshard.py)."""
    a = make_batch([[5], [6], [7], [8]], [[1], [2], [3], [4]], group=[3, 3, 1, 1])
    merged = rk.concat(split(a, 2))
    assert merged["group"].tolist() == [0, 0, 1, 1]
    assert ROLLOUT_ROW not in merged.keys()


def test_a_hand_made_part_beside_rollout_pieces_is_a_source_of_its_own(state):
    b = _sampled(state)
    hand = make_batch([[5], [6]], [[1], [2]], group=[0, 0], rewards=[0.0, 1.0])
    hand = hand.set("logprobs", torch.zeros(2, 1))
    common = [k for k in b.keys() if k in hand.keys()] + [ROLLOUT_ROW]
    mixed = rk.concat([b[:4].select(*common), hand, b[4:].select(*common)])
    assert mixed["group"].tolist() == [0] * 4 + [2, 2] + [1] * 4
    assert ROLLOUT_ROW in mixed.keys() and len(set((mixed[ROLLOUT_ROW] >> ROW_BITS).tolist())) == 1


def test_padding_is_made_on_the_parts_device(state):
    """Parts of different widths whose token fields live off the CPU (meta here: no GPU needed):
    the padding was made on the CPU and torch.cat refused to join it to them."""
    def on_meta(batch):
        batch = batch.clone()
        for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs"):
            batch.set(k, batch[k].to("meta"))
        return batch

    narrow = rk.rollout(state, ["1+2="], n=2, max_new_tokens=2, seed=1)
    wide = rk.rollout(state, ["33*44="], n=2, max_new_tokens=6, seed=1)
    assert narrow.device is None  # tensors of a batch may live on different devices
    extra = 8 - wide["response_ids"].shape[1]  # wider than narrow's 2 columns, wherever wide's responses stopped
    for k in ("response_ids", "response_mask", "logprobs"):
        wide = wide.set(k, torch.cat([wide[k], torch.zeros(2, extra, dtype=wide[k].dtype)], 1))
    assert narrow["response_ids"].shape[1] < wide["response_ids"].shape[1]
    assert narrow["prompt_ids"].shape[1] < wide["prompt_ids"].shape[1]
    both = rk.concat([on_meta(narrow), on_meta(wide)])
    for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs"):
        assert both[k].device.type == "meta", k
        assert both[k].shape == (4, wide[k].shape[1]), k
    assert both["group"].tolist() == [0, 0, 1, 1]
    # and the values on the CPU: prompts padded on the left, responses on the right, with 0/False
    cpu = rk.concat([narrow, wide])
    t = narrow["response_ids"].shape[1]
    assert torch.equal(cpu["response_ids"][:2, :t], narrow["response_ids"]) and not cpu["response_mask"][:2, t:].any()
    p = narrow["prompt_ids"].shape[1]
    assert torch.equal(cpu["prompt_ids"][:2, -p:], narrow["prompt_ids"]) and not cpu["prompt_mask"][:2, :-p].any()
