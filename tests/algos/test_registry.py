"""Registry.register: the bare ``@REG.register`` form and ``register()`` without names register
the function under its ``__name__`` and hand the function itself back (the bare form used to
return the inner decorator and register nothing)."""
import pytest
import torch

import rlkit as rk
from rlkit.algos import AGGREGATIONS, KL_PENALTIES, POLICY_LOSSES, Registry, aggregate
from rlkit.algos.advantages import ADVANTAGE_ESTIMATORS
from rlkit.batch import make_batch

ALL = [ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_PENALTIES, AGGREGATIONS]


@pytest.fixture
def scratch(monkeypatch):
    """The global registries with their catalogues restored after the test."""
    for reg in ALL:
        monkeypatch.setattr(reg, "_fns", dict(reg._fns))
    return ALL


@pytest.mark.parametrize("form", ["bare", "empty"])
def test_register_without_names_uses_the_function_name(form):
    reg = Registry("thing")

    def my_thing(x):
        return x + 1

    decorated = reg.register(my_thing) if form == "bare" else reg.register()(my_thing)
    assert decorated is my_thing
    assert reg.names() == ["my_thing"] and reg.get("my_thing") is my_thing


def test_every_global_registry_takes_the_bare_decorator(scratch):
    for reg in scratch:

        @reg.register
        def custom_entry(*args, **kwargs):
            return "called"

        assert reg.get("custom_entry") is custom_entry
        assert custom_entry() == "called"  # still the user's function, not the decorator


def test_bare_decorated_estimator_and_aggregation_work_by_object_and_by_name(scratch):
    @rk.algos.ADVANTAGE_ESTIMATORS.register
    def twice_reward(token_rewards, response_mask):
        adv = 2 * token_rewards.sum(-1, keepdim=True) * response_mask
        return adv, adv

    batch = make_batch([[1, 2]] * 2, [[5, 5, 5], [5, 5]], group=[0, 0], rewards=[1.5, -1.0])
    for est in (twice_reward, "twice_reward"):
        adv = rk.advantage(batch, est)["advantages"]
        assert adv.tolist() == [[3.0, 3.0, 3.0], [-2.0, -2.0, 0.0]]

    @rk.algos.AGGREGATIONS.register
    def plain_sum(loss_mat, mask, *, num_tokens=None, num_seqs=None, horizon=None):
        return (loss_mat * mask).sum()

    loss, mask = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1, 0], [1, 1]])
    assert aggregate(loss, mask, "plain_sum").item() == 1.0 + 3.0 + 4.0


def test_decorator_with_names_is_unchanged():
    reg = Registry("thing")

    @reg.register("a", "b")
    def f():
        pass

    assert reg.names() == ["a", "b"] and reg.get("b") is f


def test_nameless_lambda_and_bad_names_are_refused_clearly():
    reg = Registry("thing")
    with pytest.raises(TypeError, match="no usable __name__.*register\\('my_name'\\)"):
        reg.register(lambda x: x)
    with pytest.raises(TypeError, match="names must be non-empty strings"):
        reg.register("ok", 3)
    with pytest.raises(TypeError, match="names must be non-empty strings"):
        reg.register("")
    assert reg.names() == []


def test_a_clash_registers_none_of_the_names():
    reg = Registry("thing")

    @reg.register("taken")
    def first():
        pass

    def second():
        pass

    with pytest.raises(ValueError, match="'taken' is already registered to .*first"):
        reg.register("fresh", "taken")(second)
    assert reg.names() == ["taken"]
