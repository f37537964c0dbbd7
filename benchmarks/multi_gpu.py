"""Issue 8: rlkit on N GPUs — colocated GRPO, split placement, tensor-parallel generation.

    torchrun --nproc-per-node 1 benchmarks/multi_gpu.py --preset qwen2.5-0.5b --scenario colocated --json one.json
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py --preset qwen2.5-0.5b --scenario all --json two.json
    python benchmarks/multi_gpu.py --compare one.json two.json
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py --preset cpu --scenario all --steps 2   # CPU / gloo smoke run

Everything goes through rlkit's public API: ``Pipeline(step, reward).lower(placement, tp=k)``,
``Plan.shard`` / ``Plan.step``, the transforms (``rollout``, ``score``, ``advantage``,
``compute_old_logprobs``, ``compute_ref_logprobs``, ``update``) and the torch engine, on the
standard workload of ``_workload.py`` (``qwen2.5-0.5b``: Qwen2.5-0.5B shape, random init, bf16,
32 prompts x 8 samples, prompt 64, response 256 with EOS ignored, GRPO with old-policy and
reference log-probs, beta 0.04, one update epoch; ``cpu``: the small float32 CPU preset).

Scenarios (each catches its own exceptions and records ``{"error": ...}``):

- ``colocated``: actor FSDP(N) + rollout DP(N) on the same ranks; the global batch is fixed
  (strong scaling: each rank generates 1/N of the prompts and trains on 1/N of the rows), or
  with ``--weak`` N times the workload's (weak scaling: the prompts repeated N times, each rank
  does one GPU's standard work; compare throughput, not step time). One
  GRPO step, median of ``--steps`` after ``--warmup``; phase times; responses/s and generated
  tokens/s of the whole step. Under ``--nproc-per-node 1`` lowering is the identity: that run is
  the 1-GPU baseline for ``--compare``.
- ``split``: actor FSDP on the first half of the ranks, rollout engine on the other half,
  weights sent by collectives after each update (the ``sync/*`` metrics). rlkit lowers split
  placement only for critic-free recipes without a KL reference (``Plan._shard_split`` raises
  NotImplementedError otherwise; the script records that message), so this scenario runs GRPO
  with beta 0 and no reference model. Rollout ranks skip the old-log-prob pass (their copy of the
  actor is never trained; the actor ranks compute it on the FSDP model).
- ``tp``: generation with TP(k) x DP(N/k) after resharding from FSDP(N) (``lower(tp=k)``).
  Correctness: greedy tokens (temperature 0, one sample per prompt) vs a single-device engine on
  rank 0 built from the same full weights (cloned before sharding; eager, as the TP engine runs);
  token agreement fraction and first divergence. Throughput: generated tokens/s of a
  ``rollout`` (temperature 1, n samples) with the TP engine vs the plain replicated engine at the
  same N (``lower(tp=1)``, rlkit's defaults: CUDA graphs, fused weights, compiled pieces on GPU),
  and both with the eager engine (no graphs/fusion/compile) side by side; ``tp_engine`` records
  which fast paths the TP engine kept (a failed graph capture or compile falls back quietly).

Training-side ``torch.compile`` (``rk.init(compile=...)``, rlkit's default "auto" compiles on
CUDA) is off unless ``--compile auto``: its warm-up would dominate a short run. The engine keeps
its own defaults (CUDA graphs and compiled pieces on GPU for the replicated engine).

Rank 0 prints a table and one ``RESULT_JSON {...}`` line, and with ``--json`` writes the same
object (rewritten after every scenario, so a later crash keeps the earlier figures).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _workload import PRESETS, Clock, GcPauses, build, grpo_phases, param_count, reward, sync  # noqa: E402

SCENARIOS = ("colocated", "split", "tp")


# --------------------------------------------------------------------------- process helpers


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _barrier(device: torch.device) -> None:
    sync(device)
    if _distributed():
        from rlkit.parallel import barrier

        barrier()


def _gather(obj) -> list:
    """Every rank's ``obj`` (a small picklable value), in rank order, on every rank."""
    if not _distributed() or _world_size() == 1:
        return [obj]
    out: list = [None] * _world_size()
    dist.all_gather_object(out, obj)
    return out


def _median_dict(dicts: list[dict]) -> dict:
    keys = list(dict.fromkeys(k for d in dicts for k in d))  # phase order, not alphabetical
    return {k: statistics.median(d[k] for d in dicts if k in d) for k in keys}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the GRPO step


def grpo_step_fn(wl, device, *, beta: float, old_logprobs_here: bool, train_ranks: int, rows: int | None = None):
    """A Pipeline step ``f(state, prompts, reward) -> (state, metrics)``: rollout -> score ->
    advantage("grpo") -> [old log-probs] -> [ref log-probs] -> update("ppo_clip", kl=beta),
    with this rank's phase times in ``metrics["time/<phase>"]``.

    ``update``'s micro-batch counts this rank's rows (verl's ``*_per_gpu``): the workload's
    micro-batch, capped at the ``rows / train_ranks`` rows each training rank holds (``rows``:
    the global batch, the workload's by default)."""
    from rlkit.transforms.rollout import rollout_metrics

    micro = min(wl.micro_batch, (rows or wl.rows) // train_ranks)

    def step(state, prompts, reward_fn):
        clock = Clock(device)
        state, batch, metrics = grpo_phases(state, prompts, wl, clock, reward_fn, beta=beta, micro_batch=micro,
                                            old_pass=old_logprobs_here)
        metrics = {**rollout_metrics(batch), **metrics, "rows": float(batch.batch_size[0]),
                   "tokens_generated": float(batch["response_mask"].sum()),
                   **{f"time/{k}": v for k, v in clock.times.items()}}
        return state, metrics

    return step


def _run_steps(plan, state, prompts, device, steps: int, warmup: int, profile: str | None = None,
               gc_freeze: bool = False, stacks: bool = False):
    """``warmup + steps`` calls of ``plan.step``, each between barriers; returns
    ``(state, wall seconds of the timed steps, metrics of the timed steps, this rank's garbage
    collections during the timed steps)``. With ``profile`` (a path ending in .json.gz), one more
    untimed step runs under ``torch.profiler`` on every rank; rank 0 writes its Chrome trace there
    and prints ``_trace.py``'s phase summary (``stacks``: with Python stacks, which name the host
    waits' call sites but slow the host). ``gc_freeze``: ``gc.freeze()`` after the warm-up."""
    times, metrics = [], []
    if profile:
        state = _profiled_step(plan, state, prompts, device, profile, stacks)

    def one_step(i: int, state):
        _barrier(device)
        t0 = time.perf_counter()
        state, m = plan.step(state, prompts)
        _barrier(device)
        seconds = time.perf_counter() - t0
        if _rank() == 0:
            phases = ", ".join(f"{k[5:]} {v:.3f}s" for k, v in m.items() if k.startswith("time/"))
            print(f"  step {i}{' (warm-up)' if i < warmup else ''}: {seconds:.3f}s ({phases})", flush=True)
        return state, seconds, m

    for i in range(warmup):
        state, _, _ = one_step(i, state)
    if gc_freeze:
        gc.freeze()  # everything alive after the warm-up (model, compiled graphs) leaves the GC's view
    with GcPauses() as gc_pauses:
        for i in range(warmup, warmup + steps):
            state, seconds, m = one_step(i, state)
            times.append(seconds)
            metrics.append(m)
    return state, times, metrics, gc_pauses.summary()


def _profiled_step(plan, state, prompts, device, path: str, stacks: bool = False):
    from _trace import export, print_summary, profiler, summarise

    for _ in range(2):  # warm-up before tracing (compile, CUDA graphs, caches)
        _barrier(device)
        state, _ = plan.step(state, prompts)
    _barrier(device)
    with profiler(device, stacks) as prof:
        state, _ = plan.step(state, prompts)
        _barrier(device)
    if _rank() == 0:
        events = export(prof, path)
        print(f"-- profiled step (rank 0 of {_world_size()}), trace {os.path.basename(path)}")
        print_summary(summarise(events, per_phase=6))
    return state


def _throughput(wl, times: list[float], metrics: list[dict], gc_summary: dict, gc_freeze: bool) -> dict:
    step_s = statistics.median(times)
    rows = int(statistics.median(m.get("rows", wl.rows) for m in metrics))
    tokens = statistics.median(m["tokens_generated"] for m in metrics)
    phases = _median_dict([{k[5:]: v for k, v in m.items() if k.startswith("time/")} for m in metrics])
    out = {
        "step_seconds_median": step_s,
        "step_seconds_all": times,
        "phase_seconds_median": phases,
        "rows": rows,
        "tokens_generated": tokens,
        "responses_per_s": rows / step_s,
        "generated_tokens_per_s": tokens / step_s,
        "gc_during_timed_steps": gc_summary,  # this rank's Python garbage collections
        "gc_freeze": gc_freeze,
    }
    if "rollout" in phases:
        out["rollout_tokens_per_s"] = tokens / phases["rollout"]
    engine_s = [m["rollout/seconds"] for m in metrics if "rollout/seconds" in m]
    if engine_s:
        out["engine_generate_seconds_median"] = statistics.median(engine_s)
    for key in ("sync/bytes", "sync/seconds"):
        values = [m[key] for m in metrics if key in m]
        if values:
            out[key.replace("/", "_") + "_median"] = statistics.median(values)
    gap = [m["actor/logprob_gap"] for m in metrics if "actor/logprob_gap" in m]
    if gap:
        out["logprob_gap_mean_abs"] = statistics.median(gap)
    return out


def _setup(args, device, *, ref: bool, repeat: int = 1):
    """``(workload, model, state, prompts)``: a fresh random model (same seed on every rank) and its
    state; the workload's prompts ``repeat`` times over."""
    from rlkit.data import as_prompts

    wl, model, tok, texts = build(args.preset, device)
    return wl, model, _init(args, model, tok, ref=ref), as_prompts(list(texts) * repeat, tok)


def _init(args, model, tok, *, ref: bool = False):
    from rlkit.optim import adamw
    from rlkit.state import init

    wl = PRESETS[args.preset]
    return init(model, adamw(lr=wl.lr), tokenizer=tok, ref="copy" if ref else None, compile=_compile_mode(args))


def _compile_mode(args) -> bool | str:
    """``rk.init(compile=...)``: the training-side decoder blocks (rlkit's default "auto" compiles on CUDA)."""
    return {"auto": "auto", "on": True, "off": False}[args.compile]


# --------------------------------------------------------------------------- scenarios


def scenario_colocated(args, device) -> dict:
    from rlkit.pipeline import Pipeline

    scale = _world_size() if args.weak else 1
    wl, model, state, prompts = _setup(args, device, ref=bool(PRESETS[args.preset].beta), repeat=scale)
    n_params = param_count(model)
    step = grpo_step_fn(wl, device, beta=wl.beta, old_logprobs_here=True, train_ranks=_world_size(), rows=wl.rows * scale)
    plan = Pipeline(step, reward).lower()  # all ranks: FSDP(N) actor/ref + DP(N) rollout; N=1: identity
    state = plan.shard(state)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    state, times, metrics, gcs = _run_steps(plan, state, prompts, device, args.steps, args.warmup, args.profile,
                                             args.gc_freeze, args.profile_stacks)
    out = {"layout": f"actor FSDP({_world_size()}) + rollout DP({_world_size()}), same ranks"
           if _world_size() > 1 else "one process (lowering is the identity)",
           "scaling": "weak" if args.weak else "strong",
           "params": n_params, "beta": wl.beta, "old_logprobs": wl.old_logprobs,
           **_throughput(wl, times, metrics, gcs, args.gc_freeze)}
    if device.type == "cuda":
        out["peak_memory_gb_by_rank"] = _gather(torch.cuda.max_memory_allocated(device) / 1e9)
    del state, plan, model
    return out


def scenario_split(args, device) -> dict:
    from rlkit.parallel import split_placement
    from rlkit.pipeline import Pipeline

    n = _world_size()
    if n < 2:
        return {"skipped": f"split placement needs at least 2 processes, got {n}"}
    actor_n = n // 2
    placement = split_placement({"actor": actor_n, "rollout": n - actor_n})  # collective
    wl, model, state, prompts = _setup(args, device, ref=True)
    # what rlkit says about a KL reference under split placement (raised before anything is sharded)
    step = grpo_step_fn(wl, device, beta=0.0, old_logprobs_here=placement.here("actor"), train_ranks=actor_n)
    plan = Pipeline(step, reward).lower(placement)
    try:
        plan.shard(state)
        ref_note = "a KL reference lowered without error"
    except NotImplementedError as exc:
        ref_note = f"NotImplementedError: {exc}"
    state = _init(args, model, state.tokenizer)  # the same weights, no reference
    state = plan.shard(state)
    state, times, metrics, gcs = _run_steps(plan, state, prompts, device, args.steps, args.warmup,
                                             gc_freeze=args.gc_freeze)
    mine = {
        "role": "actor" if placement.here("actor") else "rollout",
        "sync_bytes_received": [m.get("sync/bytes", 0.0) for m in metrics],
        "sync_seconds": [m.get("sync/seconds", 0.0) for m in metrics],
        "bytes_sent_last": float(plan.reports[-1].bytes_sent) if plan.reports else 0.0,
        "phases": _median_dict([{k[5:]: v for k, v in m.items() if k.startswith("time/")} for m in metrics]),
    }
    ranks = _gather(mine)
    rollout_ranks = [r for r in ranks if r["role"] == "rollout"]
    per_step_bytes = [sum(r["sync_bytes_received"][i] for r in rollout_ranks) for i in range(len(metrics))]
    per_step_seconds = [max(r["sync_seconds"][i] for r in ranks) for i in range(len(metrics))]
    out = {
        "layout": f"actor FSDP({actor_n}) on ranks {list(placement.ranks('actor'))}, "
                  f"rollout DP({n - actor_n}) on ranks {list(placement.ranks('rollout'))}",
        "note": "beta 0, no reference model: rlkit lowers split placement only for critic-free recipes without a "
                "KL reference; old-policy log-probs are computed on the actor ranks only",
        "kl_reference_under_split": ref_note,
        "beta": 0.0,
        "old_logprobs": wl.old_logprobs,
        **_throughput(wl, times, metrics, gcs, args.gc_freeze),
        "sync_bytes_per_step_median": statistics.median(per_step_bytes),
        "sync_seconds_per_step_median": statistics.median(per_step_seconds),
        "sync_bytes_sent_last_step": sum(r["bytes_sent_last"] for r in ranks),
        "sync_gbps": statistics.median(per_step_bytes) / max(statistics.median(per_step_seconds), 1e-9) / 1e9,
        "phase_seconds_by_rank": {str(i): r["phases"] for i, r in enumerate(ranks)},
    }
    # rank 0 (an actor rank) receives no weights: its own sync/* would read 0
    out.pop("sync_bytes_median", None)
    out.pop("sync_seconds_median", None)
    del state, plan, model
    return out


def _compare_tokens(ref_ids, ref_mask, ids, mask) -> dict:
    """Token agreement of two (b t) greedy generations; a position counts when either side has a token."""
    width = max(ref_ids.shape[1], ids.shape[1])

    def pad(x, fill):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill)

    ref_ids, ids = pad(ref_ids.cpu(), -1), pad(ids.cpu(), -1)
    ref_mask, mask = pad(ref_mask.cpu().bool(), False), pad(mask.cpu().bool(), False)
    counted = ref_mask | mask
    same = (ref_ids == ids) & (ref_mask == mask)
    mismatch = counted & ~same
    first = torch.where(mismatch.any(-1), mismatch.float().argmax(-1), counted.sum(-1))
    diverged = mismatch.any(-1)
    return {
        "token_agreement": float(same[counted].float().mean()) if counted.any() else 1.0,
        "rows_identical_frac": float((~diverged).float().mean()),
        "first_divergence_min": int(first[diverged].min()) if diverged.any() else None,
        "first_divergence_mean_diverged_rows": float(first[diverged].float().mean()) if diverged.any() else None,
        "tokens_compared": int(counted.sum()),
    }


def _timed_rollouts(state, prompts, wl, device, steps: int, warmup: int, **kw) -> dict:
    from rlkit.transforms.rollout import rollout

    times, tokens = [], []
    for i in range(warmup + steps):
        _barrier(device)
        t0 = time.perf_counter()
        batch = rollout(state, prompts, n=wl.n, max_new_tokens=wl.max_new_tokens, ignore_stop=wl.ignore_eos,
                        temperature=1.0, **kw)
        _barrier(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            tokens.append(float(batch["response_mask"].sum()))
    s = statistics.median(times)
    from rlkit import rollout_metrics

    graphs = rollout_metrics(batch).get("rollout/graphs")
    return {"seconds_median": s, "tokens": statistics.median(tokens), "tokens_per_s": statistics.median(tokens) / s,
            "steps": steps, "cuda_graphs_captured": graphs}


def _engine_flags(engine) -> dict:
    """Which of the engine's fast paths are on (a capture or compile failure turns them off quietly)."""
    plan = getattr(engine, "_plan", None)
    return {"cuda_graphs": engine.cuda_graphs, "graph_capture_failed": bool(plan is not None and plan.graph_failed),
            "fused": engine.fused, "compiled": engine._compiled is not None, "compile_error": engine.compile_error}


def scenario_tp(args, device) -> dict:
    from rlkit.engines import TorchEngine
    from rlkit.parallel import gather_weights, tensor_parallel
    from rlkit.pipeline import Pipeline
    from rlkit.transforms.rollout import rollout

    n, k = _world_size(), args.tp
    if k < 2 or n < k or n % k:
        return {"skipped": f"tp={k} needs a world size that is a multiple of it (>= {k}), got {n}"}
    from rlkit.data import as_prompts

    wl, model, tok, texts = build(args.preset, device)
    prompts, config = as_prompts(texts, tok), model.config
    # the same seed builds the same weights on every rank: keep a full copy for the references,
    # and a twin model for the replicated plan (cheaper than building the random model again);
    # both before init, which may compile the blocks in place
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    twin = copy.deepcopy(model)
    state = _init(args, model, tok)
    greedy = dict(n=1, max_new_tokens=wl.max_new_tokens, temperature=0.0, ignore_stop=wl.ignore_eos)
    step = grpo_step_fn(wl, device, beta=0.0, old_logprobs_here=True, train_ranks=n)  # never stepped here
    out: dict = {"layout": f"FSDP({n}) -> TP({k}) x DP({n // k}) generation", "tp": k}

    plan = Pipeline(step, reward).lower(tp=k)
    state = plan.shard(state)
    # the FSDP(N) -> TP(k) x DP(N/k) resharding that every update is followed by, timed on its own
    _barrier(device)
    weights, report = gather_weights(state.actor, tensor_parallel(k))
    _barrier(device)
    reports = _gather({"bytes": float(report.bytes), "seconds": report.seconds})
    out["reshard_bytes_total"] = sum(r["bytes"] for r in reports)
    out["reshard_seconds_max"] = max(r["seconds"] for r in reports)
    del weights
    _barrier(device)
    t0 = time.perf_counter()
    tp_greedy = rollout(state, prompts, **greedy)
    _barrier(device)
    out["greedy_tp_seconds"] = time.perf_counter() - t0
    out["tp_sampling"] = _timed_rollouts(state, prompts, wl, device, args.steps, args.warmup)
    tp_engine = state._cache["engine"]
    out["tp_engine"] = _engine_flags(tp_engine)
    # the same shards through the plain eager step (what TP generation ran before it took graphs,
    # fusion and compiled pieces): the side-by-side baseline of those
    eager_tp = TorchEngine(config, dict(tp_engine.weights), pad_token_id=tok.pad_token_id, tp_group=tp_engine.tp_group,
                           cuda_graphs=False, fuse=False, compile_decode=False)
    eager_tp.policy_version = state.policy_version
    out["tp_eager_sampling"] = _timed_rollouts(state, prompts, wl, device, min(args.steps, 2), 0, engine=eager_tp)
    del state, plan, model, tp_engine, eager_tp
    _free(device)

    # the plain replicated engine at the same N (rlkit's defaults), on a fresh copy of the model
    state = _init(args, twin, tok)
    del twin
    plan = Pipeline(step, reward).lower()
    state = plan.shard(state)
    rep_greedy = rollout(state, prompts, **greedy)
    out["replicated_sampling"] = _timed_rollouts(state, prompts, wl, device, args.steps, args.warmup)
    # ... and a replicated eager engine (what the TP engine runs: no CUDA graphs, fusion or compile)
    eager = TorchEngine(config, full, pad_token_id=tok.pad_token_id, cuda_graphs=False, fuse=False, compile_decode=False)
    eager.policy_version = state.policy_version
    out["replicated_eager_sampling"] = _timed_rollouts(state, prompts, wl, device, min(args.steps, 2), 0, engine=eager)
    del state, plan, eager
    _free(device)

    try:
        if _rank() == 0:
            _tp_reference(out, config, full, tok, prompts, greedy, tp_greedy, rep_greedy)
    except Exception as exc:  # noqa: BLE001 - rank 0 alone: record it and still meet the other ranks below
        out["error"] = f"rank 0 reference: {type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    _barrier(device)
    del full
    _free(device)
    out["float32_check"] = _tp_float32_check(args, device, step, greedy, k)
    return out


def _tp_float32_check(args, device, step, greedy, k) -> dict:
    """Greedy tokens of TP(k) vs one device, both in float32 (no mixed precision).

    A random model's next-token distributions are nearly flat, so in bf16 any change in the order
    of additions (the TP all-reduce of row-parallel partial sums, or fused kernels) flips near-ties
    within a few tokens; even rlkit's default replicated engine vs the eager one disagrees there.
    In float32 those rounding differences are ~1e-7 and the comparison tests the layout itself."""
    from rlkit.data import as_prompts
    from rlkit.optim import adamw
    from rlkit.pipeline import Pipeline
    from rlkit.state import init
    from rlkit.transforms.rollout import rollout

    try:
        wl, model, tok, texts = build(args.preset, device)
        model = model.float()
        prompts, config = as_prompts(texts, tok), model.config
        full = {name: p.detach().clone() for name, p in model.named_parameters()}
        state = init(model, adamw(lr=wl.lr), tokenizer=tok, compile=False)
        plan = Pipeline(step, reward).lower(tp=k, mixed_precision=False)
        state = plan.shard(state)
        tp_greedy = rollout(state, prompts, **greedy)
        res: dict = {"tp_engine": _engine_flags(state._cache["engine"])}
        if _rank() == 0:
            gen = _single_device_greedy(config, full, tok, prompts, greedy)
            res.update(_compare_tokens(gen.response_ids, gen.response_mask, tp_greedy["response_ids"], tp_greedy["response_mask"]))
            # one device with the fast paths too (graphs, fusion, compiled pieces): how far those
            # alone move float32 greedy tokens, apart from the layout
            fast = _single_device_greedy(config, full, tok, prompts, greedy, fast=True)
            res["single_device_fast_vs_eager"] = _compare_tokens(gen.response_ids, gen.response_mask, fast.response_ids, fast.response_mask)
        _barrier(device)
        del state, plan, model, full
        _free(device)
        return res
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def _single_device_greedy(config, full, tok, prompts, greedy, fast: bool = False):
    """Greedy generation of one eager engine on the full weights: the reference of the tp scenario
    (``fast``: the engine's defaults instead, CUDA graphs, fusion and compiled pieces on GPU)."""
    from rlkit.engines import SamplingParams, TorchEngine

    eos = tok.eos_token_id
    plain = {} if fast else dict(cuda_graphs=False, fuse=False, compile_decode=False)
    ref = TorchEngine(config, full, pad_token_id=tok.pad_token_id, **plain)
    return ref.generate(prompts.ids, SamplingParams(stop_token_ids=(eos,) if eos is not None else (), **greedy))


def _tp_reference(out, config, full, tok, prompts, greedy, tp_greedy, rep_greedy) -> None:
    """Rank 0: greedy tokens of one engine on the full weights vs the TP and replicated rollouts."""
    gen = _single_device_greedy(config, full, tok, prompts, greedy)
    out["greedy_vs_single_device"] = _compare_tokens(gen.response_ids, gen.response_mask,
                                                     tp_greedy["response_ids"], tp_greedy["response_mask"])
    out["replicated_greedy_vs_single_device"] = _compare_tokens(gen.response_ids, gen.response_mask,
                                                                rep_greedy["response_ids"], rep_greedy["response_mask"])
    out["token_agreement"] = out["greedy_vs_single_device"]["token_agreement"]
    out["tp_vs_replicated_speedup"] = out["tp_sampling"]["tokens_per_s"] / out["replicated_sampling"]["tokens_per_s"]
    out["tp_vs_replicated_eager_speedup"] = (out["tp_sampling"]["tokens_per_s"]
                                             / out["replicated_eager_sampling"]["tokens_per_s"])
    out["tp_vs_tp_eager_speedup"] = out["tp_sampling"]["tokens_per_s"] / out["tp_eager_sampling"]["tokens_per_s"]


RUNNERS = {"colocated": scenario_colocated, "split": scenario_split, "tp": scenario_tp}


# --------------------------------------------------------------------------- output


def _fmt_s(x) -> str:
    return f"{x:.3f} s" if isinstance(x, (int, float)) else str(x)


def print_table(result: dict) -> None:
    rows: list[tuple[str, str]] = [
        ("world size / device", f"{result['world_size']} x {result.get('gpu', 'cpu')} ({result['backend']})"),
        ("preset", f"{result['preset']} ({result['rows']} responses/step, training compile {result['train_compile']})"),
    ]
    for name in SCENARIOS:
        r = result.get(name)
        if r is None:
            continue
        if "error" in r or "skipped" in r:
            rows.append((name, ("ERROR " + r["error"].splitlines()[0][:150]) if "error" in r else "skipped: " + r["skipped"]))
            continue
        if name in ("colocated", "split"):
            rows.append((f"{name}: layout", r["layout"]))
            rows.append((f"{name}: step (median)", f"{_fmt_s(r['step_seconds_median'])}  "
                         f"({r['responses_per_s']:,.1f} responses/s, {r['generated_tokens_per_s']:,.0f} gen tokens/s)"))
            ph = r["phase_seconds_median"]
            rows.append((f"{name}: phases (rank 0)", ", ".join(f"{k} {v:.3f}" for k, v in ph.items())))
            if "rollout_tokens_per_s" in r:
                rows.append((f"{name}: rollout tokens/s", f"{r['rollout_tokens_per_s']:,.0f}"))
            if "gc_during_timed_steps" in r:
                g = r["gc_during_timed_steps"]
                rows.append((f"{name}: Python GC (rank 0)", ", ".join(f"{k} {v['count']}x {v['ms']:.0f} ms" for k, v in g.items())
                             + (" (gc.freeze after warm-up)" if r.get("gc_freeze") else "")))
        if name == "colocated" and "sync_bytes_median" in r:
            rows.append(("colocated: weight sync", f"{r['sync_bytes_median'] / 1e9:.3f} GB/rank in "
                         f"{r['sync_seconds_median'] * 1e3:.1f} ms" if r["sync_bytes_median"] else
                         "none (one process: the engine reads the training storage)"))
        if name == "split":
            rows.append(("split: weight sync", f"{r['sync_bytes_per_step_median'] / 1e9:.3f} GB received in "
                         f"{r['sync_seconds_per_step_median'] * 1e3:.1f} ms ({r['sync_gbps']:.2f} GB/s)"))
            rows.append(("split: note", r["note"]))
        if name == "tp":
            g = r.get("greedy_vs_single_device", {})
            rows.append(("tp: layout", r["layout"]))
            rows.append(("tp: reshard FSDP -> TP", f"{r['reshard_bytes_total'] / 1e9:.3f} GB received (all ranks) in "
                         f"{r['reshard_seconds_max'] * 1e3:.1f} ms"))
            rows.append(("tp: greedy tokens vs 1 device", f"agreement {g.get('token_agreement')}, rows identical "
                         f"{g.get('rows_identical_frac')}, first divergence {g.get('first_divergence_min')}"))
            rg = r.get("replicated_greedy_vs_single_device", {})
            rows.append(("tp: (replicated engine, greedy)", f"agreement {rg.get('token_agreement')}, first divergence "
                         f"{rg.get('first_divergence_min')}"))
            f32 = r.get("float32_check", {})
            rows.append(("tp: greedy vs 1 device, float32", f"agreement {f32.get('token_agreement')}, rows identical "
                         f"{f32.get('rows_identical_frac')}" if "error" not in f32 else f"error {f32['error'][:80]}"))
            fe = f32.get("single_device_fast_vs_eager", {})
            if fe:
                rows.append(("tp: (1 device fast vs eager, f32)", f"agreement {fe.get('token_agreement')}, rows identical "
                             f"{fe.get('rows_identical_frac')}"))
            flags = r.get("tp_engine", {})
            rows.append(("tp: TP engine paths", ", ".join(f"{k} {v}" for k, v in flags.items())))
            for key, label in (("tp_sampling", f"TP({r['tp']}) (default engine)"), ("tp_eager_sampling", f"TP({r['tp']}) (eager engine)"),
                               ("replicated_sampling", "replicated (default engine)"),
                               ("replicated_eager_sampling", "replicated (eager engine)")):
                s = r.get(key)
                if s:
                    rows.append((f"tp: {label}", f"{s['tokens_per_s']:,.0f} tokens/s ({_fmt_s(s['seconds_median'])}, "
                                 f"graphs {s.get('cuda_graphs_captured')})"))
    width = max(len(k) for k, _ in rows)
    print("\n" + "-" * (width + 60))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 60), flush=True)


def compare(one_path: str, many_path: str) -> dict:
    """The colocated speed-up of ``many`` (N GPUs) over ``one`` (1 GPU), phase by phase."""
    one, many = (json.load(open(p)) for p in (one_path, many_path))
    a, b = one.get("colocated", {}), many.get("colocated", {})
    if "step_seconds_median" not in a or "step_seconds_median" not in b:
        raise SystemExit(f"--compare needs the colocated figures in both files; got {sorted(a)} and {sorted(b)}")
    n1, n2 = one["world_size"], many["world_size"]
    # throughput (rows per second) is the speed-up under both strong scaling (equal rows: the
    # step-time ratio) and weak scaling (N times the rows in each step)
    ra, rb = a["rows"], b["rows"]
    speedup = (rb / b["step_seconds_median"]) / (ra / a["step_seconds_median"])
    rows = [("", f"N={n1}", f"N={n2}", "speed-up"),
            ("responses per step", f"{ra}", f"{rb}", ""),
            ("step time (s)", f"{a['step_seconds_median']:.3f}", f"{b['step_seconds_median']:.3f}",
             f"{a['step_seconds_median'] / b['step_seconds_median']:.2f}x"),
            ("responses/s", f"{a['responses_per_s']:,.1f}", f"{b['responses_per_s']:,.1f}",
             f"{b['responses_per_s'] / a['responses_per_s']:.2f}x"),
            ("generated tokens/s", f"{a['generated_tokens_per_s']:,.0f}", f"{b['generated_tokens_per_s']:,.0f}",
             f"{b['generated_tokens_per_s'] / a['generated_tokens_per_s']:.2f}x")]
    for phase in a["phase_seconds_median"]:
        x, y = a["phase_seconds_median"][phase], b["phase_seconds_median"].get(phase)
        if y:  # the phase's rows per second
            rows.append((f"  {phase} (s)", f"{x:.3f}", f"{y:.3f}", f"{(rb / y) / (ra / x):.2f}x"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    batch = f"fixed global batch of {ra} responses" if ra == rb else f"global batch {ra} -> {rb} responses (weak scaling)"
    print(f"colocated GRPO step, {one['preset']} preset, {batch}, N processes x {one.get('gpu', 'cpu')}")
    for r in rows:
        print("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    print(f"throughput speed-up {speedup:.2f}x, scaling efficiency {speedup / (n2 / n1):.0%} of linear ({n2 / n1:.0f}x the devices)")
    if a["tokens_generated"] / ra != b["tokens_generated"] / rb:
        print(f"(responses stop at EOS: {a['tokens_generated'] / ra:.1f} vs {b['tokens_generated'] / rb:.1f} generated tokens "
              "per response, so tokens/s and responses/s scale differently)")
    for name in ("split", "tp"):
        r = many.get(name)
        if r and "error" not in r and "skipped" not in r:
            if name == "split":
                print(f"split ({r['layout']}): step {r['step_seconds_median']:.3f} s "
                      f"(vs colocated {b['step_seconds_median']:.3f} s), weight sync "
                      f"{r['sync_bytes_per_step_median'] / 1e9:.3f} GB in {r['sync_seconds_per_step_median'] * 1e3:.1f} ms; "
                      f"beta 0, no reference")
            else:
                print(f"tp ({r['layout']}): greedy agreement {r.get('token_agreement')}, "
                      f"{r['tp_sampling']['tokens_per_s']:,.0f} vs replicated {r['replicated_sampling']['tokens_per_s']:,.0f} "
                      f"tokens/s ({r.get('tp_vs_replicated_speedup', float('nan')):.2f}x)")
        elif r:
            print(f"{name}: {r.get('error', r.get('skipped'))}")
    out = {"speedup": speedup, "efficiency": speedup / (n2 / n1), "world_sizes": [n1, n2]}
    print("COMPARE_JSON " + json.dumps(out), flush=True)
    return out


# --------------------------------------------------------------------------- main


def run(args) -> dict:
    from rlkit.parallel import init_distributed

    info = init_distributed(timeout=args.timeout)
    threads = args.threads
    if threads is None and info.device.type == "cuda":
        # torchrun sets OMP_NUM_THREADS=1; the random init of the model runs on the CPU
        threads = max(1, (os.cpu_count() or 1) // max(1, info.local_world_size))
    if threads:
        torch.set_num_threads(threads)
    device = info.device
    rank = _rank()
    wl = PRESETS[args.preset]
    if args.steps is None:
        args.steps = 3
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "world_size": _world_size(),
        "backend": str(dist.get_backend()) if _distributed() else "none",
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "preset": args.preset,
        "rows": wl.rows,
        "steps": args.steps,
        "warmup": args.warmup,
        "train_compile": args.compile,
    }
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    names = SCENARIOS if args.scenario == "all" else (args.scenario,)
    for name in names:
        if rank == 0:
            print(f"== {name} ==", flush=True)
        started = time.perf_counter()
        try:
            figures = RUNNERS[name](args, device)
        except Exception as exc:  # noqa: BLE001 - one scenario's failure must not lose the others' figures
            figures = {"error": f"rank {rank}: {type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(figures["traceback"], file=sys.stderr, flush=True)
        _free(device)
        # a failure on any rank marks the scenario (all ranks reach this point unless a collective hung)
        errors = [f.get("error") for f in _gather({"error": figures.get("error")})]
        if any(errors) and "error" not in figures:
            figures = {"error": next(e for e in errors if e), "partial": figures}
        figures["wall_seconds"] = time.perf_counter() - started
        result[name] = figures
        if rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, default=float)
        _barrier(device)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="all", choices=("all",) + SCENARIOS)
    ap.add_argument("--preset", default="qwen2.5-0.5b" if torch.cuda.is_available() else "cpu", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 3), after --warmup")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree of the tp scenario")
    ap.add_argument("--json", default=None, help="rank 0 writes the result object here")
    ap.add_argument("--compile", default="off", choices=("off", "auto", "on"),
                    help="rk.init(compile=...) for the training-side decoder blocks; off by default here to keep the "
                         "run short (rlkit's own default is auto: compiled on CUDA)")
    ap.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    ap.add_argument("--compare", nargs=2, metavar=("ONE", "MANY"), help="print the speed-up of two result files")
    ap.add_argument("--profile", metavar="TRACE.json.gz",
                    help="colocated: before the timed steps, trace one step with torch.profiler (rank 0 writes the "
                         "Chrome trace here and prints where each phase's GPU time goes: benchmarks/_trace.py)")
    ap.add_argument("--profile-stacks", action="store_true",
                    help="with --profile: record Python stacks, so the summary names the rlkit call behind each host "
                         "wait; slows the host several-fold, so host-bound phases look longer than they are")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after the warm-up steps: objects alive then (model, compiled graphs) are never "
                         "walked by Python's full collections again (each scenario reports its collections either way)")
    ap.add_argument("--weak", action="store_true",
                    help="colocated: weak scaling, a global batch of N times the workload's (each rank does one GPU's work)")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    from rlkit.parallel import shutdown

    try:
        result = run(args)
        if _rank() == 0:
            print_table(result)
            print("RESULT_JSON " + json.dumps(result, default=float), flush=True)
    finally:
        shutdown()
    return result


if __name__ == "__main__":
    main()
