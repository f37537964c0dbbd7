"""rk.init on a model that a live, trained TrainState owns; TrainState's short repr; Pipeline's
swapped arguments."""
import copy
import gc
import warnings
import weakref

import pytest

import rlkit as rk
from rlkit.state import DonatedStateError

TASK_N_TRAIN = 8


def _tiny(task):
    return rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                          num_key_value_heads=1)


def _trained(task, state):
    """``state`` after one update (step 1)."""
    batch = rk.advantage(rk.score(rk.rollout(state, task.train.take(range(2)), n=2, max_new_tokens=2), task.reward), "grpo")
    new, _ = rk.update(state, batch, max_logprob_gap=None)
    return new


def test_init_on_the_actor_of_a_live_trained_state_warns_and_donates_that_state(task):
    """A notebook cell `state = rk.init(model, ...); rk.fit(...)` run twice: the second run started at
    step 0 from the weights the first had trained, silently, and both states stayed usable on one module."""
    model = _tiny(task)
    old = _trained(task, rk.init(model, rk.optim.adamw(lr=3e-4), tokenizer=task.tokenizer))
    with pytest.warns(RuntimeWarning, match="the model is the actor of another TrainState, still in use at step 1") as rec:
        new = rk.init(model, rk.optim.adamw(lr=3e-4), tokenizer=task.tokenizer)
    message = str(rec[0].message)
    assert "rk.init(copy.deepcopy(model), ...)" in message and "keep using its latest state" in message
    assert rec[0].filename == __file__  # points at the rk.init call, not into rlkit
    # the old handle refuses further use (fitting it trained the new state's weights), the new one works
    with pytest.raises(DonatedStateError, match="donated to rlkit.init") as info:
        old.step  # noqa: B018
    assert "copy.deepcopy(model)" in str(info.value)
    assert repr(old) == "TrainState(<donated to rlkit.init: use the state it returned>)"
    assert new.step == 0 and new.actor is model
    assert _trained(task, new).step == 1


def test_init_on_the_ref_of_a_trained_state_and_a_trained_actor_as_ref_warn(task):
    model = _tiny(task)
    old = _trained(task, rk.init(model, rk.optim.adamw(lr=3e-4), tokenizer=task.tokenizer, ref="copy"))
    with pytest.warns(RuntimeWarning, match="the model is the ref of another TrainState, still in use at step 1"):
        rk.init(old.ref.requires_grad_(True), tokenizer=task.tokenizer)  # "start over from the reference"
    with pytest.raises(DonatedStateError):
        old.step  # noqa: B018
    # freezing a live run's actor as another state's reference froze that run
    old = _trained(task, rk.init(_tiny(task), rk.optim.adamw(lr=3e-4), tokenizer=task.tokenizer))
    with pytest.warns(RuntimeWarning, match="the ref model is the actor of another TrainState, still in use at step 1"):
        rk.init(_tiny(task), tokenizer=task.tokenizer, ref=old.actor)
    assert old.is_donated


def test_init_stays_silent_for_untrained_states_copies_and_states_no_longer_held(task):
    model = _tiny(task)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # an untrained model given to rk.init twice (tests and users do): both states stay usable
        first = rk.init(model, tokenizer=task.tokenizer)
        second = rk.init(model, tokenizer=task.tokenizer)
        assert first.step == second.step == 0
        # a new phase from a trained run's weights, copied: the run stays usable
        trained = _trained(task, second)
        rk.init(copy.deepcopy(trained.actor), tokenizer=task.tokenizer)
        assert trained.step == 1
        # one frozen reference shared by two runs: neither trains it
        with_ref = _trained(task, rk.init(_tiny(task), tokenizer=task.tokenizer, ref="copy"))
        rk.init(_tiny(task), tokenizer=task.tokenizer, ref=with_ref.ref)
        assert with_ref.step == 1
        del with_ref
        # the registry holds states weakly: a trained state nothing holds any more neither stays alive
        # nor owns the model
        gone = weakref.ref(trained)
        del trained, first, second
        gc.collect()
        assert gone() is None
        assert rk.init(model, tokenizer=task.tokenizer).step == 0


def test_train_state_repr_is_a_short_summary(task):
    state = rk.init(_tiny(task), rk.optim.adamw(lr=3e-4), tokenizer=task.tokenizer, seed=5)
    text = repr(state)
    # it was 110 lines: three module trees, the optimizer's groups, the tokenizer's token table
    assert len(text.splitlines()) <= 4 and len(text) < 400, text
    assert text.startswith("TrainState(actor=Qwen2ForCausalLM(") and "params, float32, cpu)" in text
    for part in ("ref=None", "critic=None", "optimizer=AdamW(lr=0.0003)", f"vocab={len(task.tokenizer)})", "step=0",
                 "seed=5", "live)"):
        assert part in text, (part, text)
    state = _trained(task, state)
    assert "step=1, policy_version=1" in repr(state)
    with_roles = repr(rk.init(_tiny(task), tokenizer=task.tokenizer, ref="copy", critic=rk.models.critic(_tiny(task))))
    assert "ref=Qwen2ForCausalLM(" in with_roles and "critic=" in with_roles and "critic_optimizer=AdamW(" in with_roles
    assert len(with_roles.splitlines()) <= 4


def test_pipeline_names_swapped_arguments():
    def reward(completions, **kw):
        return [0.0] * len(completions)

    with pytest.raises(TypeError, match=r"reward is the recipe name 'grpo'; the order is Pipeline\(step, reward\): "
                                        r"Pipeline\('grpo', reward\)"):
        rk.Pipeline(reward, "grpo")
    # a recipe class or factory is callable: it passed for a reward function until the first score
    with pytest.raises(TypeError, match=r"recipe class GRPO; the order is .*Pipeline\(rk.recipes.get\('grpo'\), reward\)"):
        rk.Pipeline(reward, rk.recipes.GRPO)
    with pytest.raises(TypeError, match=r"recipe factory drgrpo; the order is Pipeline\(step, reward\)"):
        rk.Pipeline(reward, reward=rk.recipes.drgrpo)
    with pytest.raises(TypeError, match=r"step 'exact_match' is a built-in reward's name.*Pipeline\('grpo', 'exact_match'\)"):
        rk.Pipeline("exact_match", reward)
    # the right order still goes, built-in reward names included
    assert rk.Pipeline("grpo", "exact_match").reward == "exact_match"
