"""Rewards as TRL and verl write them, and the reward model role: TRL rewards whose first
parameter is a keyword TRL passes, TRL's trainer_state / log_metric / log_extra, verl's async and
batched compute_score, a model given as the reward, RewardModel on encoder and decoder
classifiers, exact_match's commas, and reward weights in the recipes."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

import rlkit as rk
from rlkit.batch import make_batch, row_tokens
from rlkit.models.tokenizers import char_tokenizer
from rlkit.rewards import RewardModel, exact_match
from rlkit.transforms.score import reward_style

TOK = char_tokenizer("0123456789+= abc")


def _batch(responses=("2", "5555555"), **columns):
    n = len(responses)
    return make_batch([TOK.encode("1+1=")] * n, [TOK.encode(r) for r in responses], columns=columns or None)


def _as_trl_calls(fn, batch, **columns):
    """``fn``'s values called as TRL 1.16's GRPOTrainer._calculate_rewards calls a reward: by keyword only."""
    n = batch.batch_size[0]
    completions = [TOK.decode(ids) for ids in row_tokens(batch["response_ids"], batch["response_mask"])]
    return fn(prompts=["1+1="] * n, completions=completions,
              completion_ids=row_tokens(batch["response_ids"], batch["response_mask"]), **columns)


# 1. TRL rewards whose first parameter is a keyword: "got multiple values for argument"

def test_trl_rewards_whose_first_parameter_is_a_passed_keyword_are_called_by_keyword():
    def len_reward(completion_ids, **kwargs):  # TRL's own get_soft_overlong_punishment has this shape
        return [float(len(c)) for c in completion_ids]

    def needs_prompt(prompts, **kwargs):  # the completions reach it in kwargs, as from TRL
        return [float(len(c) < len(p)) for p, c in zip(prompts, kwargs["completions"])]

    def answer_first(answer, **kwargs):
        return [float(c == a) for c, a in zip(kwargs["completions"], answer)]

    def no_completions(prompts, answer):  # names neither completions nor **kwargs: not given them
        return [float(len(p)) + float(a) for p, a in zip(prompts, answer)]

    b = _batch(answer=["2", "2"])
    for fn in (len_reward, needs_prompt, answer_first):
        assert rk.score(b, fn, tokenizer=TOK)["rewards"].tolist() == _as_trl_calls(fn, b, answer=["2", "2"]), fn.__name__
    assert _as_trl_calls(len_reward, b) == [1.0, 7.0] and _as_trl_calls(answer_first, b, answer=["2", "2"]) == [1.0, 0.0]
    assert rk.score(b, no_completions, tokenizer=TOK)["rewards"].tolist() == [6.0, 6.0]

    def responses_first(responses, answer):  # a first parameter score does not pass: positional, as before
        return [float(r == a) for r, a in zip(responses, answer)]

    assert rk.score(b, responses_first, tokenizer=TOK)["rewards"].tolist() == [1.0, 0.0]


def test_trls_own_reward_functions_score_as_trl_scores_them():
    trl_rewards = pytest.importorskip("trl.rewards")
    b = _batch(answer=["2", "2"])
    for fn in (trl_rewards.get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=2),
               trl_rewards.get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)):
        expected = _as_trl_calls(fn, b, answer=["2", "2"])
        assert rk.score(b, fn, tokenizer=TOK)["rewards"].tolist() == pytest.approx(expected), fn.__name__
        assert len(set(expected)) == 2  # the two rows score differently: a real check


# 2. RewardModel: each sequence scored as the classifier scores it alone

def _rows():
    # rows of different lengths, so that padding goes somewhere in every layout
    prompts, responses = ["1+1=", "22+22=", "3="], ["2", "44", "abc6"]
    return [TOK.encode(p) for p in prompts], [TOK.encode(r) for r in responses]


def _alone(rm, prompts, responses):
    with torch.no_grad():
        return torch.stack([rm(input_ids=torch.tensor([p + r])).logits[0, 0] for p, r in zip(prompts, responses)])


def _classifier(kind: str, pad_token_id):
    from transformers import AutoModelForSequenceClassification, BertConfig, Qwen2Config, RobertaConfig

    torch.manual_seed(0)
    common = dict(vocab_size=len(TOK), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                  num_labels=1, pad_token_id=pad_token_id)
    config = {
        "bert": lambda: BertConfig(**common),
        "roberta": lambda: RobertaConfig(**common, max_position_embeddings=64),
        "qwen2": lambda: Qwen2Config(**common, num_key_value_heads=1),
    }[kind]()
    return AutoModelForSequenceClassification.from_config(config).eval()


@pytest.mark.parametrize("kind", ["bert", "roberta", "qwen2"])
@pytest.mark.parametrize("pad", ["batch's", "another"])
def test_reward_model_scores_encoder_and_decoder_classifiers_as_each_sequence_alone(kind, pad):
    """Encoders (BERT, RoBERTa) pool the first token: the right-aligned rows put a pad there and
    scored every row wrong, silently. Decoders pool the last token that is not pad_token_id, also
    where the classifier's pad id is not the one the batch was padded with."""
    prompts, responses = _rows()
    pad_id = TOK.pad_token_id if pad == "batch's" else TOK.convert_tokens_to_ids(" ")  # an id no row holds
    rm = _classifier(kind, pad_id)
    batch = make_batch(prompts, responses, pad_token_id=TOK.pad_token_id)
    for micro in (64, 2):
        got = rk.score(batch, RewardModel(rm, micro_batch_size=micro))["rewards"]
        torch.testing.assert_close(got, _alone(rm, prompts, responses), atol=1e-5, rtol=1e-5)
    assert rm.config.pad_token_id == pad_id  # left as it was


# 3. exact_match: only thousands separators are ignored

def test_exact_match_ignores_thousands_separators_only():
    differ = [("Paris France", "Paris, France"), ("ab", "a,b"), ("12", "1,2"), ("4,6", "46"), ("1,2,3", "123"),
              ("1234,56", "123456"), ("12,34", "1234")]
    equal = [("1,000", "1000"), ("1,234", "1234"), ("1234567", "1,234,567"), ("-1,234.5", "-1234.5"), (" 46 ", "46"),
             ("Paris, France", "Paris, France"), ("costs $1,000", "costs $1000")]
    got = exact_match([c for c, _ in differ + equal], [a for _, a in differ + equal])
    assert got == [0.0] * len(differ) + [1.0] * len(equal)


# 4. a model given as the reward

def test_a_model_given_as_the_reward_is_refused_with_the_wrapper_to_use():
    rm = _classifier("qwen2", TOK.pad_token_id)
    calls = []
    rm.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(rk.RewardError, match=r"Qwen2ForSequenceClassification is a model.*rk\.rewards\.RewardModel\(model\)"):
        rk.score(_batch(), rm, tokenizer=TOK)
    assert calls == []  # refused before any forward
    from rlkit.transforms.score import check_reward

    with pytest.raises(TypeError, match=r"fit: .*rk\.rewards\.RewardModel\(model\)"):
        check_reward({"rm": rm}, "fit")  # fit and Pipeline refuse it before the first rollout

    class LengthReward(torch.nn.Module):  # a module written as a batch-style reward is one
        def forward(self, batch):
            return batch["response_mask"].sum(-1).float()

    assert reward_style(LengthReward()) == "batch"
    assert rk.score(_batch(), LengthReward())["rewards"].tolist() == [1.0, 7.0]


# 5. TRL's trainer_state, log_metric and log_extra

def test_trl_trainer_state_log_metric_and_log_extra_are_passed_as_trl_passes_them():
    b = _batch(answer=["2", "2"])
    b.set("policy_version", torch.tensor([7, 7]))  # the batch's weights' version: TRL's global_step

    def curriculum(completions, answer, trainer_state, **kwargs):  # TRL's docs' pattern
        scale = min(1.0, trainer_state.global_step / 10)
        return [scale * float(c == a) for c, a in zip(completions, answer)]

    def logs(completions, **kwargs):
        kwargs["log_metric"]("my/len", sum(map(len, completions)))
        kwargs["log_extra"]("my_column", list(completions))  # no completions table in rlkit: accepted, ignored
        return [0.0] * len(completions)

    out = rk.score(b, {"curriculum": curriculum, "logs": logs, "logs_again": logs}, tokenizer=TOK)
    assert out["reward/curriculum"].tolist() == pytest.approx([0.7, 0.0])
    assert rk.rollout_metrics(out) == {"my/len": 8.0}  # logged twice, the mean kept
    assert rk.rollout_metrics(b) == {}  # the input batch is left as it was
    assert "my/len" not in rk.rollout_metrics(rk.score(b, curriculum, tokenizer=TOK))

    def wants_max_steps(completions, trainer_state, **kwargs):
        return [trainer_state.global_step / trainer_state.max_steps] * len(completions)

    with pytest.raises(rk.RewardError, match=r"trainer_state has only global_step.*trainer_state\.max_steps is not known"):
        rk.score(b, wants_max_steps, tokenizer=TOK)


# 6. RewardModel(micro_batch_size=0)

@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_reward_model_refuses_a_micro_batch_size_that_is_not_a_positive_int(bad):
    with pytest.raises(ValueError, match=rf"RewardModel: micro_batch_size must be a positive int.*got {bad!r}"):
        RewardModel(_classifier("qwen2", TOK.pad_token_id), micro_batch_size=bad)


# 7. async verl-style compute_score: awaited together, results in row order

N = 32


def _verl_batch(n=N, **columns):
    texts = [str(i % 10) * (1 + i % 3) for i in range(n)]
    return make_batch([TOK.encode("1+1=")] * n, [TOK.encode(t) for t in texts],
                      columns={"ground_truth": [str(i % 10) for i in range(n)], **columns}), texts


def _judge(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) + 10 * float(solution_str.startswith(ground_truth)) + 100 * int(ground_truth)


async def async_judge(data_source, solution_str, ground_truth, extra_info=None):
    # the earlier rows wait longest: they finish last, and must still come back in row order
    await asyncio.sleep(0.2 - 0.005 * int(ground_truth))
    return {"score": _judge(data_source, solution_str, ground_truth, extra_info), "latency": 0.2}


def test_async_verl_rewards_are_awaited_together_in_row_order():
    batch, _ = _verl_batch()
    expected = rk.score(batch, _judge, tokenizer=TOK)["rewards"]
    start = time.perf_counter()
    got = rk.score(batch, async_judge, tokenizer=TOK)["rewards"]
    took = time.perf_counter() - start
    assert took < 2.0, f"{N} samples of a 0.2 s async reward took {took:.2f} s (one after the other: {N * 0.2:.1f} s)"
    assert torch.equal(got, expected) and len(set(got.tolist())) > 3

    async def in_jupyter():  # a notebook cell runs inside an event loop
        return rk.score(batch, async_judge, tokenizer=TOK)["rewards"]

    start = time.perf_counter()
    assert torch.equal(asyncio.run(in_jupyter()), expected)
    assert time.perf_counter() - start < 2.0

    async def fails_on_row_5(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0.01)
        if ground_truth == "5":
            raise ConnectionError("judge unreachable")
        return 0.0

    with pytest.raises(rk.RewardError, match=r"'fails_on_row_5' raised ConnectionError: judge unreachable on sample 5 "):
        rk.score(batch, fails_on_row_5, tokenizer=TOK)


def test_verl_rewards_get_an_empty_extra_info_without_the_column_as_verl_passes_it():
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        extra_info["seen"] = True  # verl's own managers write into it: each sample has its own
        return 1.0

    batch, _ = _verl_batch(3)
    rk.score(batch, compute_score, tokenizer=TOK)
    assert seen == [{"seen": True}] * 3 and len({id(e) for e in seen}) == 3

    def record(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return 1.0

    seen.clear()
    batch, _ = _verl_batch(2, extra_info=[{"index": 0}, None])
    rk.score(batch, record, tokenizer=TOK)
    assert seen == [{"index": 0}, None]  # the column's values as they are


# 8. reward weights in the recipes

def _two_rewards():
    def length(completions, **kw):
        return [float(len(c)) for c in completions]

    def has_one(completions, **kw):
        return [float("1" in c) for c in completions]

    return {"length": length, "has_one": has_one}


def test_recipe_reward_weights_weight_the_sum_and_keep_each_reward():
    from rlkit.recipes import reward_metrics

    b = _batch(responses=("1", "22", "3331"))
    recipe = rk.recipes.get("grpo", reward_weights={"length": 0.5, "has_one": -2.0})
    out = recipe.score(SimpleNamespace(tokenizer=TOK), b, _two_rewards())
    assert out["rewards"].tolist() == [0.5 * 1 - 2.0, 0.5 * 2, 0.5 * 4 - 2.0]
    assert out["reward/length"].tolist() == [1.0, 2.0, 4.0] and out["reward/has_one"].tolist() == [1.0, 0.0, 1.0]
    m = reward_metrics(out)
    assert m["reward/length_mean"] == pytest.approx(7 / 3) and m["reward/has_one_mean"] == pytest.approx(2 / 3)
    as_list = rk.recipes.get("grpo", reward_weights=[0.5, -2.0])
    assert as_list.reward_weights == (0.5, -2.0)
    assert torch.equal(as_list.score(SimpleNamespace(tokenizer=TOK), b, _two_rewards())["rewards"], out["rewards"])
    unweighted = rk.recipes.get("grpo").score(SimpleNamespace(tokenizer=TOK), b, _two_rewards())
    assert unweighted["rewards"].tolist() == [2.0, 2.0, 5.0]  # None: each weight 1, as before


def test_recipe_reward_weights_are_checked():
    for bad in ("x", 3, [1.0, float("nan")], [True], []):
        with pytest.raises(ValueError, match=r"GRPO\.reward_weights must"):
            rk.recipes.get("grpo", reward_weights=bad)
    recipe = rk.recipes.get("grpo", reward_weights=[1.0])
    with pytest.raises(rk.RewardError, match=r"GRPO\.reward_weights=\(1\.0,\) does not fit the reward: weights has 1 values for 2"):
        recipe.score(SimpleNamespace(tokenizer=TOK), _batch(), _two_rewards())
    from rlkit.transforms.score import check_reward

    with pytest.raises(TypeError, match=r"fit: reward weights \{'length': 1\.0\} do not fit the reward: .*missing \['has_one'\]"):
        check_reward(_two_rewards(), "fit", weights={"length": 1.0})


def test_a_recipe_step_trains_on_the_weighted_rewards():
    state = rk.init(rk.models.tiny(TOK, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, seed=0),
                    rk.optim.adamw(lr=1e-4), tokenizer=TOK)
    recipe = rk.recipes.get("grpo", n=4, max_new_tokens=4, reward_weights={"length": 0.5, "has_one": 3.0})

    def has_one(completions, log_metric, **kw):  # TRL's log_metric reaches the step's metrics
        log_metric("has_one/count", sum("1" in c for c in completions))
        return [float("1" in c) for c in completions]

    reward = {"length": _two_rewards()["length"], "has_one": has_one}
    _, metrics = recipe.step(state, ["1+1=", "2+3="], reward)
    assert metrics["reward/mean"] == pytest.approx(0.5 * metrics["reward/length_mean"] + 3.0 * metrics["reward/has_one_mean"], abs=1e-5)
    assert metrics["has_one/count"] == pytest.approx(8 * metrics["reward/has_one_mean"])


# 9. verl's batched compute_score

def test_verl_batch_compute_score_is_called_once_with_lists():
    calls = []

    def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        calls.append((list(data_sources), list(solution_strs), list(ground_truths), list(extra_infos)))
        return [float(s == g) if i % 2 else {"score": float(s == g), "acc": 1} for i, (s, g) in enumerate(zip(solution_strs, ground_truths))]

    assert reward_style(compute_score) == "verl_batch"
    b = _batch(responses=("2", "3", "2"), data_source=["x", "y", "x"],
               reward_model=[{"style": "rule", "ground_truth": "2"}] * 3)
    assert rk.score(b, compute_score, tokenizer=TOK)["rewards"].tolist() == [1.0, 0.0, 1.0]
    assert calls == [(["x", "y", "x"], ["2", "3", "2"], ["2", "2", "2"], [{}, {}, {}])]

    async def async_batch(data_sources, solution_strs, ground_truths, extra_infos):
        return [float(s == g) for s, g in zip(solution_strs, ground_truths)]

    assert rk.score(_batch(responses=("2", "3"), ground_truth=["2", "2"]), async_batch, tokenizer=TOK)["rewards"].tolist() == [1.0, 0.0]

    def one_fails(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0 / (s != "3") for s in solution_strs]

    with pytest.raises(rk.RewardError, match=r"'one_fails' raised ZeroDivisionError.* on sample 1 \(prompt '1\+1=', response '3'\)"):
        rk.score(_batch(responses=("2", "3"), ground_truth=["2", "2"]), one_fails, tokenizer=TOK)


# 1 and 9 under rlkit.parallel.shard_reward, on 2 processes

def _sharded_job() -> dict:
    import torch.distributed as dist

    from rlkit.parallel import init_distributed, shard_reward, shutdown
    from rlkit.transforms.score import score

    init_distributed()
    seen: dict[str, list] = {"ids": [], "verl": []}

    def len_reward(completion_ids, **kwargs):
        seen["ids"].append(len(completion_ids))
        return [float(len(c)) + kwargs["trainer_state"].global_step for c in completion_ids]

    def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        seen["verl"].append(len(solution_strs))
        return [{"score": float(s == g) + len(s)} for s, g in zip(solution_strs, ground_truths)]

    b = make_batch([[1, 2]] * 5, [[3], [4, 4], [5], [6, 6, 6], [7]],
                   columns={"ground_truth": ["a", "bb", "x", "ddd", "y"], "response_text": ["a", "bb", "c", "ddd", "e"],
                            "prompt_text": ["p"] * 5})
    sharded = score(b, shard_reward({"ids": len_reward, "verl": compute_score}))
    single = score(b, {"ids": len_reward, "verl": compute_score})
    out = {"rank": dist.get_rank(), "seen": seen, "sharded": sharded["rewards"].tolist(), "single": single["rewards"].tolist()}
    shutdown()
    return out


@pytest.mark.distributed
def test_sharded_rewards_use_the_same_calling_rule():
    from rlkit.parallel.local import run_local

    for r in run_local(_sharded_job, 2, timeout=120):
        expected = [1.0 + 2.0, 2.0 + 3.0, 1.0 + 1.0, 3.0 + 4.0, 1.0 + 1.0]  # len(ids) + (match + len(text))
        assert r["sharded"] == r["single"] == expected
        # each rank scored its own share (3 + 2 rows), then every row on one process
        assert r["seen"] == {"ids": [[3], [2]][r["rank"]] + [5], "verl": [[3], [2]][r["rank"]] + [5]}


def test_batch_style_reward_errors_show_the_samples_text():
    """Only TRL-style rewards had their texts decoded: a batch-style reward's NaN named sample 1
    with prompt '?' and response '?' though a tokenizer was given."""
    from rlkit.transforms.score import RewardError

    tok = char_tokenizer("0123456789+= ")
    b = make_batch([tok.encode("1+1=")] * 2, [tok.encode("2"), tok.encode("3")], group=[0, 0])
    with pytest.raises(RewardError, match=r"returned nan for sample 1 \(prompt '1\+1=', response '3'\)"):
        rk.score(b, lambda batch: torch.tensor([1.0, float("nan")]), tokenizer=tok)
    with pytest.raises(RewardError, match=r"sample 1 \(prompt '\?', response '\?'\)"):  # no tokenizer: no text to show
        rk.score(b, lambda batch: torch.tensor([1.0, float("nan")]))


def test_a_varargs_wrapper_is_called_by_keyword_as_trl_calls_it():
    """f(*args, **kwargs) (a decorator without functools.wraps, or a reward reading kwargs) got the
    completions positionally: "got multiple values for argument 'prompts'", or a KeyError."""
    b = make_batch([[5, 6], [5, 6]], [[7, 8], [9]], group=[0, 0], columns={"solution": ["1", "2"]})
    rk.set_column(b, "response_text", ["1", "2"])
    rk.set_column(b, "prompt_text", ["p", "p"])

    def logged(fn):
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper

    @logged
    def accuracy(prompts, completions, solution, **kwargs):
        return [float(c == s) for c, s in zip(completions, solution)]

    def generic(*args, **kwargs):
        assert not args
        return [float(len(c)) for c in kwargs["completions"]]

    assert rk.score(b, accuracy)["rewards"].tolist() == [1.0, 1.0]
    assert rk.score(b, generic)["rewards"].tolist() == [1.0, 1.0]


def test_builtin_rewards_read_trls_conversational_completions():
    """With chat prompts TRL passes each completion as [{"role": "assistant", "content": text}]:
    exact_match and math_answer scored right answers 0.0, hash_format and format_reward raised."""
    from rlkit.rewards import format_reward, hash_format, math_answer

    texts = ["#### 42", "41"]
    chat = [[{"role": "assistant", "content": t}] for t in texts]
    answers = ["42", "41"]
    for fn in (exact_match, math_answer, hash_format, format_reward(r"#### \d+")):
        kw = {"answer": answers} if fn in (exact_match, math_answer) else {}
        assert fn(completions=chat, **kw) == fn(completions=texts, **kw), fn.__name__
    assert exact_match(completions=chat, answer=["#### 42", "41"]) == [1.0, 1.0]
    assert math_answer(completions=chat, answer=answers) == [1.0, 0.0]


def test_text_prompts_keep_the_tokenizers_bos_as_trl_encodes_them(tmp_path):
    """load_prompts (so rollout and fit) and the SFT warm-up tokenized text prompts with
    add_special_tokens=False: a Llama-style tokenizer's BOS was dropped, where TRL's
    processing_class(text=...) and vLLM keep it. A trailing special token (an EOS a post-processor
    appends) is not part of a prompt."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from rlkit.sft import sft_batch

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate("0123456789+=")}}
    for post, expected in (
        ("<s> $A", [1, 5, 6, 14, 7, 8, 15]),  # Llama: BOS before
        ("<s> $A </s>", [1, 5, 6, 14, 7, 8, 15]),  # BOS and EOS: the EOS does not end the prompt
        ("$A", [5, 6, 14, 7, 8, 15]),  # nothing added (Qwen, GPT-2, the char tokenizer): unchanged
    ):
        core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        core.post_processor = processors.TemplateProcessing(single=post, special_tokens=[("<s>", 1), ("</s>", 2)])
        tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                      unk_token="<unk>")
        assert rk.load_prompts(["12+34="], tok).ids[0] == expected, post
        sft = sft_batch(tok, [("12+34=", "46")])
        assert row_tokens(sft["prompt_ids"], sft["prompt_mask"])[0] == expected, post
