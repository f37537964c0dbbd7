"""rk.fit's history rows: a "step" key (a ListSink's rows) and the same metric keys on every step,
the first step of a fresh or resumed run included (its sync/* keys had been missing)."""
import rlkit as rk
from rlkit.checkpoint import Checkpointer

TASK_N_TRAIN = 16


def _fit(state, task, steps, **kwargs):
    recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=2)
    return rk.fit(state, recipe, task.reward, task.train, steps=steps, batch_size=2, **kwargs)


def test_history_rows_are_a_list_sinks_rows(task, fresh_state):
    seen = rk.observe.ListSink()
    state, history = _fit(fresh_state(), task, 3, sinks=[seen])
    assert [h["step"] for h in history] == [1, 2, 3]
    assert history == seen.history
    # resumed: the rows carry the steps they ran, not 1..n again
    _, more = _fit(state, task, 5)
    assert [h["step"] for h in more] == [4, 5]


def test_every_step_logs_the_same_metric_keys_fresh_and_resumed(task, fresh_state, tmp_path):
    saver = Checkpointer(tmp_path, every=3, save_on_sigterm=False)
    _, history = _fit(fresh_state(), task, 3, checkpointer=saver)
    keys = [set(h) for h in history]
    # the built-in engine copies the weights: its syncs report bytes, seconds and fused_bytes
    assert {"sync/bytes", "sync/seconds", "sync/fused_bytes"} <= keys[0]
    assert keys[0] == keys[1] == keys[2], [sorted(k ^ keys[1]) for k in keys]
    # nothing synced before step 1's rollout; before step 2's the engine took the new version (a copy-free
    # reload here: the engine reads the training weights' storage on this device and dtype)
    assert history[0]["sync/seconds"] == 0.0 and history[1]["sync/seconds"] > 0
    # resumed from the checkpoint: a fresh engine, at the state's policy version, on its first step
    _, more = _fit(saver.restore(fresh_state()), task, 4)
    assert set(more[0]) == keys[1] and more[0]["sync/seconds"] == 0.0


def test_a_schedule_that_ends_before_the_run_warns(task):
    """total_steps counts optimizer steps; with 4 mini-batches a step, total_steps=8 for an 8-step
    run ended the cosine schedule at step 2 and trained the other 6 at lr 0, without a word."""
    import warnings

    def run(total, steps, **recipe_kw):
        model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1)
        spec = rk.optim.adamw(lr=1e-3, warmup_steps=2, total_steps=total, schedule="cosine")
        state = rk.init(model, spec, tokenizer=task.tokenizer)
        recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=2, **recipe_kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, history = rk.fit(state, recipe, task.reward, task.train, steps=steps, batch_size=8)
        return history, [str(w.message) for w in caught if "LR schedule" in str(w.message)]

    history, said = run(8, 4, mini_batch_size=4)
    assert [h["actor/lr"] for h in history][2:] == [0.0, 0.0]  # the defect the warning names
    assert len(said) == 1 and "a step of this recipe takes 4 (one per mini-batch and epoch)" in said[0]
    assert "the schedule ends at about step 2" in said[0] and "total_steps=16) (steps x 4)" in said[0]
    assert run(16, 4, mini_batch_size=4)[1] == []  # long enough: quiet
    # one optimizer step a step: total_steps counts fit steps, so a shorter schedule is the user's own choice
    assert run(4, 8)[1] == []
