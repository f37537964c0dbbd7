"""Every bad input a user can give is a clear error naming the field, the value and the fix.

(Checkpoint errors live in test_checkpoint.py; model-directory and tokenizer errors in
tests/models/; Batch field errors in test_batch.py; reward errors in transforms/test_score.py.)
"""
import json

import pytest
import torch

import rlkit as rk
from rlkit.data import DataError


@pytest.fixture(scope="module")
def task():
    return rk.tasks.arithmetic(n_train=32, n_test=8)


@pytest.fixture
def state(task):
    return rk.init(rk.models.tiny(task.tokenizer, seed=0, hidden_size=64, intermediate_size=128), rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)


def test_unknown_task_and_algo_list_the_valid_ones():
    with pytest.raises(ValueError, match="unknown task 'arith'.*arithmetic"):
        rk.tasks.get("arith")
    with pytest.raises(ValueError, match="unknown algorithm 'grp'.*grpo.*ppo"):
        rk.recipes.get("grp")
    with pytest.raises(SystemExit):
        from rlkit.cli import main

        main(["run"])  # task missing: argparse usage error


def test_config_errors(task):
    from rlkit.jobs import run_task

    with pytest.raises(ValueError, match="unknown option.*'stpes'"):
        run_task("arithmetic", {"stpes": 3})
    with pytest.raises(TypeError, match=r"rk.recipes.get\('grpo'\): GRPO has no field\(s\) \['nn'\] \(did you mean 'n' for 'nn'\?\); its fields: n, max_new_tokens"):
        rk.recipes.get("grpo", nn=3)
    with pytest.raises(ValueError, match="unknown LR schedule 'cosin'"):
        rk.optim.adamw(lr=1e-3, schedule="cosin", total_steps=10)
    with pytest.raises(TypeError, match="optimizer must be an rlkit OptimizerSpec"):
        rk.init(rk.models.tiny(task.tokenizer), optimizer={"lr": 1e-3})
    with pytest.raises(ValueError, match="teacher_error must be in \\[0, 1\\]"):
        rk.tasks.arithmetic(teacher_error=2.0)


def test_data_errors(task, tmp_path):
    with pytest.raises(DataError, match="empty"):
        rk.load_prompts([], task.tokenizer)
    with pytest.raises(DataError, match="row 1.*must be text.*int"):
        rk.load_prompts([{"prompt": "1+1="}, {"prompt": 7}], task.tokenizer)
    with pytest.raises(DataError, match="row 0 has no 'prompt' field.*prompt_key"):
        rk.load_prompts([{"question": "1+1="}], task.tokenizer)
    with pytest.raises(DataError, match="row 1 has 9 tokens, over max_prompt_tokens=4.*truncate=True"):
        rk.load_prompts(["1+1=", "12+345678"], task.tokenizer, max_prompt_tokens=4)
    kept = rk.load_prompts(["1+1=", "12+345678"], task.tokenizer, max_prompt_tokens=4, truncate=True)
    assert len(kept.ids[1]) == 4
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1="}) + "\n{not json\n")
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        rk.load_prompts(bad, task.tokenizer)
    with pytest.raises(DataError, match="does not exist"):
        rk.load_prompts(tmp_path / "missing.jsonl", task.tokenizer)
    with pytest.raises(DataError, match="batch_size=64 is larger than the prompt set"):
        task.test.batch_at(0, 64)


def test_prompts_from_jsonl_and_datasets(task, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(4)))
    from_file = rk.load_prompts(path, task.tokenizer)
    assert from_file.columns["answer"] == ["1", "2", "3", "4"] and from_file.text[2] == "2+1="
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": "3+4=", "answer": "7"}])
    assert rk.load_prompts(ds, task.tokenizer).ids == [task.tokenizer("3+4=", add_special_tokens=False)["input_ids"]]


def test_rollout_errors(state, task):
    with pytest.raises(ValueError, match="prompt 0 has .* tokens.*exceeds the model's context of 8"):
        small = rk.init(rk.models.tiny(task.tokenizer, hidden_size=64, intermediate_size=128, max_position_embeddings=8),
                        rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)
        rk.rollout(small, ["12+34="], n=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="SamplingParams.n must be a positive int"):
        rk.rollout(state, ["1+1="], n=0)
    with pytest.raises(TypeError, match="rollout expects a TrainState"):
        rk.rollout(task, ["1+1="])
    batch = rk.score(rk.rollout(state, ["1+1=", "2+2="], n=1, max_new_tokens=3), lambda completions, **_: [0.0, 1.0])
    with pytest.raises(rk.BatchError, match="n >= 2"):
        rk.advantage(batch, "grpo")


def test_tokenizer_without_pad_token(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="pad_token"):
        rk.models.load_tokenizer(tmp_path)


def test_job_option_types_are_checked():
    from rlkit.jobs import run_task

    with pytest.raises(TypeError, match="option 'steps' must be int, got str '3'"):
        run_task("arithmetic", {"steps": "3"})
    with pytest.raises(ValueError, match="option 'batch_size' must be >= 1"):
        run_task("arithmetic", {"batch_size": 0})


def test_fit_checks_its_arguments_and_reads_a_plain_prompt_list(task):
    recipe = rk.recipes.get("grpo", n=2, max_new_tokens=3)
    fresh = lambda: rk.init(rk.models.tiny(task.tokenizer, seed=0, hidden_size=64, intermediate_size=128),  # noqa: E731
                            rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)
    with pytest.raises(ValueError, match="batch_size must be a positive int.*got 0"):
        rk.fit(fresh(), recipe, task.reward, task.train, steps=1, batch_size=0)
    with pytest.raises(ValueError, match="eval_every must be an int >= 0.*got -1"):
        rk.fit(fresh(), recipe, task.reward, task.train, steps=1, batch_size=2, eval_every=-1)
    with pytest.raises(ValueError, match="eval_every=5 asks for evaluation but eval_fn is None"):
        rk.fit(fresh(), recipe, task.reward, task.train, steps=1, batch_size=2, eval_every=5)
    # a plain list of rows is read with the state's tokenizer: the same run as with its PromptSet
    rows = [{"prompt": text, "answer": answer} for text, answer in zip(task.train.text, task.train.columns["answer"])]
    _, from_rows = rk.fit(fresh(), recipe, task.reward, rows, steps=2, batch_size=4)
    _, from_set = rk.fit(fresh(), recipe, task.reward, rk.load_prompts(rows, task.tokenizer), steps=2, batch_size=4)
    keys = ("reward/mean", "actor/pg_loss", "actor/entropy")
    assert [[h[k] for k in keys] for h in from_rows] == [[h[k] for k in keys] for h in from_set]
    bare = fresh().replace(tokenizer=None)  # e.g. a model loaded without its tokenizer
    with pytest.raises(TypeError, match="prompts is a list and the state has no tokenizer.*rk.load_prompts"):
        rk.fit(bare, recipe, task.reward, rows, steps=1, batch_size=2)


def test_init_names_a_device_this_machine_lacks(task):
    import torch

    model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=64, intermediate_size=128)
    with pytest.raises(ValueError, match="device='gpu' is not a device; use 'cpu', 'cuda' or 'cuda:N'"):
        rk.init(model, rk.optim.adamw(lr=1e-3), device="gpu")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = f"cuda:{n}"  # one past the last visible GPU (cuda:0 on a CPU-only machine)
    with pytest.raises(ValueError, match="sees no CUDA GPU.*device='cpu'" if n == 0 else "only .* CUDA GPU"):
        rk.init(model, rk.optim.adamw(lr=1e-3), device=missing)
    assert rk.init(model, rk.optim.adamw(lr=1e-3), device="cpu").device.type == "cpu"


def test_recipes_check_their_fields_when_built():
    """Bad sampling or update values used to pass ``rk.recipes.get`` and fail at the first rollout
    or update (a float ``kl`` at the first step, in ``needs_ref``)."""
    for kw, match in (({"n": -1}, "GRPO: SamplingParams.n must be a positive int"),
                      ({"temperature": -1.0}, "GRPO: temperature must be > 0 for RL sampling, got -1.0"),
                      ({"temperature": float("nan")}, "GRPO: SamplingParams.temperature must be a finite number >= 0"),
                      ({"kl": ("low_var_kl", -1.0)}, "kl's coefficient must be a finite number >= 0"),
                      ({"micro_batch_size": 0}, "GRPO.micro_batch_size must be a positive int or None, got 0"),
                      ({"epochs": 0}, "GRPO.epochs must be a positive int, got 0")):
        with pytest.raises(ValueError, match=match):
            rk.recipes.get("grpo", **kw)
    with pytest.raises(ValueError, match="CriticFree: SamplingParams.n must be a positive int, got 0"):
        rk.recipes.get("rloo").with_(n=0)
    recipe = rk.recipes.get("grpo", kl=0.01)  # a bare coefficient, as update takes it
    assert recipe.kl == ("low_var_kl", 0.01) and recipe.needs_ref()
    assert not rk.recipes.get("grpo", kl=0.0).needs_ref()


def test_sampling_params_reject_values_that_sampled_garbage_or_failed_deep_in_torch():
    from rlkit.engines.base import SamplingParams

    cases = [({"temperature": float("nan")}, "temperature must be a finite number >= 0"),  # sampled pad tokens, NaN log-probs
             ({"temperature": None}, "temperature must be a finite number"),
             ({"max_new_tokens": 2.0}, "max_new_tokens must be a positive int"),
             ({"n": True}, "n must be a positive int"),
             ({"top_k": 2.5}, "top_k must be an int"),
             ({"top_p": 1.5}, "top_p must be a number in \\(0, 1\\]"),
             ({"stop_token_ids": 2}, "stop_token_ids must be a sequence of token ids")]
    for kw, match in cases:
        with pytest.raises(ValueError, match=f"SamplingParams.{match}"):
            SamplingParams(**kw)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_recipe_and_update_reject_a_gradient_norm_that_flips_or_zeroes_the_update(task, state):
    """max_grad_norm=-1 was accepted and trained by gradient ascent (clip_grad_norm_ scales by a
    negative factor); 0 zeroed every gradient."""
    for bad in (-1.0, 0, float("nan")):
        with pytest.raises(ValueError, match="max_grad_norm must be a finite number > 0, or None"):
            rk.recipes.get("grpo", max_grad_norm=bad)
    batch = rk.advantage(rk.score(rk.rollout(state, task.train.batch_at(0, 2), n=2, max_new_tokens=3), task.reward), "grpo")
    with pytest.raises(ValueError, match="max_grad_norm must be a finite number > 0"):
        rk.update(state, batch, max_grad_norm=-1.0)
    state.step  # noqa: B018 - the refused update did not donate the state


def test_recipes_check_names_and_dapo_attempts_when_built():
    with pytest.raises(ValueError, match="GRPO: unknown policy loss 'ppo_clipp'"):
        rk.recipes.get("grpo", loss="ppo_clipp")
    with pytest.raises(ValueError, match="GRPO: unknown loss aggregation 'token_mean'"):
        rk.recipes.get("grpo", agg="token_mean")
    with pytest.raises(ValueError, match="no option\\(s\\) \\['clip_ratoi'\\]"):
        rk.recipes.get("grpo", loss_kw={"clip_ratoi": 0.2})
    with pytest.raises(ValueError, match="DAPO.max_attempts must be a positive int"):
        rk.recipes.get("dapo", max_attempts=0)  # fit then failed with UnboundLocalError
    with pytest.raises(ValueError, match="GRPO: temperature must be > 0 for RL sampling"):
        rk.recipes.get("grpo").with_(temperature=0)  # failed at the first update, after a rollout
    with pytest.raises(ValueError, match=r"GRPO: temperature must be > 0 for RL sampling, got -1\.0 \(greedy is for evaluation"):
        rk.recipes.get("grpo").with_(temperature=-1.0)  # said "must be >= 0 (0 = greedy)", and 0 was then refused
    with pytest.raises(ValueError, match=r"loss_kw sets \['agg', 'num_tokens'\], which update passes"):
        rk.recipes.get("grpo", loss_kw={"num_tokens": 3, "agg": "token-mean"})  # "got multiple values" at the first update


def test_recipes_check_estimator_kl_engine_and_dapo_shaping_when_built():
    """Each of these was accepted and failed only after the first rollout, or never: entropy_coef
    nan skipped every optimizer step with warnings, overlong_factor -1 made the penalty a bonus,
    an overlong_buffer over max_new_tokens punished every response, and overlong_factor nan read
    as a broken reward function."""
    for kwargs, message in [
        (dict(estimator="bogus"), "GRPO: .*bogus"),
        (dict(kl=("bogus_kl", 1e-3)), "GRPO: .*bogus_kl"),
        (dict(engine="bogus"), "GRPO: engine='bogus' is not an engine; give one of torch, hf, vllm"),
        (dict(entropy_coef=float("nan")), "GRPO.entropy_coef must be a finite number"),
    ]:
        with pytest.raises(ValueError, match=message):
            rk.recipes.GRPO(**kwargs)
    for kwargs, message in [
        (dict(overlong_factor=-1.0), "DAPO.overlong_factor must be a finite number >= 0"),
        (dict(overlong_factor=float("nan")), "DAPO.overlong_factor must be a finite number >= 0"),
        (dict(overlong_buffer=100, max_new_tokens=16), "DAPO.overlong_buffer=100 exceeds max_new_tokens=16"),
    ]:
        with pytest.raises(ValueError, match=message):
            rk.recipes.get("dapo", **kwargs)
    with pytest.raises(TypeError, match="drgrpo sets \\['agg'\\] itself"):
        rk.recipes.drgrpo(agg="token-mean")  # "got multiple values for keyword argument"
    with pytest.raises(TypeError, match="rloo sets estimator='rloo' itself"):
        rk.recipes.rloo(estimator="grpo")
    assert rk.recipes.get("grpo", engine="hf", kl=("k3", 1e-3)).engine == "hf"  # valid ones still go
    import torch
    assert rk.recipes.GRPO(entropy_coef=torch.tensor(0.01)).entropy_coef == pytest.approx(0.01)  # as update takes it


def test_fit_checks_its_arguments_before_the_first_step(task, state):
    recipe = rk.recipes.get("grpo", n=2, max_new_tokens=3)
    bad = [({"recipe": 3}, TypeError, "recipe must be a recipe"),
           ({"reward": None}, TypeError, "reward is None"),
           ({"steps": 1.5}, ValueError, "steps must be an int >= 0"),
           ({"sinks": [print]}, TypeError, "every sink needs an on_step"),
           ({"checkpointer": "ckpt"}, TypeError, "checkpointer must be an rk.Checkpointer"),
           ({"state": "state"}, TypeError, "state must be a TrainState")]
    for change, exc, match in bad:
        kw = {"state": state, "recipe": recipe, "reward": task.reward, "prompts": task.train, "steps": 1, "batch_size": 2, **change}
        with pytest.raises(exc, match=match):
            rk.fit(kw.pop("state"), kw.pop("recipe"), kw.pop("reward"), kw.pop("prompts"), **kw)
    state.step  # noqa: B018 - nothing ran: the state is still usable
    sink = rk.observe.ListSink()
    state, history = rk.fit(state, "grpo", task.reward, task.train, steps=1, batch_size=2, sinks=sink)  # a name, one sink
    assert state.step == 1 and len(history) == 1 and len(sink.history) == 1


def test_fit_hands_back_its_state_and_history_when_stopped(task, state):
    """The state passed in is donated to the first update: an error at step 3 (or Ctrl-C) used to
    lose every step before it."""
    recipe = rk.recipes.get("grpo", n=2, max_new_tokens=3)

    class Interrupt:
        def on_step(self, step, metrics):
            if step == 2:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as info:
        rk.fit(state, recipe, task.reward, task.train, steps=5, batch_size=2, sinks=[Interrupt()])
    kept = info.value.state
    assert kept.step == 2 and len(info.value.history) == 2
    assert any("exc.state" in note for note in getattr(info.value, "__notes__", []))

    def failing_eval(s):
        raise RuntimeError("eval broke")

    with pytest.raises(RuntimeError, match="eval broke") as info:
        rk.fit(kept, recipe, task.reward, task.train, steps=5, batch_size=2, eval_fn=failing_eval, eval_every=2)
    # step 3 ran; step 4's update ran, then its evaluation failed: the state after it is kept, and
    # so are step 4's training metrics (without its evaluation)
    assert info.value.state.step == 4 and len(info.value.history) == 2
    assert not any(k.startswith("eval/") for k in info.value.history[-1])
    state, history = rk.fit(info.value.state, recipe, task.reward, task.train, steps=5, batch_size=2)
    assert state.step == 5 and len(history) == 1  # the kept state trains on


def test_token_ids_outside_the_vocabulary_are_named_before_the_forward(state):
    """Ids from another tokenizer used to fail inside the embedding with 'index 60 is out of
    bounds', naming neither the field nor the cause (on a GPU: a device-side assert)."""
    import torch

    from rlkit.batch import make_batch

    vocab = state.actor.get_input_embeddings().num_embeddings
    batch = make_batch([[3, 4], [5]], [[5, 6], [7, vocab + 3]], group=[0, 0], rewards=[1.0, 0.0])
    batch.set("advantages", batch["response_mask"].float())
    batch.set("logprobs", torch.zeros(batch["response_mask"].shape))
    with pytest.raises(ValueError, match=rf"update: batch\['response_ids'\] holds token id {vocab + 3} \(row 1\), outside the model's vocabulary \[0, {vocab}\)"):
        rk.update(state, batch)
    with pytest.raises(ValueError, match=r"log-probs: batch\['response_ids'\] holds token id"):
        rk.compute_old_logprobs(state, batch)
    batch.set("prompt_ids", torch.where(batch["prompt_mask"], batch["prompt_ids"], -1))  # a pad id of -1
    batch.set("response_ids", torch.where(batch["response_mask"], batch["response_ids"], vocab + 7))  # and one past the vocabulary
    with pytest.raises(ValueError, match=rf"update: batch\['response_ids'\] holds token id {vocab + 3} \(row 1\)"):
        rk.update(state, batch)  # the real token is still named, not the pads
    batch.set("response_ids", torch.where(batch["response_ids"] == vocab + 3, 7, batch["response_ids"]))
    state, metrics = rk.update(state, batch, max_logprob_gap=None)  # pads are never embedded: any pad id goes (they were refused)
    assert metrics["actor/grad_norm"] >= 0


def test_ppo_knobs_are_checked_when_the_recipe_is_built():
    for changes, match in (({"gamma": 2.0}, r"PPO.gamma must be a number in \[0, 1\], got 2.0"),
                           ({"lam": float("nan")}, r"PPO.lam must be a number in \[0, 1\], got nan"),
                           ({"gamma": "1"}, r"PPO.gamma must be a number in \[0, 1\], got '1'"),
                           ({"value_clip": -1.0}, r"PPO.value_clip must be a finite number > 0, or None \(no value clipping\), got -1.0")):
        with pytest.raises(ValueError, match=match):
            rk.recipes.get("ppo", **changes)
        with pytest.raises(ValueError, match=match):
            rk.recipes.get("ppo").with_(**changes)
    assert rk.recipes.get("ppo", value_clip=None).value_clip is None


def test_recipe_errors_name_the_users_own_class_and_a_misspelt_step():
    """A Recipe subclass without step raised a bare NotImplementedError(); rk.fit(MyRecipe) advised
    rk.recipes.MyRecipe(...), which does not exist for a user's own class."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Typo(rk.recipes.Recipe):
        def stepp(self, state, prompts, reward):
            return state, {}

    with pytest.raises(NotImplementedError, match=r"Typo has no step method \(it defines stepp: a misspelt step\?\)"):
        Typo().step(None, [], None)
    task = rk.tasks.arithmetic(digits=1, n_train=8, n_test=4)
    state = rk.init(rk.models.tiny(task.tokenizer, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=1), rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer)
    with pytest.raises(TypeError, match=r"Typo is a recipe class; pass an instance, Typo\(\.\.\.\)$"):
        rk.fit(state, Typo, task.reward, task.train, steps=1, batch_size=2)
    with pytest.raises(TypeError, match=r"pass an instance, rk.recipes.GRPO\(\.\.\.\) or rk.recipes.get"):
        rk.fit(state, rk.recipes.GRPO, task.reward, task.train, steps=1, batch_size=2)


def test_an_estimator_parameter_that_is_no_batch_field_is_named():
    """`mask` for response_mask failed with Python's bare "missing 1 required positional argument"."""
    from rlkit.batch import make_batch

    batch = make_batch([[1, 2]] * 4, [[3, 4]] * 4, group=[0, 0, 1, 1], rewards=[1.0, 0.0, 0.5, 0.5])

    def my_estimator(token_rewards, mask, group):
        return token_rewards * mask, token_rewards * mask

    with pytest.raises(TypeError, match=r"'my_estimator' requires \['mask'\], which is no batch field .*response_mask"):
        rk.advantage(batch, my_estimator)
    out = rk.advantage(batch, my_estimator, mask=batch["response_mask"])  # given as an option, it is used
    assert torch.equal(out["advantages"], out["returns"])


def test_vllm_engine_from_model_says_vllm_is_missing_before_writing_the_model(tmp_path, monkeypatch):
    """It wrote the whole model with save_pretrained (a real model: minutes and gigabytes), then
    failed at the import of vllm."""
    from rlkit.engines import vllm_engine

    monkeypatch.setattr(vllm_engine, "_vllm_installed", lambda: False)
    task = rk.tasks.arithmetic(digits=1, n_train=4, n_test=2)
    model = rk.models.tiny(task.tokenizer, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ImportError, match=r"VLLMEngine needs vllm: `pip install 'rlkit\[vllm\]'`"):
        vllm_engine.VLLMEngine.from_model(model, task.tokenizer, directory=tmp_path / "weights")
    assert not (tmp_path / "weights").exists()
    made = []
    monkeypatch.setattr(vllm_engine.tempfile, "mkdtemp", lambda *a, **k: made.append(a) or str(tmp_path / "tmp"))
    with pytest.raises(ImportError, match="VLLMEngine needs vllm"):
        vllm_engine.VLLMEngine.from_model(model)  # nor makes its own temporary directory
    assert made == [] and not (tmp_path / "tmp").exists()
