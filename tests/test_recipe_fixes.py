"""Recipes, advantage() and the registries: an aggregation a custom loss cannot receive is refused;
Dr. GRPO's aggregation given as a function keeps its constant horizon; DAPO's dynamic sampling
filters on the verifier's reward (the overlong penalty shapes only the groups kept) and the CLI
job's overlong buffer touches only responses at the length limit; an estimator's return is
checked against its contract; a re-run notebook cell re-registers its function."""
import copy
import types

import pytest
import torch

import rlkit as rk
from rlkit.algos import AGGREGATIONS, KL_PENALTIES, POLICY_LOSSES
from rlkit.algos.advantages import ADVANTAGE_ESTIMATORS
from rlkit.algos.losses import seq_mean_token_sum_norm, token_mean
from rlkit.batch import BatchError, make_batch

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    task = rk.tasks.arithmetic(digits=2)
    model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1)
    return task, model


def _pg_loss(tiny, batch, **update_kw):
    task, model = tiny
    state = rk.init(copy.deepcopy(model), rk.optim.adamw(lr=1e-9), tokenizer=task.tokenizer)
    # the canned batch's log-probs are not the tiny model's: no staleness warning wanted
    return rk.update(state, batch, max_logprob_gap=None, **update_kw)[1]["actor/pg_loss"]


def _batch(tiny, estimator):
    task, _ = tiny
    b = make_batch([[1, 5, 6], [1, 5, 6], [1, 8], [1, 8]], [[10, 11, 12, 3], [4], [5, 6], [4, 4, 4]],
                   group=[0, 0, 1, 1], rewards=[1.0, 0.0, 0.0, 1.0], pad_token_id=task.tokenizer.pad_token_id,
                   logprobs=[[-1.0] * n for n in (4, 1, 2, 3)])
    return rk.advantage(b, estimator)


# --- 1. an aggregation the custom loss cannot receive ------------------------------------------


def my_pg(logprobs, old_logprobs, advantages, response_mask, *, num_tokens=None):
    ratio = torch.exp(logprobs - old_logprobs)
    return -(ratio * advantages * response_mask).sum() / num_tokens, {}


def my_pg_agg(logprobs, old_logprobs, advantages, response_mask, *, agg="token-mean", **norm):
    ratio = torch.exp(logprobs - old_logprobs)
    return rk.algos.aggregate(-ratio * advantages, response_mask, agg, **norm), {}


def test_recipe_refuses_an_agg_the_custom_loss_cannot_receive(tiny, monkeypatch):
    with pytest.raises(ValueError, match=r"GRPO: agg='seq-mean-token-sum' cannot reach the policy loss 'my_pg'.*"
                                         r"Add an 'agg' parameter to my_pg.*or drop agg"):
        rk.recipes.get("grpo").with_(loss=my_pg, agg="seq-mean-token-sum")
    with pytest.raises(ValueError, match="cannot reach the policy loss 'my_pg'"):
        rk.recipes.drgrpo(loss=my_pg)  # Dr. GRPO's constant-normaliser sum would be dropped
    with pytest.raises(ValueError, match="cannot reach the policy loss 'my_pg'"):
        rk.recipes.DAPO(loss=my_pg, loss_kw={}, agg="seq-mean-token-mean")
    monkeypatch.setattr(POLICY_LOSSES, "_fns", dict(POLICY_LOSSES._fns))
    POLICY_LOSSES.register("my_pg_by_name")(my_pg)
    with pytest.raises(ValueError, match="cannot reach the policy loss 'my_pg'"):
        rk.recipes.GRPO(loss="my_pg_by_name", agg="seq-mean-token-sum")
    # accepted: no agg asked for, the recipe's own default, or a loss that takes agg
    assert rk.recipes.GRPO(loss=my_pg).agg is None
    assert rk.recipes.DAPO(loss=my_pg, loss_kw={}).agg == "token-mean"
    recipes = {agg: rk.recipes.GRPO(loss=my_pg_agg, agg=agg, max_new_tokens=4) for agg in ("token-mean", "seq-mean-token-sum")}
    # ... and the loss then really aggregates as asked: at ratio 1 (old="current") it is ppo_clip's
    # -advantage under the same aggregation, which differs between the two
    batch = _batch(tiny, "grpo")
    losses = {}
    for agg, recipe in recipes.items():
        losses[agg] = _pg_loss(tiny, batch, **recipe.update_kwargs(), old="current")
        assert losses[agg] == pytest.approx(_pg_loss(tiny, batch, loss="ppo_clip", agg=agg, old="current"), rel=1e-5)
    assert losses["token-mean"] != pytest.approx(losses["seq-mean-token-sum"])


# --- 2. Dr. GRPO's aggregation as a function -----------------------------------------------------


def test_agg_as_the_registered_function_keeps_dr_grpo_horizon(tiny):
    by_name = rk.recipes.GRPO(estimator="drgrpo", agg="seq-mean-token-sum-norm", max_new_tokens=16)
    by_fn = rk.recipes.GRPO(estimator="drgrpo", agg=seq_mean_token_sum_norm, max_new_tokens=16)
    assert by_name.update_kwargs()["horizon"] == by_fn.update_kwargs()["horizon"] == 16
    batch = _batch(tiny, "drgrpo")  # width 4: the batch's own width would scale the loss by 16 / 4
    loss_name = _pg_loss(tiny, batch, **by_name.update_kwargs())
    assert _pg_loss(tiny, batch, **by_fn.update_kwargs()) == pytest.approx(loss_name, rel=1e-6)
    assert loss_name == pytest.approx(_pg_loss(tiny, batch, loss="ppo_clip", agg="seq-mean-token-sum-norm", horizon=16), rel=1e-6)

    def my_norm(loss_mat, mask, *, num_tokens=None, num_seqs=None, horizon=None):  # a user's copy
        return (loss_mat * mask).sum() / (horizon if horizon is not None else mask.shape[-1])

    mine = rk.recipes.GRPO(estimator="drgrpo", agg=my_norm, max_new_tokens=16)
    assert mine.update_kwargs()["horizon"] == 16
    assert _pg_loss(tiny, batch, **mine.update_kwargs()) == pytest.approx(loss_name, rel=1e-5)
    # the built-ins that ignore horizon leave the update's default, whether named or passed as functions
    assert rk.recipes.GRPO(agg=token_mean).update_kwargs()["horizon"] is None
    assert rk.recipes.GRPO(agg="token-mean").update_kwargs()["horizon"] is None


# --- 3. DAPO: dynamic sampling on the verifier's reward; the job's overlong buffer ----------------

CORRECT = [[0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]  # all wrong, all right, mixed
LENGTHS = [[3, 3, 4, 3], [3, 4, 3, 3], [2, 3, 4, 5]]


class _Canned(rk.recipes.DAPO):
    """DAPO.step on a constructed rollout: 3 prompts x 4 samples with the lengths and rewards above."""

    def sample(self, state, prompts, **kw):
        resp = [[7] * n for row in LENGTHS for n in row]
        return make_batch([[1, 2]] * 12, resp, group=[g for g in range(3) for _ in range(4)],
                          logprobs=[[-1.0] * n for n in (n for row in LENGTHS for n in row)])

    def score(self, state, batch, reward):
        batch.set("rewards", torch.tensor([float(c) for row in CORRECT for c in row]))
        return batch


def test_dapo_keeps_groups_by_the_verifier_reward_and_shapes_them_with_the_penalty(monkeypatch):
    import rlkit.recipes.dapo as dapo

    seen = {}

    def fake_update(state, batch, **kw):
        seen["batch"] = batch
        return state, {}

    monkeypatch.setattr(dapo, "update", fake_update)
    recipe = _Canned(n=4, max_new_tokens=5, overlong_buffer=4, max_attempts=1)
    state = types.SimpleNamespace(seed=0, step=0, _cache={})
    _, metrics = recipe.step(state, ["a", "b", "c"], reward=None)
    trained = seen["batch"]
    # the paper's rule, 0 < #correct < G: only the mixed group; the length penalty alone made the
    # all-wrong and all-right groups (lengths 3, 3, 4, 3) look informative
    keep = [g for g, row in enumerate(CORRECT) if 0 < sum(row) < len(row)]
    assert keep == [2] and sorted(set(trained["group"].tolist())) == [0]  # concat renumbers the kept group
    pen = dapo.overlong_penalty(torch.tensor(LENGTHS[2]), 5, 4)
    shaped = torch.tensor(CORRECT[2], dtype=torch.float32) + pen
    assert trained["rewards"].tolist() == pytest.approx(shaped.tolist())  # the penalty still shapes the kept group
    adv = (shaped - shaped.mean()) / (shaped.std() + 1e-6)
    assert trained["advantages"][:, 0].tolist() == pytest.approx(adv.tolist(), abs=1e-5)
    assert metrics["dapo/trained_rows"] == 4
    assert metrics["reward/mean"] == pytest.approx(5 / 12)  # the verifier's reward, as other recipes report
    assert metrics["reward/zero_var_groups"] == pytest.approx(2 / 3)


def test_cli_job_overlong_buffer_spares_every_answer_that_fits(monkeypatch):
    """The job built dapo with max_new_tokens = 5 and the default buffer of 4: the penalty ramped
    from length 1, so every answer of the task was penalised."""
    import rlkit.loop
    from rlkit.jobs import run_task
    from rlkit.recipes.dapo import overlong_penalty

    class Built(Exception):
        pass

    def capture(state, recipe, *a, **kw):
        raise Built(recipe)

    monkeypatch.setattr(rlkit.loop, "fit", capture)
    with pytest.raises(Built) as caught:
        run_task("arithmetic", {"algo": "dapo", "sft_steps": 0, "steps": 1, "batch_size": 2, "n": 2, "eval_size": 1,
                                "eval_every": 0, "quiet": True})
    recipe = caught.value.args[0]
    task = rk.tasks.arithmetic()
    assert recipe.max_new_tokens == task.max_new_tokens == 5
    longest = len(str(99 + 99))  # the longest answer of 2-digit sums
    fits = torch.arange(1, longest + 2)  # every right answer with its EOS: 1..4 tokens
    assert (overlong_penalty(fits, recipe.max_new_tokens, recipe.overlong_buffer, recipe.overlong_factor) == 0).all()
    assert overlong_penalty(torch.tensor([5]), recipe.max_new_tokens, recipe.overlong_buffer, recipe.overlong_factor).item() < 0


# --- 4. the estimator's return --------------------------------------------------------------------


def _four():
    return make_batch([[1, 2]] * 4, [[3, 4, 5]] * 4, group=[0] * 4, rewards=[0.0, 1.0, 0.0, 1.0])


def test_estimator_return_is_checked_against_the_contract():
    def one_tensor(token_rewards, response_mask):
        return token_rewards * response_mask

    def seq_returns(token_rewards, response_mask):
        return token_rewards, token_rewards.sum(-1)

    def three(token_rewards, response_mask):
        return token_rewards, token_rewards, token_rewards

    for rows in (4, 2):
        batch = make_batch([[1, 2]] * rows, [[3, 4, 5]] * rows, group=[0] * rows, rewards=[float(i % 2) for i in range(rows)])
        with pytest.raises(TypeError, match=rf"estimator 'one_tensor' returned a tensor of shape \({rows}, 3\); it must return "
                                            rf"\(advantages, returns\): two tensors of the response mask's shape \(b t\) = \({rows}, 3\)"):
            rk.advantage(batch, one_tensor)
    with pytest.raises(BatchError, match=r"estimator 'seq_returns' returned returns of shape \(4,\); it must return \(advantages, returns\)"):
        rk.advantage(_four(), seq_returns)
    with pytest.raises(TypeError, match=r"estimator 'three' returned a tuple of 3"):
        rk.advantage(_four(), three)
    good = rk.advantage(_four(), lambda token_rewards, response_mask: (token_rewards, 2 * token_rewards))
    assert good["returns"].tolist() == (2 * good["advantages"]).tolist()


# --- 5. re-registering -----------------------------------------------------------------------------


@pytest.fixture
def scratch(monkeypatch):
    for reg in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_PENALTIES, AGGREGATIONS):
        monkeypatch.setattr(reg, "_fns", dict(reg._fns))


CELL = '''
import rlkit as rk

def median_baseline(token_rewards, response_mask, group, *, scale=1.0):
    adv = SIGN * scale * token_rewards.sum(-1, keepdim=True) * response_mask
    return adv, adv

rk.algos.ADVANTAGE_ESTIMATORS.register("median")(median_baseline)
'''


def test_rerun_notebook_cell_replaces_the_registered_function(scratch):
    batch = _four()
    cell = {"__name__": "__main__"}
    exec(CELL.replace("SIGN", "1.0"), cell)  # the cell, run once
    first = cell["median_baseline"]
    assert rk.advantage(batch, "median")["advantages"][:, 0].tolist() == [0.0, 1.0, 0.0, 1.0]
    exec(CELL.replace("SIGN", "-1.0"), cell)  # edited and run again: refused before
    assert ADVANTAGE_ESTIMATORS.get("median") is cell["median_baseline"] is not first
    assert rk.advantage(batch, "median")["advantages"][:, 0].tolist() == [0.0, -1.0, 0.0, -1.0]


def test_a_different_function_under_a_taken_name_needs_override(scratch):
    def other(token_rewards, response_mask):
        return token_rewards, token_rewards

    def grpo(token_rewards, response_mask):  # a user's function that shares a built-in's name
        return -token_rewards, -token_rewards

    ADVANTAGE_ESTIMATORS.register("mine")(other)
    with pytest.raises(ValueError, match=r"'mine' is already registered to .*other.*choose another name, or pass "
                                         r"override=True to replace it"):
        ADVANTAGE_ESTIMATORS.register("mine")(lambda token_rewards, response_mask: (token_rewards, token_rewards))
    with pytest.raises(ValueError, match=r"'grpo' is already registered to grpo \(module rlkit.algos.advantages\).*override=True"):
        ADVANTAGE_ESTIMATORS.register("grpo")(grpo)
    with pytest.raises(ValueError, match="already registered"):
        ADVANTAGE_ESTIMATORS.register(grpo)  # the bare form too
    assert ADVANTAGE_ESTIMATORS.get("grpo") is rk.algos.advantages.grpo
    assert ADVANTAGE_ESTIMATORS.register("grpo", override=True)(grpo) is grpo
    assert ADVANTAGE_ESTIMATORS.get("grpo") is grpo
    assert rk.advantage(_four(), "grpo")["advantages"][:, -1].tolist() == [0.0, -1.0, 0.0, -1.0]

    # two lambdas of one module share the qualname '<lambda>': never taken for the same function
    first = lambda x: x  # noqa: E731
    second = lambda x: -x  # noqa: E731
    KL_PENALTIES.register("lam")(first)
    with pytest.raises(ValueError, match="'lam' is already registered"):
        KL_PENALTIES.register("lam")(second)
    assert KL_PENALTIES.get("lam") is first
