"""Ctrl-C inside an update in rk.fit: no consistent state is left, and the note and the donated
handle's error now say so and name the checkpoint to restore (they pointed at exc.state, which is
None, and at "the state that call returned", of which there is none)."""
import pytest
import torch

import rlkit as rk
from rlkit.checkpoint import Checkpointer
from rlkit.state import DonatedStateError

TASK_N_TRAIN = 16


def _interrupting_loss(after_calls):
    calls = []

    def loss(logprobs, old_logprobs, advantages, response_mask, *, num_tokens=None):
        calls.append(1)
        if len(calls) > after_calls:
            raise KeyboardInterrupt
        ratio = torch.exp(logprobs - old_logprobs)
        return -(ratio * advantages * response_mask).sum() / num_tokens, {}

    return loss


def test_ctrl_c_mid_update_names_the_checkpoint_and_the_handle_says_no_state_is_left(task, fresh_state, tmp_path):
    # two mini-batches a step: the interrupt lands in step 2's second, after its first optimizer step
    recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=2, mini_batch_size=4, loss=_interrupting_loss(3))
    saver = Checkpointer(tmp_path, every=1, save_on_sigterm=False)
    given = fresh_state()
    with pytest.raises(KeyboardInterrupt) as info:
        rk.fit(given, recipe, task.reward, task.train, steps=4, batch_size=4, checkpointer=saver)
    exc = info.value
    assert exc.state is None and len(exc.history) == 1
    note = "\n".join(exc.__notes__)
    assert "rk.fit stopped during an update, after 1 logged step(s)" in note and "exc.state is None" in note
    assert f"restore the last checkpoint, {tmp_path / 'step_000001'}" in note and "sys.last_value.state" not in note
    with pytest.raises(DonatedStateError) as used:
        given.step  # noqa: B018 - the notebook cell run again
    message = str(used.value)
    assert "donated to rk.fit, which did not finish (KeyboardInterrupt during the update of step 2)" in message
    assert "Restore the last checkpoint" in message and "Use the state that call returned" not in message
    # and the way back it names works: the checkpoint restores step 1
    assert saver.resume(fresh_state()).step == 1


def test_without_a_checkpointer_the_note_says_start_over(task, fresh_state):
    recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=2, mini_batch_size=4, loss=_interrupting_loss(1))
    with pytest.raises(KeyboardInterrupt) as info:
        rk.fit(fresh_state(), recipe, task.reward, task.train, steps=2, batch_size=4)
    assert "start over from rk.init (no checkpoint was saved)" in "\n".join(info.value.__notes__)


class _Broken:
    def __init__(self, at):
        self.at = at

    def on_step(self, step, metrics):
        if step == self.at:
            raise ConnectionError("metrics server gone")

    def __repr__(self):
        return "Broken()"


def test_a_failing_sink_is_named_and_the_step_it_logged_is_checkpointed(task, fresh_state, tmp_path):
    recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=2)
    saver = Checkpointer(tmp_path, every=1, save_on_sigterm=False)
    kept = rk.observe.ListSink()
    with pytest.raises(ConnectionError) as info:
        rk.fit(fresh_state(), recipe, task.reward, task.train, steps=4, batch_size=2, sinks=[_Broken(2), kept],
               checkpointer=saver)
    notes = "\n".join(info.value.__notes__)
    assert "raised by the sink Broken() on step 2 (the other sinks got the step)" in notes
    assert [h["step"] for h in kept.history] == [1, 2]
    # step 2 trained and is in exc.state; its checkpoint is saved too (it was skipped: a resume redid it)
    assert info.value.state.step == 2 and saver.latest() == tmp_path / "step_000002"


def test_init_on_a_frozen_model_names_the_argument_and_the_fix(task):
    model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1).requires_grad_(False)
    with pytest.raises(ValueError, match=r"rk.init: the model has no trainable parameter \(every parameter has "
                                         r"requires_grad=False.*unfreeze it with model.requires_grad_\(True\)"):
        rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)
    frozen_critic = rk.models.critic(model).requires_grad_(False)
    with pytest.raises(ValueError, match="the critic has no trainable parameter"):
        rk.init(model.requires_grad_(True), rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer, critic=frozen_critic)
