"""DAPO's pieces against plain references, and its short batches (dynamic sampling whose attempts
ran out) trained in the optimizer steps the recipe asks for."""
import pytest
import torch

import rlkit as rk
from rlkit.batch import make_batch
from rlkit.recipes.dapo import keep_informative_groups, overlong_penalty


def test_keep_informative_groups_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    group = torch.randint(0, 6, (40,), generator=g)
    rewards = torch.randint(0, 2, (40,), generator=g).float()
    rewards[group == 2] = 1.0  # a group whose rewards all agree
    batch = make_batch([[3]] * 40, [[4]] * 40, group=group.tolist(), rewards=rewards.tolist())
    kept = keep_informative_groups(batch)
    expected = [i for i in range(40) if len({float(rewards[j]) for j in range(40) if group[j] == group[i]}) > 1]
    assert expected and 2 not in [int(group[i]) for i in expected]
    assert kept["group"].tolist() == [int(group[i]) for i in expected]
    assert kept["rewards"].tolist() == [float(rewards[i]) for i in expected]


def test_overlong_penalty_is_dapos_linear_ramp():
    lengths = torch.tensor([0, 10, 12, 13, 14, 16])
    # max 16, buffer 4: no penalty up to 12 tokens, then -(L - 12) / 4, reaching -1 at 16
    assert overlong_penalty(lengths, 16, 4).tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 16, 4, factor=2.0).tolist() == [0.0, 0.0, 0.0, -0.5, -1.0, -2.0]


def _short_batch_run(n_flat: int, n_prompts: int, mini: int | None, micro: int | None = None):
    """One DAPO step on ``n_prompts`` prompts of which the first ``n_flat`` always get reward 0
    (uninformative groups, dropped) and the rest distinct rewards; one attempt, so the batch stays
    short. Returns the metrics and the optimizer steps taken."""
    task = rk.tasks.arithmetic()
    model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    state = rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer, seed=0)
    prompts = [f"{i}+1=" for i in range(n_prompts)]

    def reward(completions, prompts, **_):
        seen: dict[str, int] = {}
        out = []
        for p in prompts:  # the k-th sample of a prompt gets k (flat prompts: 0)
            k = seen[p] = seen.get(p, -1) + 1
            out.append(0.0 if int(p.split("+")[0]) < n_flat else float(k))
        return out

    recipe = rk.recipes.get("dapo").with_(n=4, max_new_tokens=4, max_attempts=1, overlong_buffer=0,
                                          mini_batch_size=mini, micro_batch_size=micro)
    calls = []
    handle = model.model.layers[0].register_forward_hook(lambda m, a, o: calls.append(1) if torch.is_grad_enabled() else None)
    state, metrics = recipe.step(state, prompts, reward)
    handle.remove()
    steps = {int(s["step"]) for s in state.optimizer.state.values()}
    assert len(steps) == 1
    return metrics, steps.pop(), len(calls)


def test_short_batch_trains_in_whole_mini_batches():
    # 6 prompts x 4 = 24 rows wanted, one flat group: 20 kept; mini-batches of 8 -> 2 steps, 4 rows
    # dropped (it used to train all 20 in one step, mini_batch_size ignored)
    metrics, steps, _ = _short_batch_run(n_flat=1, n_prompts=6, mini=8)
    assert steps == 2
    assert metrics["dapo/trained_rows"] == 16 and metrics["dapo/dropped_rows"] == 4
    assert metrics["dapo/kept_frac"] == pytest.approx(16 / 24)


def test_short_batch_keeps_micro_batches():
    # 20 kept rows, no mini-batches: one step, micro-batches of 8, 8 and 4 (micro_batch_size used to
    # be dropped for a batch it did not divide: one forward/backward of all the rows)
    metrics, steps, forwards = _short_batch_run(n_flat=1, n_prompts=6, mini=None, micro=8)
    assert steps == 1 and forwards == 3
    assert metrics["dapo/trained_rows"] == 20 and metrics["dapo/dropped_rows"] == 0


def test_batch_smaller_than_a_mini_batch_takes_one_step():
    metrics, steps, _ = _short_batch_run(n_flat=5, n_prompts=6, mini=8)  # 4 rows kept
    assert steps == 1 and metrics["dapo/trained_rows"] == 4


def test_mini_batch_must_divide_the_full_batch():
    with pytest.raises(ValueError, match=r"DAPO.mini_batch_size=7 does not divide the batch of 6 prompts x n=4 = 24 rows"):
        _short_batch_run(n_flat=1, n_prompts=6, mini=7)


def test_zero_variance_groups_are_counted_exactly():
    """Identical rewards of 0.7 or 3.3 were counted as varied (E[x^2] - E[x]^2 in float32 > 1e-12)."""
    from rlkit.recipes.base import reward_metrics

    values = [0.7, 3.3, 123.4, 0.0]
    rewards = [v for v in values for _ in range(8)] + [1.0] * 7 + [1.5]  # four flat groups, one varied
    batch = make_batch([[3]] * 40, [[4]] * 40, group=[i // 8 for i in range(40)], rewards=rewards)
    assert reward_metrics(batch)["reward/zero_var_groups"] == pytest.approx(4 / 5)


def _dapo_two_ranks():
    from rlkit.parallel import init_distributed, shutdown

    init_distributed("gloo")
    try:
        task = rk.tasks.arithmetic()
        model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
        recipe = rk.recipes.get("dapo").with_(n=3, max_new_tokens=4, max_attempts=1, overlong_buffer=0)

        def reward(completions, prompts, **_):  # prompt "0+1=" always 0 (dropped), the rest 0, 1, 2 per group
            seen: dict[str, int] = {}
            out = []
            for p in prompts:
                k = seen[p] = seen.get(p, -1) + 1
                out.append(0.0 if p.startswith("0+") else float(k))
            return out

        plan = rk.Pipeline(recipe, reward=reward).lower()
        state = plan.shard(rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer))
        state, metrics = plan.step(state, [f"{i}+1=" for i in range(4)])
        return metrics["dapo/trained_rows"], metrics["dapo/dropped_rows"]
    finally:
        shutdown()


@pytest.mark.distributed
def test_dapo_on_two_ranks_trains_an_even_share():
    """3 informative groups of n=3 are 9 rows: update refused to split them over 2 ranks, at a step
    that depended on the data. They train as 8."""
    from rlkit.parallel.local import run_local

    assert run_local(_dapo_two_ranks, 2, timeout=180) == [(8.0, 1.0)] * 2


def test_a_step_that_kept_no_group_takes_no_optimizer_step():
    """Every attempt flat (reward always 0): DAPO used to train the first rollout anyway, whose
    advantages are all zero, and Adam's momentum from the step before moved the weights
    (max |dW| 6.7e-3 at lr 1e-2), while kept_frac said 1/max_attempts and trained_rows the batch.
    Now the step is skipped: weights, optimizer and schedule as they were, the step counted."""
    task = rk.tasks.arithmetic()
    model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    spec = rk.optim.adamw(lr=1e-2, warmup_steps=0, total_steps=10, schedule="cosine")
    state = rk.init(model, spec, tokenizer=task.tokenizer, seed=0)
    prompts = [f"{i}+1=" for i in range(3)]
    recipe = rk.recipes.get("dapo").with_(n=4, max_new_tokens=4, max_attempts=3, overlong_buffer=0)
    varied = lambda completions, **_: [float(i % 4) for i in range(len(completions))]  # noqa: E731
    state, first = recipe.step(state, prompts, varied)  # a real step: Adam has momentum now
    assert first["dapo/skipped_steps"] == 0.0 and first["dapo/trained_rows"] == 12
    weights = {k: v.detach().clone() for k, v in state.actor.named_parameters()}
    lr, version = state.optimizer.param_groups[0]["lr"], state.policy_version
    adam_steps = {int(s["step"]) for s in state.optimizer.state.values()}

    flat = lambda completions, **_: [0.0] * len(completions)  # noqa: E731
    old = state
    state, metrics = recipe.step(state, prompts, flat)
    assert state.step == 2 and state.policy_version == version
    assert all(torch.equal(v, weights[k]) for k, v in state.actor.named_parameters())
    assert state.optimizer.param_groups[0]["lr"] == lr
    assert {int(s["step"]) for s in state.optimizer.state.values()} == adam_steps
    assert metrics["dapo/skipped_steps"] == 1.0 and metrics["dapo/attempts"] == 3.0
    assert metrics["dapo/kept_frac"] == 0.0 and metrics["dapo/trained_rows"] == 0.0
    assert metrics["reward/mean"] == 0.0 and "rollout/tokens" in metrics
    with pytest.raises(Exception, match="donated"):
        old.actor  # noqa: B018 - one live handle of the weights, as after an update
