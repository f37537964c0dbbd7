"""Held-out evaluation: greedy (or sampled) generation on a prompt set, scored by a reward."""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from rlkit._checks import check_context, check_seed, int_at_least, model_of, tokenizer_of
from rlkit.data import DataError, Prompts, PromptSet, load_prompts
from rlkit.engines.base import SamplingParams


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokenizer,
    prompts: PromptSet | Prompts,
    reward: Callable | Sequence[Callable] | Mapping[str, Callable],
    *,
    max_new_tokens: int = 16,
    batch_size: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    engine=None,
) -> dict[str, float]:
    """Mean reward (= accuracy for 0/1 rewards) of ``model`` on ``prompts``; greedy by default.

    ``reward``: a function, or several as :func:`rlkit.score` takes them (a list, a ``{name:
    function}`` dict). With several, ``"accuracy"`` is the mean of their sum (unit weights), and
    each function's own mean is reported as ``"reward/<name>"`` (over the samples it scored: one
    returning None for a sample leaves it out), so ``[accuracy, format_ok]`` reads
    ``reward/accuracy`` for the accuracy.

    ``model``: a model, or a TrainState (its actor; a state lowered with ``Pipeline.lower`` onto
    colocated ranks generates with its rollout engine, so call it on every rank). ``prompts``: a PromptSet, a Prompts batch, or
    anything :func:`rlkit.load_prompts` reads. ``engine``: None (the built-in
    :class:`rlkit.engines.TorchEngine`), an engine name as :func:`rlkit.rollout` takes it ("torch",
    "hf", "vllm"), or an Engine object. Responses stop where :func:`rlkit.rollout`'s do by default:
    at the tokenizer's EOS and at the model's ``generation_config`` eos ids.

    ``temperature > 0`` samples from one generator seeded with ``seed``, drawn from chunk after
    chunk of ``batch_size`` prompts: the same ``seed`` and ``batch_size`` repeat a result, while
    another ``batch_size`` draws other samples (and another accuracy). Greedy results do not
    depend on ``batch_size``."""
    from rlkit.engines.torch_engine import TorchEngine
    from rlkit.transforms.score import score
    from rlkit.transforms.rollout import batch_from_generation as from_generation

    lowered = None
    from rlkit.state import TrainState

    if isinstance(model, TrainState) and engine is None and ("dp" in model._cache or "split" in model._cache):
        if "split" in model._cache:
            raise ValueError("evaluate: this state is lowered onto a split placement, whose training ranks hold no rollout "
                             "engine; evaluate with rk.rollout(state, prompts, temperature=0) and rk.score on every rank")
        lowered = model  # its actor is FSDP shards: generate with its rollout engine, synced to them
    model = model_of(model, "evaluate")
    tokenizer = tokenizer_of(tokenizer, "evaluate")
    int_at_least(batch_size, "evaluate: batch_size", 1, " (prompts per generate call)")
    check_seed(seed, "evaluate", " (seeds the sampling when temperature > 0)")
    if not isinstance(prompts, (PromptSet, Prompts)):
        prompts = load_prompts(prompts, tokenizer)  # a list of strings or rows, a .jsonl/.json/.csv/.parquet path, a DataFrame, a Dataset
    if len(prompts) == 0:
        raise DataError("evaluate got no prompts; an accuracy over none would be meaningless")
    longest = max(range(len(prompts)), key=lambda i: len(prompts.ids[i]))
    check_context(model, len(prompts.ids[longest]) + max_new_tokens,
                  f"evaluate: prompt {longest} ({len(prompts.ids[longest])} tokens) with max_new_tokens={max_new_tokens}",
                  "shorten the prompts or lower max_new_tokens")
    for i, ids in enumerate(prompts.ids):  # numbered in the whole set, not in one generate call's chunk
        if not len(ids):
            raise DataError(f"evaluate: prompt {i} tokenized to zero tokens ({prompts.text[i]!r}); give non-empty prompts")
    if lowered is not None:
        from rlkit.transforms.rollout import get_engine, sync_engine

        eng = get_engine(lowered)
        sync_engine(lowered, eng)  # a collective when the weights moved: every rank evaluates
    elif engine is None:
        eng = TorchEngine.from_model(model)
    elif isinstance(engine, str):  # as rollout takes it: "torch", "hf" or "vllm"
        from rlkit.transforms.rollout import engine_for

        eng = engine_for(model, tokenizer, engine)
    elif callable(getattr(engine, "generate", None)):
        eng = engine
    else:
        raise TypeError(f"evaluate: engine must be None (the built-in engine), a name ('torch', 'hf', 'vllm') or an "
                        f"Engine, got {type(engine).__name__}")
    from rlkit.transforms.rollout import default_stop_token_ids

    # the stop ids rollout uses: the tokenizer's EOS and the model's generation_config eos ids
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=temperature,
                            stop_token_ids=default_stop_token_ids(tokenizer, model))
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    total, count, lengths = 0.0, 0, 0.0
    parts: dict[str, list[float]] = {}  # per reward function (several): [sum, samples it scored]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            index = list(range(start, min(len(prompts), start + batch_size)))
            chunk = prompts.take(index) if isinstance(prompts, PromptSet) else prompts[start : start + batch_size]
            out = eng.generate(chunk.ids, params, generator=g)
            batch = from_generation(chunk, out, tokenizer, policy_version=0)
            scored = score(batch, reward)
            total += float(scored["rewards"].sum())
            count += len(index)
            for key in scored.keys():
                if isinstance(key, str) and key.startswith("reward/"):
                    values = scored[key]
                    present = ~torch.isnan(values)  # NaN: the function returned None ("does not apply")
                    part = parts.setdefault(key, [0.0, 0])
                    part[0] += float(values[present].sum())
                    part[1] += int(present.sum())
            lengths += float(batch["response_mask"].sum())
    finally:
        model.train(was_training)
    result = {"accuracy": total / max(count, 1), "mean_response_len": lengths / max(count, 1), "n": float(count)}
    if len(parts) > 1:
        # several rewards: "accuracy" alone was their sum (0.75 for accuracy 0.25 and format 0.5)
        result.update({key: part[0] / part[1] if part[1] else float("nan") for key, part in parts.items()})
    return result
