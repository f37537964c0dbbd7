"""The pipeline lowered onto 2 processes (FSDP2 over gloo) computes what 1 process computes.

Each 2-process job runs through ``rlkit.parallel.local.run_local``; the 1-process reference runs
here. The same recipe code runs in both: only the lowering differs.
"""
from __future__ import annotations

import copy

import pytest
import torch

import rlkit as rk

pytestmark = pytest.mark.distributed


def _task():
    return rk.tasks.arithmetic(n_train=64, n_test=8)


def _model(task, seed=0, heads=2, kv_heads=1):
    return rk.models.tiny(task.tokenizer, seed=seed, hidden_size=64, intermediate_size=128,
                          num_attention_heads=heads, num_key_value_heads=kv_heads)


def _spec():
    # eps=1: Adam's first step ~ lr * g, so a comparison measures gradients, not float-noise signs
    return rk.optim.adamw(lr=1e-2, eps=1.0, weight_decay=0.0)


def _critic_spec():
    # the critic's own learning rate: lowering rebuilt the critic's optimizer from the actor's spec
    return rk.optim.adamw(lr=3e-2, eps=1.0, weight_decay=0.0)


def _batch(model, task, with_critic_fields=False):
    """A fixed global batch: 8 rows (2 groups of 4) with uneven response lengths."""
    from rlkit.batch import make_batch
    from rlkit.transforms.forward import model_logprobs

    g = torch.Generator().manual_seed(3)
    prompts = [task.train.ids[i] for i in range(2) for _ in range(4)]
    responses = [torch.randint(4, 19, (int(k),), generator=g).tolist() for k in [1, 5, 3, 6, 2, 2, 4, 1]]
    batch = make_batch(prompts, responses, group=[0] * 4 + [1] * 4, rewards=[1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    # behaviour log-probs a little off the training forward's, more so for later rows (as an
    # engine's would be): the train-vs-rollout gap and its max differ between the ranks' halves
    lp = model_logprobs(model, batch)[0]
    batch.set("logprobs", lp + 0.01 * torch.arange(len(prompts))[:, None] * batch["response_mask"])
    batch = rk.advantage(batch, "grpo")
    if with_critic_fields:
        batch.set("values", 0.1 * torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"])
        batch.set("returns", torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"])
    return batch


def _full(module):
    from rlkit.parallel import full_state_dict

    return full_state_dict(module)


def _update_worker(with_critic: bool, divergent_keep: bool = False):
    from rlkit.models import logprobs as L
    from rlkit.parallel import init_distributed, shutdown

    info = init_distributed("gloo")
    if divergent_keep:
        # KEEP_LOGITS="auto" decides per rank from that device's free memory, so ranks can
        # differ: rank 0 keeps its logits for the backward, rank 1 recomputes the head there
        # (every chunk checkpointed). The head belongs to the root FSDP unit, whose parameters
        # stay gathered through the backward, so neither choice issues a collective.
        L.CHECKPOINT_MIN_LOGITS = 0
        L.KEEP_LOGITS = info.rank == 0
    calls = []
    real = L.checkpoint
    L.checkpoint = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        task = _task()
        model = _model(task)
        critic = rk.models.critic(model) if with_critic else None
        batch = _batch(model, task, with_critic)
        state = rk.init(model, _spec(), tokenizer=task.tokenizer, critic=critic, ref="copy", critic_optimizer=_critic_spec())
        plan = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower()
        state = plan.shard(state)
        state, metrics = rk.update(state, batch, kl=("low_var_kl", 0.1), micro_batch_size=2)
        actor = _full(state._cache["actor_module"])
        crit = _full(state._cache["critic_module"]) if with_critic else None
        return {"actor": actor, "critic": crit, "metrics": metrics, "checkpointed_chunks": len(calls)}
    finally:
        L.checkpoint = real
        shutdown()


def _strip(sd, prefix):
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


@pytest.mark.parametrize("with_critic, divergent_keep", [(False, False), (True, False), (False, True)],
                         ids=["grpo", "ppo", "grpo-ranks-differ-on-keeping-logits"])
def test_update_on_two_processes_equals_one(with_critic, divergent_keep):
    from rlkit.parallel.local import run_local

    results = run_local(_update_worker, 2, with_critic, divergent_keep, timeout=240)
    if divergent_keep:
        assert results[0]["checkpointed_chunks"] == 0 and results[1]["checkpointed_chunks"] > 0, results
    task = _task()
    model = _model(task)
    critic = rk.models.critic(model) if with_critic else None
    batch = _batch(model, task, with_critic)
    state = rk.init(model, _spec(), tokenizer=task.tokenizer, critic=critic, ref="copy", critic_optimizer=_critic_spec())
    state, metrics = rk.update(state, batch, kl=("low_var_kl", 0.1), micro_batch_size=4)
    got = _strip(results[0]["actor"], "model.")
    assert got, results[0]["actor"].keys()
    for name, ref in state.actor.state_dict().items():
        torch.testing.assert_close(got[name], ref, atol=2e-6, rtol=1e-5, msg=name)
    if with_critic:
        got_c = _strip(results[0]["critic"], "critic.") or _strip(results[0]["critic"], "model.")
        for name, ref in state.critic.state_dict().items():
            torch.testing.assert_close(got_c[name], ref, atol=2e-6, rtol=1e-5, msg=name)
        assert results[0]["metrics"]["critic/vf_loss"] == pytest.approx(metrics["critic/vf_loss"], rel=1e-5)
    # losses are summed over ranks: the reported value is the global one
    assert results[0]["metrics"]["actor/pg_loss"] == pytest.approx(metrics["actor/pg_loss"], abs=1e-6)
    assert results[1]["metrics"]["actor/pg_loss"] == pytest.approx(metrics["actor/pg_loss"], abs=1e-6)
    # every reported metric is the global one on each rank, the train-vs-rollout gap (a sum) and
    # its max (a max over ranks) included
    assert "actor/logprob_gap" in metrics and "actor/logprob_gap_max" in metrics
    for r in results:
        assert set(r["metrics"]) == set(metrics)
        for key, value in metrics.items():
            assert r["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


MINI = dict(mini_batch_size=4, micro_batch_size=1, epochs=2, shuffle=True)


def _mini_batch_worker():
    from rlkit.parallel import init_distributed, shutdown

    init_distributed("gloo")
    try:
        task = _task()
        model = _model(task)
        batch = _batch(model, task)
        state = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower().shard(rk.init(model, _spec(), tokenizer=task.tokenizer))
        state, metrics = rk.update(state, batch, **MINI)
        return {"actor": _full(state._cache["actor_module"]), "metrics": metrics}
    finally:
        shutdown()


def test_mini_batches_and_their_shuffle_on_two_processes_equal_one():
    """Mini-batches are formed (and shuffled) over the global batch, then split over the ranks.
    The batch used to be split first: mini-batch 0 was rows {0, 1, 4, 5} instead of 0-3, and each
    rank shuffled its own half, so parameters differed by 3e-4 and the metrics too."""
    from rlkit.parallel.local import run_local

    results = run_local(_mini_batch_worker, 2, timeout=240)
    task = _task()
    model = _model(task)
    state, metrics = rk.update(rk.init(model, _spec(), tokenizer=task.tokenizer), _batch(model, task), **MINI)
    got = _strip(results[0]["actor"], "model.")
    for name, ref in state.actor.state_dict().items():
        torch.testing.assert_close(got[name], ref, atol=2e-6, rtol=1e-5, msg=name)
    for r in results:
        for key, value in metrics.items():
            assert r["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def _rollout_worker():
    from rlkit.parallel import init_distributed, shutdown

    init_distributed("gloo")
    try:
        task = _task()
        model = _model(task)
        state = rk.init(model, _spec(), tokenizer=task.tokenizer)
        plan = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower()
        state = plan.shard(state)
        prompts = task.train.batch_at(0, 4, shuffle=False)
        before = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
        sampled = rk.rollout(state, prompts, n=3, max_new_tokens=6, temperature=1.0, top_k=6)
        state, _ = rk.update(state, _batch(_model(task), task))
        after = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
        return {k: b[k].clone() for b, k in [(before, "response_ids"), (before, "group")]} | {
            "after_ids": after["response_ids"].clone(), "sync": rk.rollout_metrics(after),
            "sampled_ids": sampled["response_ids"].clone(), "sampled_logprobs": sampled["logprobs"].clone(),
        }
    finally:
        shutdown()


def test_rollout_on_two_replicas_equals_one_process():
    """Prompts split over 2 generation replicas and gathered == one process, before and after an
    update (which moves the new weights into the generation layout); sampled too: each replica
    draws the whole batch's noise from the step's key and keeps its rows' (the replicas folded
    their index into the key, so 2 processes sampled other responses than one)."""
    from rlkit.parallel.local import run_local

    results = run_local(_rollout_worker, 2, timeout=240)
    task = _task()
    state = rk.init(_model(task), _spec(), tokenizer=task.tokenizer)
    prompts = task.train.batch_at(0, 4, shuffle=False)
    before = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
    sampled = rk.rollout(state, prompts, n=3, max_new_tokens=6, temperature=1.0, top_k=6)
    assert len({tuple(row.tolist()) for row in sampled["response_ids"]}) > 4  # varied samples, not one answer
    state, _ = rk.update(state, _batch(_model(task), task))
    after = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
    for r in results:
        assert torch.equal(r["sampled_ids"], sampled["response_ids"])
        torch.testing.assert_close(r["sampled_logprobs"], sampled["logprobs"], rtol=0, atol=1e-5)
        assert torch.equal(r["response_ids"], before["response_ids"])
        assert r["group"].tolist() == before["group"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        width = after["response_ids"].shape[1]
        assert torch.equal(r["after_ids"][:, :width], after["response_ids"])
        assert r["sync"]["sync/bytes"] > 0  # the weights really moved
        # the gathered batch's count on every rank (each rank reported its own replica's share)
        assert r["sync"]["rollout/tokens"] == float(after["response_mask"].sum())


def test_local_lowering_is_the_identity():
    task = _task()
    model = _model(task)
    state = rk.init(model, _spec(), tokenizer=task.tokenizer)
    plan = rk.Pipeline(rk.recipes.get("grpo").with_(n=4, max_new_tokens=4), reward=task.reward).lower()
    assert plan.is_local and plan.shard(state) is state
    twin = rk.init(copy.deepcopy(model), _spec(), tokenizer=task.tokenizer)
    prompts = task.train.batch_at(0, 4)
    s1, m1 = plan.step(state, prompts)
    s2, m2 = rk.recipes.get("grpo").with_(n=4, max_new_tokens=4).step(twin, prompts, task.reward)
    for (k, a), b in zip(s1.actor.state_dict().items(), s2.actor.state_dict().values()):
        assert torch.equal(a, b), k


def _ranks(*ranks):
    """A stand-in DeviceMesh over ``ranks`` (what Placement reads of one): placement checks
    without a process group."""
    from types import SimpleNamespace

    return SimpleNamespace(mesh=torch.tensor(ranks))


def test_lower_under_a_launcher_needs_the_process_group(monkeypatch):
    """Under torchrun or rk.launch without init_distributed(), every rank lowered to a local plan
    and trained the whole batch alone (writing the same checkpoints) without a word."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 .*not initialised; call rk.parallel.init_distributed\(\) first"):
        rk.Pipeline("grpo", reward=lambda completions, **_: [0.0] * len(completions)).lower()


def test_lower_rejects_what_is_not_a_placement():
    from rlkit.parallel import Placement, local_placement

    pipe = rk.Pipeline(rk.recipes.get("grpo"), reward=lambda completions, **_: [0.0] * len(completions))
    for wrong in ({"actor": 1, "rollout": 1}, 2, "actor"):
        with pytest.raises(TypeError, match="placement must be None .*DeviceMesh.*split_placement"):
            pipe.lower(wrong)
    assert pipe.lower(local_placement()).is_local and pipe.lower(None).is_local
    both = Placement({"actor": _ranks(0, 1), "rollout": _ranks(0, 1)})
    assert pipe.lower(both).placement is both


def test_lower_checks_tp():
    from rlkit.parallel import Placement

    pipe = rk.Pipeline(rk.recipes.get("grpo"), reward=lambda completions, **_: [0.0] * len(completions))
    for wrong in (0, -1, "2", 2.0, True):
        with pytest.raises(ValueError, match="tp must be a positive int"):
            pipe.lower(tp=wrong)
    # one process: there is nothing to split the rollout over, so tp=2 cannot be honoured
    with pytest.raises(ValueError, match="tp=2 cannot apply.*one process"):
        pipe.lower(tp=2)
    with pytest.raises(ValueError, match="tp=2 cannot apply.*3 rank"):
        pipe.lower(Placement({"actor": _ranks(0, 1, 2), "rollout": _ranks(0, 1, 2)}), tp=2)
    with pytest.raises(NotImplementedError, match="split placement"):
        pipe.lower(Placement({"actor": _ranks(0, 1), "rollout": _ranks(2, 3)}), tp=2)
    assert pipe.lower(Placement({"actor": _ranks(0, 1), "rollout": _ranks(0, 1)}), tp=2).tp == 2
    assert pipe.lower(tp=1).tp == 1
    with pytest.raises(TypeError, match="rollout_dtype"):
        pipe.lower(rollout_dtype="bfloat16")


def test_pipeline_checks_its_step_and_reward():
    def reward(completions, **_):
        return [0.0] * len(completions)

    recipe = rk.recipes.get("grpo")
    # a recipe name is that recipe, with its defaults
    by_name = rk.Pipeline("grpo", reward=reward)
    assert type(by_name.step) is type(recipe) and by_name.step == recipe
    assert rk.Pipeline("dapo", reward).step == rk.recipes.get("dapo")
    with pytest.raises(ValueError, match="unknown algorithm 'grpoo'"):
        rk.Pipeline("grpoo", reward=reward)
    with pytest.raises(TypeError, match="step must be a recipe"):
        rk.Pipeline(3, reward=reward)
    for wrong in (None, "accuracy", 1.0):
        with pytest.raises(TypeError, match="reward must be a reward function"):
            rk.Pipeline(recipe, reward=wrong)
    assert rk.Pipeline(recipe, reward="exact_match").reward == "exact_match"  # a built-in's name, as rk.score takes it
    with pytest.raises(TypeError, match=r"order is Pipeline\(step, reward\)"):
        rk.Pipeline(reward, recipe)
    # what rk.score takes still goes: a function, a list of them, a dict of them; and a step function
    for ok in (reward, [reward, reward], {"r": reward}):
        assert rk.Pipeline(recipe, reward=ok).reward is ok
    assert rk.Pipeline(recipe.step, reward)._fn() == recipe.step
    # a recipe class or factory looked like a step function and failed at the first step
    for uncalled, fix in ((rk.recipes.GRPO, r"rk.recipes.GRPO\(...\)"), (rk.recipes.drgrpo, r"rk.recipes.drgrpo\(...\)")):
        with pytest.raises(TypeError, match=fix):
            rk.Pipeline(uncalled, reward)
    task = _task()
    with pytest.raises(TypeError, match=r"fit: rk.recipes.rloo makes a recipe"):
        rk.fit(rk.init(_model(task), _spec(), tokenizer=task.tokenizer), rk.recipes.rloo, reward, task.train, steps=1, batch_size=4)


def _split_worker():
    from rlkit.parallel import full_state_dict, init_distributed, shutdown, split_placement

    init_distributed("gloo")
    try:
        task = _task()
        state = rk.init(_model(task), _spec(), tokenizer=task.tokenizer)
        placement = split_placement({"actor": 1, "rollout": 1})  # actor on rank 0, rollout on rank 1
        plan = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower(placement)
        state = plan.shard(state)
        prompts = task.train.batch_at(0, 4, shuffle=False)
        before = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
        state, metrics = rk.update(state, _batch(_model(task), task))
        after = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
        actor = full_state_dict(state._cache["actor_module"]) if "actor_module" in state._cache else None
        return {"before": before["response_ids"].clone(), "after": after["response_ids"].clone(), "actor": actor,
                "sync": rk.rollout_metrics(after), "metrics": metrics, "version": state.policy_version}
    finally:
        shutdown()


def _digits(completions, **_):  # dense, so every step trains
    return [min(3, sum(ch.isdigit() for ch in c)) / 3 for c in completions]


def _split_fit_worker(directory, stop):
    from rlkit.parallel import init_distributed, shutdown, split_placement

    init_distributed("gloo")
    try:
        task = _task()
        recipe = rk.recipes.get("grpo").with_(n=4, max_new_tokens=4)
        plan = rk.Pipeline(recipe, reward=_digits).lower(split_placement({"actor": 1, "rollout": 1}))
        state = plan.shard(rk.init(_model(task), _spec(), tokenizer=task.tokenizer))
        ckpt = rk.Checkpointer(directory, every=2, save_on_sigterm=False)
        state = ckpt.resume(state, "auto")
        start = state.step
        state, history = plan.fit(state, task.train, steps=stop, batch_size=4, checkpointer=ckpt)
        actor = _full(state._cache["actor_module"]) if "actor_module" in state._cache else None
        return {"start": start, "actor": actor, "history": history}
    finally:
        shutdown()


def test_split_placement_resumes_what_it_saved(tmp_path):
    """The generation rank saved its untrained actor copy too, and DCP wrote part of the actor from
    it: a resumed split run got initial weights for about half the tensors (1.4e-3 off)."""
    from rlkit.parallel.local import run_local

    run_local(_split_fit_worker, 2, str(tmp_path), 2, timeout=240)
    resumed = run_local(_split_fit_worker, 2, str(tmp_path), 4, timeout=240)
    assert [r["start"] for r in resumed] == [2, 2]
    task = _task()
    state, history = rk.fit(rk.init(_model(task), _spec(), tokenizer=task.tokenizer), rk.recipes.get("grpo").with_(n=4, max_new_tokens=4),
                            _digits, task.train, steps=4, batch_size=4)
    assert any(h["actor/grad_norm"] > 0 for h in history[2:])
    got = _strip(resumed[0]["actor"], "model.")
    for name, ref in state.actor.state_dict().items():
        torch.testing.assert_close(got[name], ref, atol=1e-6, rtol=1e-5, msg=name)
    for mine, theirs in zip(resumed[0]["history"], history[2:]):
        assert mine["actor/grad_norm"] == pytest.approx(theirs["actor/grad_norm"], rel=1e-4)


def _evaluate_worker():
    from rlkit.parallel import init_distributed, shutdown

    init_distributed("gloo")
    try:
        task = _task()
        model = _model(task)
        state = rk.Pipeline("grpo", reward=_digits).lower().shard(rk.init(model, _spec(), tokenizer=task.tokenizer))
        state, _ = rk.update(state, _batch(_model(task), task))
        return rk.evaluate(state, task.tokenizer, task.test, _digits, max_new_tokens=6)
    finally:
        shutdown()


def test_evaluate_takes_a_lowered_state():
    """evaluate(state) built its engine from the FSDP shards: 'weight ... is a DTensor (sharded)',
    so a user's eval_fn had no supported path on several processes."""
    from rlkit.parallel.local import run_local

    results = run_local(_evaluate_worker, 2, timeout=240)
    task = _task()
    state = rk.init(_model(task), _spec(), tokenizer=task.tokenizer)
    state, _ = rk.update(state, _batch(_model(task), task))
    expected = rk.evaluate(state, task.tokenizer, task.test, _digits, max_new_tokens=6)
    for r in results:
        assert r == pytest.approx(expected)


def test_split_placement_actor_and_rollout_on_different_ranks():
    """Actor (FSDP) on rank 0, rollout engine on rank 1: weights reach rank 1 by collectives after
    the update; tokens and parameters equal the single-process run."""
    from rlkit.parallel.local import run_local

    results = run_local(_split_worker, 2, timeout=240)
    task = _task()
    state = rk.init(_model(task), _spec(), tokenizer=task.tokenizer)
    prompts = task.train.batch_at(0, 4, shuffle=False)
    before = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
    state, metrics = rk.update(state, _batch(_model(task), task))
    after = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
    for r in results:
        assert torch.equal(r["before"], before["response_ids"])
        width = after["response_ids"].shape[1]
        assert torch.equal(r["after"][:, :width], after["response_ids"])
        assert r["version"] == 1
        assert r["metrics"]["actor/pg_loss"] == pytest.approx(metrics["actor/pg_loss"], abs=1e-6)
    assert results[1]["actor"] is None
    # every rank's batch reports what the generation rank received (the training rank, whose
    # metrics a fit logs, read 0 bytes before: it receives nothing)
    assert results[0]["sync"]["sync/bytes"] == results[1]["sync"]["sync/bytes"] > 0
    got = _strip(results[0]["actor"], "model.")
    for name, ref in state.actor.state_dict().items():
        torch.testing.assert_close(got[name], ref, atol=2e-6, rtol=1e-5, msg=name)


def _split_load_worker(path):
    from rlkit.parallel import init_distributed, shutdown, split_placement

    init_distributed("gloo")
    try:
        task = _task()
        plan = rk.Pipeline(rk.recipes.get("grpo"), reward=_digits).lower(split_placement({"actor": 1, "rollout": 1}))
        state = plan.shard(rk.init(_model(task, seed=0), _spec(), tokenizer=task.tokenizer))
        prompts = task.train.batch_at(0, 4, shuffle=False)
        rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)  # the rollout rank now holds version 0
        errors = {}
        for name, call in (("hf", lambda: rk.rollout(state, prompts, n=2, max_new_tokens=4, engine="hf")),
                           ("shard_again", lambda: plan.shard(state))):
            try:
                call()
                errors[name] = None
            except ValueError as e:
                errors[name] = str(e)
        state = rk.checkpoint.load(state, path)  # other weights, saved at the same policy version 0
        after = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
        return {"after": after["response_ids"].clone(), "logprobs": after["logprobs"].clone(), "errors": errors}
    finally:
        shutdown()


def test_split_placement_rolls_out_a_loaded_checkpoints_weights(tmp_path):
    """The rollout rank loads no model: its engine gets the actor rank's weights when the policy
    version moves. A checkpoint of the version it last received (a warmed-up model saved before
    RL) left it sampling from the template's weights until the first update. Also on a lowered
    state: another engine kind, and shard called again, are refused in one line (they failed
    deep inside generate, or with an error about building the engine)."""
    from rlkit.parallel.local import run_local

    task = _task()
    saved = rk.init(_model(task, seed=7), _spec(), tokenizer=task.tokenizer)
    path = rk.checkpoint.save(saved, tmp_path)
    expected = rk.rollout(saved, task.train.batch_at(0, 4, shuffle=False), n=2, max_new_tokens=4, temperature=0.0)
    template = rk.rollout(rk.init(_model(task, seed=0), _spec(), tokenizer=task.tokenizer), task.train.batch_at(0, 4, shuffle=False),
                          n=2, max_new_tokens=4, temperature=0.0)
    assert not torch.allclose(template["logprobs"], expected["logprobs"], atol=1e-3)  # the two models tell apart
    for r in run_local(_split_load_worker, 2, str(path), timeout=240):
        width = expected["response_ids"].shape[1]
        assert torch.equal(r["after"][:, :width], expected["response_ids"])
        torch.testing.assert_close(r["logprobs"][:, :width], expected["logprobs"], atol=1e-5, rtol=1e-5)
        assert "engine='hf': this state is lowered" in r["errors"]["hf"]
        assert "Plan.shard: this state is lowered already" in r["errors"]["shard_again"]


def _tp_worker():
    from rlkit.parallel import init_distributed, shutdown

    init_distributed("gloo")
    try:
        task = _task()
        state = rk.init(_model(task, heads=4, kv_heads=2), _spec(), tokenizer=task.tokenizer)
        plan = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower(tp=2)
        state = plan.shard(state)
        engine = state._cache["engine"]
        prompts = task.train.batch_at(0, 4, shuffle=False)
        before = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
        sampled = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=1.0)
        state, _ = rk.update(state, _batch(_model(task, heads=4, kv_heads=2), task))
        after = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
        q = engine.weights["model.layers.0.self_attn.q_proj.weight"]
        return {"before": before["response_ids"].clone(), "after": after["response_ids"].clone(),
                "sampled": sampled["response_ids"].clone(),
                "q_rows": q.shape[0], "heads": engine.num_heads, "sync": rk.rollout_metrics(after)}
    finally:
        shutdown()


def test_tensor_parallel_generation_after_resharding():
    """FSDP(2) training layout -> TP(2) generation: each rank holds half of every attention/MLP
    weight, and greedy tokens equal the single-process engine's, before and after an update, as
    do sampled tokens under the same rollout key."""
    from rlkit.parallel.local import run_local

    results = run_local(_tp_worker, 2, timeout=240)
    task = _task()
    model = _model(task, heads=4, kv_heads=2)
    full_rows = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    state = rk.init(model, _spec(), tokenizer=task.tokenizer)
    prompts = task.train.batch_at(0, 4, shuffle=False)
    before = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
    sampled = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=1.0)
    state, _ = rk.update(state, _batch(_model(task, heads=4, kv_heads=2), task))
    after = rk.rollout(state, prompts, n=2, max_new_tokens=4, temperature=0.0)
    for r in results:
        assert r["q_rows"] * 2 == full_rows and r["heads"] == model.config.num_attention_heads // 2
        assert torch.equal(r["before"], before["response_ids"])
        # both TP ranks draw the rollout key's noise: the same samples as one process
        width = sampled["response_ids"].shape[1]
        assert torch.equal(r["sampled"][:, :width], sampled["response_ids"])
        width = after["response_ids"].shape[1]
        assert torch.equal(r["after"][:, :width], after["response_ids"])
        assert r["sync"]["sync/bytes"] > 0


def test_colocated_roles_can_take_turns_on_memory():
    """With release_rollout_memory the engine frees its kept KV cache / CUDA graphs after every
    rollout (on GPU they are otherwise kept for the next call; on CPU nothing is kept anyway)."""
    task = _task()
    state = rk.init(_model(task), _spec(), tokenizer=task.tokenizer)
    for release, expected in ((False, 0), (True, 2)):
        s = rk.Pipeline(rk.recipes.get("grpo"), reward=task.reward).lower(release_rollout_memory=release).shard(state)
        from rlkit.transforms.rollout import get_engine

        engine = get_engine(s)
        calls = []
        engine.release = lambda: calls.append(1)
        for _ in range(2):
            batch = rk.rollout(s, task.train.batch_at(0, 2), n=2, max_new_tokens=3)
        assert len(calls) == expected and batch.batch_size[0] == 4
        s._cache.pop("engine", None)


def test_grpo_recipe_with_kl_equals_the_plain_transform_sequence():
    # the recipe queues the reference pass before scoring and decodes responses in score, not in
    # the rollout: a reordering, so the step must equal rollout -> score -> advantage -> update
    # with update computing the reference log-probs itself. The reward reads the decoded text and
    # the reference differs from the actor, so wrong text or wrong reference log-probs would move
    # the rewards, the KL term and the parameters
    def text_reward(completions, **kw):
        return [float(sum(map(ord, c)) % 5) for c in completions]

    task = _task()
    model = _model(task)
    recipe = rk.recipes.get("grpo").with_(n=4, max_new_tokens=4, kl=("low_var_kl", 0.1))
    states = []
    for m in (model, copy.deepcopy(model)):
        state = rk.init(m, _spec(), tokenizer=task.tokenizer, ref="copy")
        with torch.no_grad():
            for i, p in enumerate(state.ref.parameters()):
                p.add_(torch.sin(torch.arange(p.numel(), dtype=p.dtype) + i).reshape(p.shape) * 0.05)
        states.append(state)
    prompts = task.train.batch_at(0, 4)
    s1, m1 = recipe.step(states[0], prompts, text_reward)
    batch = rk.rollout(states[1], prompts, n=4, max_new_tokens=4)
    assert "response_text" in batch.keys()
    batch = rk.advantage(rk.score(batch, text_reward), "grpo")
    assert batch["rewards"].std() > 0  # the text matters
    s2, m2 = rk.update(states[1], batch, **recipe.update_kwargs())
    assert m2["actor/kl_loss"] > 1e-4  # the reference matters
    for (k, a), b in zip(s1.actor.state_dict().items(), s2.actor.state_dict().values()):
        assert torch.equal(a, b), k
    assert m1["actor/kl_loss"] == m2["actor/kl_loss"] and m1["reward/mean"] == float(batch["rewards"].mean())


def test_plan_fit_checks_prompt_lengths_before_the_first_step_as_fit_does():
    """Plan.fit handed fit a namespace holding only the step function, so fit could not read the
    recipe's max_new_tokens: a prompt too long for the context trained step 1 and failed at step 2
    with the rollout's per-batch message, where rk.fit refuses before training, naming the rows."""
    task = rk.tasks.arithmetic(digits=2, n_train=8, n_test=8)
    model = rk.models.tiny(task.tokenizer, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1, max_position_embeddings=10)
    recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=5)
    rows = [{"prompt": "1+2=", "answer": "3"}] * 4 + [{"prompt": "12+34=", "answer": "46"}] * 4  # 6 + 5 > 10
    state = rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)
    with pytest.raises(ValueError, match="rows that do not fit: 4, 5, 6, 7") as info:
        rk.Pipeline(recipe, reward=task.reward).lower().fit(state, rows, steps=2, batch_size=4, shuffle=False)
    assert getattr(info.value, "history", []) == []  # refused before any step trained
    assert state.step == 0 and state.policy_version == 0
