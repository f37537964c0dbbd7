"""First contact: Tab completion lists rk's lazy names, the character tokenizer gives only the
inputs a causal LM takes, the dashboard says when it cannot draw."""
import builtins
import sys

import pytest

import rlkit as rk


def test_dir_lists_the_lazy_names_for_tab_completion():
    # jedi and IPython complete from dir(rk): rk.models, rk.tasks, rk.fit, ... were missing
    for name in ("models", "tasks", "fit", "recipes", "Pipeline", "Checkpointer", "launch", "rewards", "mesh", "rollout"):
        assert name in dir(rk), name
    assert "VLLMEngine" in dir(rk.engines)  # without importing vLLM
    assert {"notebook", "console", "wandb_sink", "prometheus"} <= set(dir(rk.observe))


def test_char_tokenizer_gives_only_ids_and_mask_also_after_a_reload(tmp_path):
    # transformers 4.x added token_type_ids, which model.generate(**tok(...)) refuses
    tok = rk.models.tokenizers.char_tokenizer("0123456789+=")
    assert set(tok("1+2=")) == {"input_ids", "attention_mask"}
    tok.save_pretrained(tmp_path)
    again = rk.models.tokenizers.load_tokenizer(tmp_path)
    assert again.model_input_names == ["input_ids", "attention_mask"]
    model = rk.models.tiny(tok, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    out = model.generate(**tok("1+2=", return_tensors="pt"), max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, 6)


def _without(monkeypatch, *names):
    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name.split(".")[0] in names:
            raise ImportError(f"No module named {name!r}", name=name)
        return real(name, *args, **kwargs)

    for n in list(sys.modules):
        if n.split(".")[0] in names:
            monkeypatch.delitem(sys.modules, n)
    monkeypatch.setattr(builtins, "__import__", fake)


def test_a_dashboard_in_a_kernel_without_ipywidgets_says_so(monkeypatch):
    from rlkit.observe import notebook

    monkeypatch.setattr(notebook, "_in_kernel", lambda: True)
    _without(monkeypatch, "ipywidgets")
    with pytest.warns(RuntimeWarning, match=r"Dashboard: ipywidgets is not installed, so nothing is drawn live .*"
                                            r"pip install 'rlkit\[notebook\]'"):
        board = notebook.Dashboard(total=2)
    board.on_step(1, {"reward/mean": 0.5})
    assert board.history == [{"step": 1, "reward/mean": 0.5}]


def test_dashboard_plot_without_matplotlib_names_the_extra(monkeypatch):
    from rlkit.observe import notebook

    board = notebook.Dashboard(total=2)
    board.on_step(1, {"reward/mean": 0.5})
    _without(monkeypatch, "matplotlib")
    with pytest.raises(ImportError, match=r"pip install 'rlkit\[notebook\]'"):
        board.plot()


def test_rlkit_version_flag(capsys):
    from rlkit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"rlkit {rk.__version__}"
