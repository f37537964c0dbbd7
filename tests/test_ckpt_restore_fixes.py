"""Restoring a checkpoint into a state that cannot hold all of it, and what fit's rank check compares.

- an untied-embedding checkpoint loaded into a tied-embedding model warned "config differs in
  ['tie_word_embeddings'] ... loading anyway", then crashed inside DCP ("Missing optimizer state
  for parameter 'lm_head.weight'"): now a CheckpointMismatchError names the setting and the fix
  (a tied checkpoint into an untied model still loads);
- a bf16 checkpoint's float32 master copies, loaded where the optimizer keeps none, were dropped
  without a word: now a RuntimeWarning says so;
- ``fit_settings`` compares a checkpointer's folder and ``every`` (not only whether one was given).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import rlkit as rk
from rlkit.checkpoint import CheckpointMismatchError, load, save


@pytest.fixture(scope="module")
def task():
    return rk.tasks.arithmetic(n_train=16, n_test=4)


def _model(task, **kw):
    return rk.models.tiny(task.tokenizer, seed=0, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, **kw)


def _trained(task, **kw):
    state = rk.init(_model(task, **kw), rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer)
    recipe = rk.recipes.get("grpo").with_(n=2, max_new_tokens=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state, _ = rk.fit(state, recipe, task.reward, task.train, steps=1, batch_size=2)
    return state


@pytest.mark.parametrize("trained", [True, False], ids=["with_optimizer_state", "step_0"])
def test_untied_checkpoint_into_tied_model_names_tie_word_embeddings(task, tmp_path, trained):
    if trained:
        saved = _trained(task, tie_word_embeddings=False)
    else:
        saved = rk.init(_model(task, tie_word_embeddings=False), rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer)
    path = save(saved, tmp_path)
    template = rk.init(_model(task, tie_word_embeddings=True), rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer)
    with pytest.raises(CheckpointMismatchError) as info:
        load(template, path)
    message = str(info.value)
    assert "tie_word_embeddings=False" in message and "tie_word_embeddings=True" in message
    assert "Build the model with tie_word_embeddings=False" in message and str(path) in message


def test_tied_checkpoint_into_untied_model_still_loads(task, tmp_path):
    saved = _trained(task, tie_word_embeddings=True)
    path = save(saved, tmp_path)
    template = rk.init(_model(task, tie_word_embeddings=False), rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        restored = load(template, path)
    assert restored.step == 1
    embed = saved.actor.model.embed_tokens.weight
    assert torch.equal(restored.actor.model.embed_tokens.weight, embed)
    assert torch.equal(restored.actor.lm_head.weight, embed)


def test_master_copies_that_the_optimizer_cannot_hold_are_reported(task, tmp_path, monkeypatch):
    from rlkit.optim import OptimizerSpec

    saved = _trained(task, dtype=torch.bfloat16)
    assert type(saved.optimizer).__name__ == "MasterWeightAdamW"
    path = save(saved, tmp_path)
    # what FSDP-sharded parameters get: a plain AdamW, master weights refused (see OptimizerSpec._wants_master)
    monkeypatch.setattr(OptimizerSpec, "_wants_master", lambda self, params: False)
    template = rk.init(_model(task, dtype=torch.bfloat16), rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer)
    assert type(template.optimizer) is torch.optim.AdamW
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = load(template, path)
    found = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "master copies" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert "float32 master copies in the checkpoint are not used" in found[0] and "bf16 weights" in found[0]
    assert restored.step == 1


def test_master_copies_loaded_into_master_weights_do_not_warn(task, tmp_path):
    saved = _trained(task, dtype=torch.bfloat16)
    path = save(saved, tmp_path)
    template = rk.init(_model(task, dtype=torch.bfloat16), rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(template, path)
    assert not [w for w in caught if "master copies" in str(w.message)]


def test_fit_settings_compare_the_checkpointers_folder_and_every(task, tmp_path, monkeypatch):
    from rlkit.checkpoint import Checkpointer
    from rlkit.parallel.agree import fit_settings

    state = rk.init(_model(task), rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer)
    monkeypatch.chdir(tmp_path)
    ck = Checkpointer("ckpts", every=5, keep=2, save_on_sigterm=False)
    settings = fit_settings(state, object(), task.train, steps=2, batch_size=2, checkpointer=ck)
    assert settings["checkpointer"] is True
    assert settings["checkpointer.directory"] == str(tmp_path / "ckpts")  # absolute: a relative path per cwd differs
    assert settings["checkpointer.every"] == 5 and settings["checkpointer.keep"] == 2
    assert fit_settings(state, object(), task.train, steps=2, batch_size=2, checkpointer=False)["checkpointer"] is False
    assert fit_settings(state, object(), task.train, steps=2, batch_size=2, checkpointer=None)["checkpointer"] is False


def test_building_a_checkpointer_does_no_collective(tmp_path, monkeypatch):
    """Rank 0 of a job building it alone (an "only rank 0 saves" habit) hung in a barrier."""
    import rlkit.checkpoint as ck_mod

    calls = []
    monkeypatch.setattr(ck_mod, "_distributed", lambda: True)
    monkeypatch.setattr(ck_mod.dist, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(ck_mod.dist, "get_world_size", lambda *a, **k: 2)
    for name in ("barrier", "all_gather_object", "broadcast_object_list", "all_reduce"):
        monkeypatch.setattr(ck_mod.dist, name, lambda *a, _n=name, **k: calls.append(_n))
    ck = ck_mod.Checkpointer(tmp_path / "on_rank_1" / "ckpts", save_on_sigterm=False)
    assert calls == []
    assert ck.directory.is_dir()  # every rank creates the folder itself
