"""What a researcher sees, as a probe found it wrong:

- the console's "kl=" was ``actor/approx_kl`` (new policy against old, ~0 for one update per
  batch, negative at times), not the KL to the reference, which it did not show at all;
- under Dr. GRPO's aggregation ``actor/entropy`` was a sum over tokens / horizon (7.6 where
  ln(vocab) is 2.9): the entropy and KL metrics are now token means whatever ``agg``;
- ``rollout/tokens_per_s`` was of another timer than the ``rollout/seconds`` beside it;
- a crash-torn JSONL row longer than 1 MiB was not dropped before appending;
- wandb silently ignored the steps a same-process resume (or a second fit) logged again.
"""
from __future__ import annotations

import copy
import json
import math
import warnings

import pytest

import rlkit as rk
from rlkit.algos.kl import k3
from rlkit.transforms.forward import model_logprobs


@pytest.mark.parametrize("agg", ["seq-mean-token-sum-norm", "seq-mean-token-sum"])
def test_entropy_and_kl_metrics_are_token_means_whatever_the_aggregation(tiny_model, char_tok, agg, policy_batch):
    batch = policy_batch(tiny_model, ref=True)
    mask = batch["response_mask"].bool()
    ref = {}
    for a in (None, agg):
        state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
        _, ref[a] = rk.update(state, batch, loss="ppo_clip", agg=a, kl=("low_var_kl", 0.1), micro_batch_size=3, max_logprob_gap=None)
    # independent: the KL to the reference and the entropy from a plain forward, averaged over the response tokens
    now, entropy = model_logprobs(tiny_model, batch, with_entropy=True)
    kl = k3(now, batch["ref_logprobs"])[mask].mean().item()
    assert ref[agg]["actor/kl"] == pytest.approx(kl, rel=1e-4) and ref[None]["actor/kl"] == pytest.approx(kl, rel=1e-4)
    assert ref[agg]["actor/entropy"] == pytest.approx(entropy[mask].mean().item(), rel=1e-4)
    assert ref[None]["actor/entropy"] == pytest.approx(entropy[mask].mean().item(), rel=1e-4)
    assert 0 < ref[agg]["actor/entropy"] <= math.log(tiny_model.config.vocab_size)
    # the loss term keeps the aggregation: it is not the token mean under these
    assert ref[agg]["actor/kl_loss"] != pytest.approx(kl, rel=1e-2)


def test_the_console_shows_the_kl_to_the_reference_as_kl(tiny_model, char_tok, policy_batch):
    import io

    from rich.console import Console

    from rlkit.observe.console import ConsoleSink

    batch = policy_batch(tiny_model, ref=True)
    state = rk.init(copy.deepcopy(tiny_model), rk.optim.adamw(lr=1e-3), tokenizer=char_tok)
    _, metrics = rk.update(state, batch, kl=("low_var_kl", 0.1), max_logprob_gap=None)
    out = io.StringIO()
    sink = ConsoleSink(1, console=Console(file=out, width=200, force_terminal=False))
    sink.on_step(1, metrics)
    sink.close()
    shown = dict(t.split("=", 1) for t in out.getvalue().split() if "=" in t)
    assert float(shown["kl"]) == pytest.approx(metrics["actor/kl"], rel=1e-2) and metrics["actor/kl"] > 1e-3
    assert "ppo_kl" not in shown  # approx_kl is not a default key


def test_tokens_per_second_is_the_rate_of_the_seconds_beside_it(tiny_model, char_tok):
    state = rk.init(tiny_model, tokenizer=char_tok)
    m = rk.rollout_metrics(rk.rollout(state, ["1+2=", "3+4="], n=2, max_new_tokens=4))
    assert m["rollout/tokens_per_s"] == pytest.approx(m["rollout/tokens"] / m["rollout/seconds"], rel=1e-9)


def test_a_torn_row_longer_than_one_mebibyte_is_dropped_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
        f.write('{"step": 2, "samples": "' + "x" * (3 << 19))  # 1.5 MiB, cut short by a crash
    sink = rk.observe.JSONLSink(path)
    sink.on_step(2, {"reward/mean": 0.75})
    sink.close()
    rows = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward/mean"] == 0.75


def test_wandb_warns_when_a_step_comes_again_instead_of_losing_it_silently(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from rlkit.observe.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    sink = WandbSink(project="rlkit-test")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in (1, 2, 3):
                sink.on_step(step, {"reward/mean": step / 4})
            assert not caught
            for step in (2, 3):  # a resume from step 1's checkpoint
                sink.on_step(step, {"reward/mean": 0.0})
            sink.on_step(4, {"reward/mean": 1.0})
        said = [str(w.message) for w in caught if "WandbSink" in str(w.message)]
        assert len(said) == 1 and "steps 2..3" in said[0] and "new WandbSink" in said[0]
        assert sink.run.summary["reward/mean"] == 1.0
    finally:
        sink.close()
