"""Rewards split over data-parallel ranks (rlkit.parallel.shard_reward) on 2 CPU processes (gloo):
every rank gets every reward, equal to scoring on one process, while each function sees only its
share of the rows; a reward failing on one rank raises on both instead of hanging the gather."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

ANSWERS = ["1", "2", "1", "3", "1"]
TEXTS = ["a", "bb", "c", "ddd", "e"]


def _batch():
    from rlkit.batch import make_batch

    return make_batch(
        [[1, 2]] * 5, [[3], [4, 4], [5], [6, 6, 6], [7]],
        columns={"answer": ANSWERS, "response_text": TEXTS, "prompt_text": ["p"] * 5},
    )


def _job() -> dict:
    import torch
    import torch.distributed as dist

    from rlkit.parallel import init_distributed, shard_reward, shutdown
    from rlkit.transforms.score import RewardError, score

    init_distributed()
    rank = dist.get_rank()
    seen: dict[str, list[int]] = {"trl": [], "batch": [], "verl": []}

    def trl(completions, answer, **kwargs):
        seen["trl"].append(len(completions))
        return [len(c) + float(a) for c, a in zip(completions, answer)]

    def by_batch(batch):
        seen["batch"].append(batch.batch_size[0])
        return batch["response_mask"].sum(-1).float() * 10

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen["verl"].append(1)
        return float(len(solution_str) == int(ground_truth))

    def prompts_first(prompts, completions, **kwargs):  # TRL calls by keyword; so does score, sharded too
        return [float(len(c)) for c in completions]

    out_keyword = {"keyword": score(_batch(), shard_reward(prompts_first))["rewards"].tolist()}
    rewards = {"trl": trl, "batch": by_batch, "verl": compute_score}
    sharded = score(_batch(), shard_reward(rewards))
    calls = {k: list(v) for k, v in seen.items()}
    single = score(_batch(), rewards)
    out = {
        "rank": rank,
        "equal": all(torch.equal(sharded[k], single[k]) for k in ("rewards", "reward/trl", "reward/batch", "reward/verl")),
        "rewards": sharded["rewards"].tolist(),
        "calls": calls,
        **out_keyword,
    }

    # no text columns: score decodes the rows, and a sharded reward decodes only its share
    import rlkit.models.tokenizers as T
    from rlkit.batch import make_batch
    from rlkit.models.tokenizers import char_tokenizer

    tok = char_tokenizer("abcdefgh0123456789")
    decoded: list[int] = []
    plain_decode = T.decode_batch

    def counting_decode(tokenizer, sequences):
        decoded.append(len(sequences))
        return plain_decode(tokenizer, sequences)

    T.decode_batch = counting_decode
    ids_batch = make_batch([tok.encode(p) for p in ["ab", "ab", "cd", "cd", "ef"]],
                           [tok.encode(t) for t in ["1", "22", "3", "444", "5"]])

    def by_text(completions, prompts, completion_ids):
        return [float(c) + len(p) + 10 * len(i) for c, p, i in zip(completions, prompts, completion_ids)]

    try:
        sharded_text = score(ids_batch, shard_reward(by_text), tokenizer=tok)
        out["decoded_sharded"], decoded[:] = list(decoded), []
        single_text = score(ids_batch, by_text, tokenizer=tok)
        out["decoded_single"] = list(decoded)
    finally:
        T.decode_batch = plain_decode
    out["text_rewards"] = sharded_text["rewards"].tolist()
    out["text_equal"] = torch.equal(sharded_text["rewards"], single_text["rewards"])

    def fails_on_rank_1(completions, **kwargs):
        if rank == 1:
            raise ValueError("boom")
        return [0.0] * len(completions)

    class Ranked:  # a reward object whose attributes share names with the sharding wrapper's fields
        def __init__(self):
            self.rank, self.size, self.fn, self.style, self.group = 1, 7, len, "batch", "g"

        def __call__(self, completions, **kwargs):
            return [float(len(c)) for c in completions]

    out["object_rewards"] = score(_batch(), shard_reward(Ranked()))["rewards"].tolist()

    try:
        score(_batch(), shard_reward(fails_on_rank_1))
        out["error"] = None
    except RewardError as exc:
        out["error"] = str(exc)

    def fails_on_ddd(completions, **kwargs):  # row 3 of 5: the second row of rank 1's share
        return [1.0 / (c != "ddd") for c in completions]

    try:
        score(_batch(), shard_reward(fails_on_ddd))
        out["row_error"] = None
    except RewardError as exc:
        out["row_error"] = str(exc)

    def miscounts(completions, **kwargs):  # rank 0 one value too many, rank 1 one too few
        return [1.0] * (len(completions) + (1 if rank == 0 else -1))

    try:
        score(_batch(), shard_reward(miscounts))
        out["miscount_error"] = None
    except RewardError as exc:
        out["miscount_error"] = str(exc)

    def exits_on_rank_1(completions, **kwargs):  # a BaseException (SystemExit, some timeout libraries)
        if rank == 1:
            raise SystemExit(3)
        return [0.0] * len(completions)

    try:
        score(_batch(), shard_reward(exits_on_rank_1))
        out["exit_error"] = None
    except (RewardError, SystemExit) as exc:
        out["exit_error"] = f"{type(exc).__name__}: {exc}"
    shutdown()
    return out


@pytest.fixture(scope="module")
def two():
    from rlkit.parallel.local import run_local

    return run_local(_job, 2, timeout=120)


def test_every_rank_gets_every_reward_equal_to_one_process(two):
    for r in two:
        assert r["equal"], r
        expected = [len(t) + float(a) + 10 * len(t) + float(len(t) == int(a)) for t, a in zip(TEXTS, ANSWERS)]
        assert r["rewards"] == pytest.approx(expected)


def test_a_reward_objects_own_attributes_do_not_replace_the_wrappers(two):
    # update_wrapper copied the object's .rank/.size/.fn/.style/.group over the wrapper's: with
    # self.rank = 1 rank 0 scored rank 1's rows, and rows 0-2 got rows 3-4's rewards, silently
    for r in two:
        assert r["object_rewards"] == [float(len(t)) for t in TEXTS]


def test_a_sharded_reward_with_prompts_first_is_called_by_keyword(two):
    for r in two:
        assert r["keyword"] == [float(len(t)) for t in TEXTS]


def test_each_rank_scores_only_its_share(two):
    # 5 rows over 2 ranks: 3 + 2; verl-style rewards are per sample and stay unsplit
    shares = {r["rank"]: r["calls"] for r in two}
    assert shares[0]["trl"] == [3] and shares[1]["trl"] == [2]
    assert shares[0]["batch"] == [3] and shares[1]["batch"] == [2]
    assert len(shares[0]["verl"]) == len(shares[1]["verl"]) == 5


def test_a_reward_failing_on_one_rank_raises_on_both(two):
    by_rank = {r["rank"]: r["error"] for r in two}
    assert by_rank[0] is not None and "failed on rank 1" in by_rank[0] and "boom" in by_rank[0]
    assert by_rank[1] is not None and "boom" in by_rank[1]


def test_a_sharded_reward_error_names_the_failing_sample(two):
    """On one process score names the sample a reward fails on; sharded, the error named only the
    rank. Now the failing rank retries its own rows one by one and every rank's error names the
    sample by its row in the whole batch, with its response."""
    by_rank = {r["rank"]: r for r in two}
    for r in (0, 1):
        assert "ZeroDivisionError" in by_rank[r]["row_error"] and "on sample 3 (prompt 'p', response 'ddd')" in by_rank[r]["row_error"]
    assert "failed on rank 1" in by_rank[0]["row_error"]


def test_a_miscounting_or_exiting_reward_raises_on_every_rank(two):
    """Counts were checked only in total: 4 + 1 and 4 - 1 values passed and trained on misaligned
    rewards. A SystemExit on one rank skipped the gather and hung the other."""
    by_rank = {r["rank"]: r for r in two}
    assert "returned 4 values for the 3 rows it was given" in by_rank[0]["miscount_error"]
    assert "returned 1 values for the 2 rows it was given" in by_rank[1]["miscount_error"]
    assert "failed on rank 1" in by_rank[0]["exit_error"] and "SystemExit" in by_rank[0]["exit_error"]
    assert by_rank[1]["exit_error"] is not None


def test_contiguous_share_covers_every_item_once_in_order():
    from rlkit.parallel.placement import contiguous_share

    for n in range(0, 12):
        for size in range(1, 5):
            shares = [contiguous_share(n, r, size) for r in range(size)]
            assert [i for lo, hi in shares for i in range(lo, hi)] == list(range(n))
            assert all(hi - lo <= -(-n // size) for lo, hi in shares)


def test_a_sharded_reward_decodes_only_its_rows(two):
    """Without text columns score decodes the responses and prompts; under shard_reward each rank
    decodes its own rows only (3 + 2 of 5), where one process decodes all five of each."""
    for r in two:
        assert r["text_equal"], r
        assert r["text_rewards"] == pytest.approx([1 + 2 + 10, 22 + 2 + 20, 3 + 2 + 10, 444 + 2 + 30, 5 + 2 + 10])
        assert r["decoded_single"] == [5, 5]
    shares = {r["rank"]: r["decoded_sharded"] for r in two}
    assert shares[0] == [3, 3] and shares[1] == [2, 2]
