"""``rollout(state, prompts, n=...) -> Batch``: sample responses with the actor's weights.

Token in, token out: the Batch carries the sampled ids, the behaviour log-probs the engine
sampled them with, the policy version that produced them and the decoded text for rewards.

The engine is built once and cached with the state (default: the built-in torch engine, which
reads the actor's own parameter storage, so a weight sync is free). An engine with its own copy
of the weights is synced whenever its ``policy_version`` lags the state's, so a stale engine is
impossible by construction.
"""
from __future__ import annotations

import secrets
import time
from typing import Any, Sequence

import torch

from rlkit._checks import check_seed, check_switch, context_limit, is_int, output_vocab
from rlkit.batch import PROMPT_MESSAGES, ROLLOUT_ROW, ROW_BITS, Batch, check_same_fields, row_tokens, set_column, shallow_copy
from rlkit.data import Prompts, as_prompts, check_padding
from rlkit.engines.base import Engine, SamplingParams
from rlkit.state import TrainState, fold_in, generator
# TEMPERATURE: the per-row float field of the temperature the logprobs are at
from rlkit.transforms.forward import TEMPERATURE

ENGINES = ("torch", "hf", "vllm")


def make_engine(state: TrainState, kind: str = "torch", **kwargs) -> Engine:
    """Build a rollout engine for the state's actor: "torch" (built-in), "hf" or "vllm"."""
    return engine_for(state.actor, state.tokenizer, kind, **kwargs)


def engine_for(model, tokenizer, kind: str = "torch", **kwargs) -> Engine:
    """Build a rollout engine of ``kind`` ("torch", "hf" or "vllm") for ``model``."""
    if kind == "torch":
        from rlkit.engines.torch_engine import TorchEngine

        return TorchEngine.from_model(model, **kwargs)
    if kind == "hf":
        from rlkit.engines.hf_engine import HFEngine

        return HFEngine(model, tokenizer, **kwargs)
    if kind == "vllm":
        from rlkit.engines.vllm_engine import VLLMEngine

        return VLLMEngine.from_model(model, tokenizer, **kwargs)
    raise ValueError(f"unknown engine {kind!r}; valid: {', '.join(ENGINES)} (or pass an Engine object)")


def get_engine(state: TrainState, engine: str | Engine | None = None) -> Engine:
    if engine is not None and not isinstance(engine, str):
        return engine
    cache = state._cache
    # None is the built-in engine, not whichever kind the last call named: a one-off
    # rollout(engine="hf") used to become the default of every later call on the state
    kind = engine or "torch"
    current = cache.get("engine")
    _check_lowered_engine(cache, kind)
    if current is None or cache.get("engine_kind") != kind:
        current = make_engine(state, kind)
        current.policy_version = state.policy_version
        cache["engine"], cache["engine_kind"] = current, kind
    return current


def _check_lowered_engine(cache: dict, kind: Any) -> None:
    """A lowered state generates with the engine its plan built: its actor is sharded (DTensors),
    so another engine built over it failed deep inside generate (and replaced the plan's engine);
    under split placement the choice was silently ignored."""
    if ("dp" in cache or "split" in cache) and kind != cache.get("engine_kind", "torch"):
        raise ValueError(f"engine={kind!r}: this state is lowered onto several processes (Plan.shard), and generates "
                         f"with the engine its plan built ({cache.get('engine_kind', 'torch')!r}); leave engine unset "
                         "(None) on a lowered state, or use the other engine on one process")


def _no_sync(engine: Engine) -> dict[str, float]:
    """The sync metrics of a rollout that moved no weights: zeros under the keys the engine's
    syncs report (``Engine.sync_keys``, optional), so every step logs the same ``sync/*`` keys;
    they had been missing on the first step of a fresh or resumed run."""
    return {f"sync/{k}": 0.0 for k in getattr(engine, "sync_keys", ("bytes", "seconds"))}


def sync_engine(state: TrainState, engine: Engine) -> dict[str, float]:
    """Bring the engine to the state's policy version (no-op for shared-storage engines)."""
    if engine.policy_version == state.policy_version:
        return _no_sync(engine)
    if getattr(engine, "shares_storage", False):
        engine.policy_version = state.policy_version
        return _no_sync(engine)
    sync_fn = state._cache.get("weight_sync")
    if sync_fn is not None:
        report = sync_fn(state, engine)
    else:
        named = [(k, v.detach()) for k, v in state.actor.state_dict().items()]
        report = engine.load_weights(named, version=state.policy_version)
    engine.policy_version = state.policy_version
    return {f"sync/{k}": float(v) for k, v in (report or {}).items()}


def rollout(
    state: TrainState,
    prompts: Prompts | Sequence[str] | Sequence[dict],
    *,
    n: int = 1,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] | None = None,
    ignore_stop: bool = False,
    seed: int | None = None,
    engine: str | Engine | None = None,
    decode: bool = True,
) -> Batch:
    """Sample ``n`` responses per prompt; returns a Batch (prompt-major rows, ``group`` = prompt).

    ``seed`` defaults to ``fold_in(state.seed, state.step)``: the same state samples the same
    responses, and a resumed run samples what the uninterrupted run would on the same number of
    generation replicas. Lowered onto several replicas (``Pipeline.lower()`` on N processes, N/tp
    with ``tp``, the rollout ranks of a split placement), each replica samples its contiguous share
    of the prompts with the built-in engine as one process samples those rows
    (``TorchEngine.generate(rows=...)``: the noise of the whole batch, from the same key), so the
    responses do not depend on the number of replicas, up to the rounding of the logits over
    another batch (a near-tie can flip a token). Other engines ("hf", "vllm") sample only their own
    rows: there each replica folds its index into the key (``fold_in(key, "replica", i)``) and the
    responses depend on the number of replicas. Pass a different
    seed (``rk.fold_in(state.seed, state.step, attempt)``) to resample within one step.

    ``engine``: None (the built-in :class:`rlkit.engines.TorchEngine`), a name ("torch", "hf",
    "vllm") or an Engine object. A named engine is built once and kept with the state while calls
    keep naming it.

    ``stop_token_ids``: ids (a list, a tensor or one int) that end a response, used as given.
    None (the default): the tokenizer's ``eos_token_id`` followed by the actor's
    ``generation_config.eos_token_id`` (an int or a list), de-duplicated, so a checkpoint whose
    end-of-turn token is only in its generation config (Llama-3-Instruct's ``<|eot_id|>``) stops
    there, as ``model.generate`` does. Every engine receives them as ``SamplingParams.stop_token_ids``.

    ``logprobs`` are the behaviour log-probs the engine sampled with: with ``top_k > 0`` or
    ``top_p < 1`` those of the *filtered* distribution, ``log softmax(top_p(top_k(logits / T)))``.
    Such a batch also carries ``logprobs_filtered (b)`` (bool, True on those rows; absent when no
    filter was asked for); :func:`rlkit.update` then recomputes the old-policy log-probs of those
    rows with the trainer (its ratio is 1 before its first step) instead of using the filtered ones,
    and leaves them out of its train-vs-rollout gap.

    The batch records the temperature its ``logprobs`` are at as ``temperature (b)`` (float32; 1.0
    for greedy decoding, ``temperature=0``, whose log-probs are the plain log-softmax):
    :func:`rlkit.compute_old_logprobs`, :func:`rlkit.compute_ref_logprobs` and :func:`rlkit.update`
    compute theirs at it unless given a temperature.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"rollout expects a TrainState first (from rk.init), got {type(state).__name__}")
    decode = check_switch(decode, "rollout: decode", "True: the responses' text in response_text; False: token ids only")
    tokenizer = state.tokenizer
    prompts = as_prompts(prompts, tokenizer)
    if len(prompts) == 0:
        raise ValueError("rollout got no prompts")
    for i, ids in enumerate(prompts.ids):
        if not ids:
            raise ValueError(f"prompt {i} tokenized to zero tokens ({prompts.text[i]!r}); give non-empty prompts")
    check_padding(prompts.ids, tokenizer, "rollout")
    if stop_token_ids is None:
        stop_token_ids = default_stop_token_ids(tokenizer, state.actor)
    elif isinstance(stop_token_ids, torch.Tensor):
        stop_token_ids = stop_token_ids.reshape(-1).tolist()
    elif is_int(stop_token_ids):  # one id (tokenizer.eos_token_id): tuple() of it was a TypeError
        stop_token_ids = (stop_token_ids,)
    if seed is not None:
        check_seed(seed, "rollout", " or None (from state.seed and state.step)")
    max_pos = context_limit(state.actor)
    longest = max(len(p) for p in prompts.ids)
    if max_pos is not None and longest + max_new_tokens > max_pos:
        i = max(range(len(prompts)), key=lambda k: len(prompts.ids[k]))
        raise ValueError(
            f"prompt {i} has {longest} tokens; with max_new_tokens={max_new_tokens} that exceeds the model's "
            f"context of {max_pos} tokens (max_position_embeddings). Shorten the prompt, lower max_new_tokens, "
            "or load prompts with max_prompt_tokens=..., truncate=True"
        )
    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            stop_token_ids=tuple(stop_token_ids), ignore_stop=ignore_stop)
    key = fold_in(state.seed, state.step, "rollout") if seed is None else seed
    if "split" in state._cache:
        if engine is not None:
            _check_lowered_engine(state._cache, engine if isinstance(engine, str) else type(engine).__name__)
        return _split_rollout(state, prompts, params, key, decode)
    eng = get_engine(state, engine)
    with torch.profiler.record_function("rlkit.weight_sync"):  # names the range in a profiler trace
        sync = sync_engine(state, eng)
    batch, seconds, engine_metrics = _sample_share(state, eng, prompts, params, key, state._cache.get("rollout_dp"), decode)
    return _with_metrics(batch, seconds, {**sync, **engine_metrics})


def _eos_ids(value: Any) -> list[int]:
    """The token ids of an ``eos_token_id`` setting (None, an int, or a list/tuple/tensor of them);
    anything else (a negative id, text) is not an id and is left out."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if is_int(v) and v >= 0]


def default_stop_token_ids(tokenizer, model) -> tuple[int, ...]:
    """``rollout``'s default stop ids: the tokenizer's EOS, then the ids of ``model``'s
    ``generation_config.eos_token_id`` (an int or a list: Llama-3-Instruct lists ``<|eot_id|>``
    there, not as the tokenizer's EOS), de-duplicated in that order."""
    ids = _eos_ids(getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None)
    for m in (model, getattr(model, "_orig_mod", None)):  # torch.compile's wrapper forwards attributes, but not every wrapper does
        config = getattr(m, "generation_config", None) if m is not None else None
        if config is not None:
            ids += _eos_ids(getattr(config, "eos_token_id", None))
            break
    return tuple(dict.fromkeys(ids))


def _sample_share(state: TrainState, eng: Engine, prompts: Prompts, params: SamplingParams, key: int, dp, decode: bool):
    """Sample this generation replica's contiguous share of the prompts (whole groups) and gather
    every replica's rows into one Batch; returns ``(batch, seconds, engine metrics)``."""
    start, rows = 0, {}
    if dp is not None and dp.size > 1:
        if len(prompts) % dp.size:
            raise ValueError(f"{len(prompts)} prompts cannot be split evenly over {dp.size} generation replicas; use a multiple of {dp.size}")
        from rlkit.pipeline import split_prompts

        total = len(prompts) * params.n
        prompts, start = split_prompts(prompts, dp)
        if getattr(eng, "samples_batch_rows", False):
            # every replica keeps the step's key and samples its rows as one process would: the
            # responses do not depend on how many replicas share the batch
            rows = {"rows": (start * params.n, total)}
        else:  # an engine that samples its own rows only: replicas must not draw the same noise
            key = fold_in(key, "replica", dp.rank)
    device = _engine_device(eng, state)
    gen = generator(key, device=device if device.type in ("cpu", "cuda") else "cpu")
    t0 = time.perf_counter()
    with torch.profiler.record_function("rlkit.engine.generate"):
        out = eng.generate(prompts.ids, params, generator=gen, **rows)
    seconds = time.perf_counter() - t0
    if state._cache.get("release_engine") and hasattr(eng, "release"):
        eng.release()  # colocated roles take turns: training gets the KV-cache memory back
    with torch.profiler.record_function("rlkit.rollout.batch"):
        batch = batch_from_generation(prompts, out, state.tokenizer, policy_version=state.policy_version, decode=decode,
                                      filtered=is_filtered(params, output_vocab(state.actor)), temperature=params.temperature)
        # before the gather: each replica numbers its own rows under its own key, and every rank
        # then holds the same gathered ids
        batch.set(ROLLOUT_ROW, new_rollout_rows(batch.batch_size[0]))
    if dp is not None and dp.size > 1:
        from rlkit.parallel.placement import gather_rows

        batch.set("group", batch["group"] + start)
        with torch.profiler.record_function("rlkit.rollout.gather_rows"):
            batch = gather_rows(batch, dp.mesh)
    # the engine's own rate is of this replica's rows: named apart from rollout/tokens_per_s (the whole
    # gathered batch's), which it undercut N-fold on N replicas under a name that read the same
    names = {"tokens_per_second": "replica_tokens_per_s"}
    return batch, seconds, {f"rollout/{names.get(k, k)}": float(v) for k, v in out.metrics.items()}


def _with_metrics(batch: Batch, seconds: float, extra: dict[str, float]) -> Batch:
    tokens = float(batch["response_mask"].sum())
    metrics = {
        "rollout/seconds": seconds,
        "rollout/truncated_frac": float(batch["truncated"].float().mean()),
        "rollout/response_len": tokens / batch.batch_size[0],
        **extra,  # the engine's own figures (rollout/seconds: its generate time)
        # the whole (gathered) batch's count: the engine's is its replica's share, so ranks reported
        # different rollout/tokens
        "rollout/tokens": tokens,
    }
    # the rate of the seconds reported beside it (the engine's generate time when it gives one): it
    # was of the outer timer's, 2% below rollout/tokens / rollout/seconds in the same dict
    metrics["rollout/tokens_per_s"] = tokens / max(float(metrics["rollout/seconds"]), 1e-9)
    batch.set_non_tensor("rollout_metrics", metrics)
    return batch


#: the per-row bool field marking rows whose ``logprobs`` are of a top-k/top-p filtered distribution
FILTERED = "logprobs_filtered"


def is_filtered(params: SamplingParams, vocab: int | None = None) -> bool:
    """Whether ``params`` sample from a filtered distribution (top-k or top-p): the engine's
    log-probs are then of ``log softmax(top_p(top_k(logits / T)))``, not of the policy the trainer
    computes (``log softmax(logits / T)``). Greedy decoding (``temperature == 0``) reports the
    plain log-softmax whatever the filters (:class:`rlkit.engines.base.Generation`). With the
    logits' width ``vocab`` given, a ``top_k`` of ``vocab`` or more keeps every token (the engines
    sample as unfiltered) and is not a filter: such a batch keeps ``update``'s
    ``actor/logprob_gap`` check and skips the recomputed old log-probs."""
    top_k = params.top_k > 0 and (vocab is None or params.top_k < vocab)
    return params.temperature > 0 and (top_k or params.top_p < 1)


def batch_from_generation(prompts: Prompts, out, tokenizer, *, policy_version: int = 0, decode: bool = True,
                          filtered: bool = False, temperature: float | None = None) -> Batch:
    """Turn an engine's :class:`Generation` for ``prompts`` into a Batch (prompt-major rows).

    ``filtered``: the engine sampled with top-k/top-p (:func:`is_filtered`); the Batch then has a
    ``logprobs_filtered`` field, True on every row. ``temperature``: the sampling temperature; the
    Batch then has a ``temperature`` field (float32), the temperature of its ``logprobs`` on every
    row: 1.0 for greedy decoding (0), whose log-probs are temperature-1 (None: no such field).

    Where ``prompts.messages`` is set (some prompt was a chat conversation) the Batch has a
    ``prompt_messages`` column: each row's conversation, None on text rows. It is set for every
    batch of such a prompt set, a share without a conversation included, so the batches (and the
    replicas' shares gathered into one) have the same columns."""
    from rlkit.batch import _pad_left

    index = out.prompt_index.cpu()
    b = len(index)
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    pad = 0 if pad is None else pad
    rows = index.tolist()
    # each prompt padded once, then repeated for its rows (the n samples share it)
    used = sorted(set(rows))
    u_ids, u_mask = _pad_left([prompts.ids[i] for i in used], pad)
    slot = {prompt: k for k, prompt in enumerate(used)}
    where = torch.tensor([slot[i] for i in rows], dtype=torch.long)
    p_ids, p_mask = u_ids[where], u_mask[where]
    batch = Batch(
        {
            "prompt_ids": p_ids,
            "prompt_mask": p_mask,
            "response_ids": out.response_ids.cpu(),
            "response_mask": out.response_mask.cpu().bool(),
            "logprobs": out.logprobs.cpu().float(),
            "truncated": out.truncated.cpu().bool(),
            "group": index.clone(),
            "policy_version": torch.full((b,), policy_version, dtype=torch.long),
        },
        batch_size=[b],
    )
    if filtered:
        batch.set(FILTERED, torch.ones(b, dtype=torch.bool))
    if temperature is not None:
        batch.set(TEMPERATURE, torch.full((b,), float(temperature) if temperature > 0 else 1.0, dtype=torch.float32))
    set_column(batch, "prompt_text", [prompts.text[i] for i in rows])
    messages = getattr(prompts, "messages", None)
    if messages is not None:
        # the n samples of a prompt share its list: rk.score hands rewards copies
        set_column(batch, PROMPT_MESSAGES, [messages[i] for i in rows])
    for name, values in prompts.columns.items():
        set_column(batch, name, [values[i] for i in rows])
    if decode and tokenizer is not None:
        from rlkit.models.tokenizers import decode_batch

        texts = decode_batch(tokenizer, row_tokens(batch["response_ids"], batch["response_mask"]))
        set_column(batch, "response_text", texts)
    return batch


def _split_rollout(state: TrainState, prompts: Prompts, params: SamplingParams, key: int, decode: bool) -> Batch:
    """Split placement: the rollout ranks sample (after receiving new weights from the actor
    ranks when the policy moved), then every rank gets the same global Batch."""
    import torch.distributed as dist

    cache, roles = state._cache, state._cache["split"]
    sync = _no_sync(cache.get("engine"))  # the keys of Pipeline._split_sync's report: the engine's sync_keys
    if cache.get("synced_version") != state.policy_version:
        sync = {f"sync/{k}": v for k, v in cache["split_sync"](state).items()}  # collective
        cache["synced_version"] = state.policy_version
    payload: list = [None]
    if dist.get_rank() in roles.rollout_ranks:
        # the sync figures travel with the batch: the first rollout rank's are what the generation
        # side received (a training rank receives nothing, and rank 0's metrics read "0 bytes")
        payload = [(*_sample_share(state, cache["engine"], prompts, params, key, cache["rollout_dp"], decode), sync)]
    dist.broadcast_object_list(payload, src=roles.rollout_ranks[0])
    batch, seconds, engine_metrics, sync = payload[0]
    return _with_metrics(batch, seconds, {**sync, **engine_metrics})


def _engine_device(engine, state) -> torch.device:
    device = getattr(engine, "device", None)
    if device is not None:
        return torch.device(device)
    try:
        return state.device
    except Exception:  # noqa: BLE001 - sharded parameters: fall back to the default device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """The timing/length metrics ``rollout`` attached to a batch ({} if none), and what a TRL-style
    reward logged into it through ``log_metric`` when ``rk.score`` scored it.

    ``rollout/tokens_per_s`` is the whole batch's generated tokens per second of rollout time;
    ``rollout/replica_tokens_per_s`` the engine's own rate over the rows it generated (one
    replica's share when the rollout is split over N replicas, so about 1/N of the first)."""
    try:
        value = batch.get_non_tensor("rollout_metrics")
    except KeyError:
        return {}
    return dict(value) if isinstance(value, dict) else {}


def new_rollout_rows(rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``(rows)`` fresh :data:`ROLLOUT_ROW` ids for one rollout's rows: one new rollout key in the
    high bits, the row number ``0 .. rows - 1`` in the low :data:`ROW_BITS`.

    The key is drawn from the operating system (``secrets``), not from torch's or Python's seeded
    generators: recording it moves no RNG, so sampling stays what the seed makes it. It is random
    rather than a counter so that rollouts of other processes (generation replicas, a pickled
    batch) do not share keys; 39 bits make two of a handful of concatenated rollouts collide with
    odds of about 1e-11."""
    if rows >= 1 << ROW_BITS:
        raise ValueError(f"{rows} rows exceed the {1 << ROW_BITS} that {ROLLOUT_ROW!r} ids number in one rollout; "
                         "sample (or concatenate) fewer rows at a time")
    key = secrets.randbits(63 - ROW_BITS)
    return torch.arange(rows, dtype=torch.long, device=device) + (key << ROW_BITS)


def _pad_width(value: torch.Tensor, width: int, left: bool) -> torch.Tensor:
    """``value (b w)`` padded with 0 (False) to ``(b width)``, on the left or on the right.

    ``F.pad`` makes the padding on ``value``'s device: ``torch.full``/``torch.zeros`` without
    ``device=`` made it on the CPU, and ``torch.cat`` refused a CUDA part of another width."""
    extra = width - value.shape[1]
    if not extra:
        return value
    return torch.nn.functional.pad(value, [extra, 0] if left else [0, extra], value=0)


def _rejoined_groups(parts: Sequence[Batch]) -> list[torch.Tensor] | None:
    """The ``group`` of each part in :func:`concat`'s result, or None where the parts are rows of
    one rollout, whose groups (and :data:`ROLLOUT_ROW` ids) stay as they are.

    A row's group is identified by its source and its ``group``: the source is its rollout (the key
    in its ``rollout_row``), or the part itself where the part has no ``rollout_row`` (a hand-made
    batch: each part its own source, as concat always did). A part holding rows an earlier part
    already holds (``concat([a, a])``) is another copy, a source of its own: its groups are repeats
    to train on again, not extra samples of the same prompts (merged, GRPO's std and RLOO's
    leave-one-out baseline would count each response twice). Labels are ``0 .. G-1`` ordered by
    source (in order of first appearance, never by the random keys) then by ``group``: parts of
    different rollouts get the consecutive blocks concat always gave them."""
    copies: list[torch.Tensor] = []  # the rollout_row ids of each copy
    sources: dict[tuple, int] = {}
    pairs = []
    for i, part in enumerate(parts):
        rows = part.batch_size[0]
        group = part["group"].cpu()
        if ROLLOUT_ROW not in part.keys():
            source = torch.full((rows,), sources.setdefault(("part", i), len(sources)), dtype=torch.long)
        else:
            ids = part[ROLLOUT_ROW].cpu()
            copy = 0  # the first copy none of whose rows this part repeats
            while copy < len(copies) and torch.isin(ids, copies[copy]).any():
                copy += 1
            if copy == len(copies):
                copies.append(ids)
            else:
                copies[copy] = torch.cat([copies[copy], ids])
            keys = (ids >> ROW_BITS).tolist()
            number = {key: sources.setdefault((copy, key), len(sources)) for key in dict.fromkeys(keys)}
            source = torch.tensor([number[key] for key in keys], dtype=torch.long)
        pairs.append(torch.stack([source, group.long()], 1))
    if len(sources) == 1 and all(ROLLOUT_ROW in part.keys() for part in parts):
        return None
    _, labels = torch.unique(torch.cat(pairs), dim=0, return_inverse=True)
    return list(labels.split([part.batch_size[0] for part in parts]))


def concat(batches: Sequence[Batch]) -> Batch:
    """Concatenate batches: rows of one rollout keep their groups, rows of different ones never merge.

    Rows sampled by :func:`rollout` carry :data:`ROLLOUT_ROW` (which rollout call, and which row
    of it), which indexing and :func:`rlkit.batch.split` keep. Parts that are rows of one rollout
    (``concat(split(batch, 2))``, slices or shuffles of it) come back with their ``group`` and
    ``rollout_row`` unchanged, so a group cut between parts is whole again: renumbering each
    part's groups apart cut a group of 4 into two of 2, and GRPO normalised each half (+-0.707),
    silently when the halves were equal. Parts of different rollouts (DAPO's dynamic sampling
    concatenates several of one step's prompts), of batches without ``rollout_row`` (hand-made,
    each part on its own) and repeated rows (``concat([a, a])``: a second copy) get distinct
    ``group`` ids, ``0 .. G-1`` in part order, and the result new ``rollout_row`` ids: it is a
    batch of its own, whose parts :func:`concat` rejoins in turn. Batches none of which has
    ``rollout_row`` concatenate as before: each part's groups renumbered after the last part's.

    A part without ``prompt_messages`` (its prompts were all text) gets it, None on every row,
    where another part has it: rows of a text prompt set and of a chat one concatenate."""
    if not batches:
        raise ValueError("concat needs at least one batch")
    # per-row fields a part may lack, filled where another part has them (torch.cat needs the same
    # fields in every part): rows sampled without top-k/top-p are not logprobs_filtered, and a batch
    # without a recorded temperature (make_batch) is at 1.0, as update reads it
    fills = {k: v for k, v in {FILTERED: (torch.bool, False), TEMPERATURE: (torch.float32, 1.0)}.items()
             if any(k in b.keys() for b in batches)}
    chat = any(PROMPT_MESSAGES in b.keys() for b in batches)
    widths_p = max(b["prompt_ids"].shape[1] for b in batches)
    widths_t = max(b["response_ids"].shape[1] for b in batches)
    parts, offset = [], 0
    for b in batches:
        b = shallow_copy(b)
        for key, (dtype, value) in fills.items():
            if key not in b.keys():
                b.set(key, torch.full((b.batch_size[0],), value, dtype=dtype, device=b["response_ids"].device))
        if chat and PROMPT_MESSAGES not in b.keys():
            set_column(b, PROMPT_MESSAGES, [None] * b.batch_size[0])  # text prompts
        for k in list(b.keys()):
            v = b.get(k)
            if isinstance(v, torch.Tensor) and v.dim() == 2:
                prompt = k.startswith("prompt")  # prompts are left-padded, responses right-padded
                b.set(k, _pad_width(v, widths_p if prompt else widths_t, left=prompt))
        if "rollout_metrics" in b.keys():
            del b["rollout_metrics"]
        parts.append(b)
    if any(ROLLOUT_ROW in b.keys() for b in parts):
        groups = _rejoined_groups(parts)
        if groups is not None:  # not rows of one rollout: a batch of its own
            ids = new_rollout_rows(sum(b.batch_size[0] for b in parts))
            for b, group, part_ids in zip(parts, groups, ids.split([b.batch_size[0] for b in parts])):
                b.set("group", group.to(b["group"].device))
                b.set(ROLLOUT_ROW, part_ids.to(b["group"].device))
    else:  # no rollout identity: each part's groups apart, as concat always numbered them
        for b in parts:
            _, inverse = torch.unique(b["group"], return_inverse=True)
            b.set("group", inverse + offset)
            offset += int(inverse.max()) + 1 if len(inverse) else 0
    check_same_fields(parts, "concat")
    return torch.cat(parts)
