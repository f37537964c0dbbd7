"""One GRPO step of rlkit, timed phase by phase: rollout, log-prob passes, update (and TRL's, with --compare trl).

    python benchmarks/grpo_step.py --preset qwen2.5-0.5b --device cuda --check --variants --configs --compare trl
    python benchmarks/grpo_step.py --preset cpu --device cpu --compare trl

A step is ``rollout -> [old log-probs] -> [ref log-probs] -> score -> advantage("grpo") ->
update("ppo_clip", kl=("low_var_kl", beta))`` through rlkit's public transforms: the passes are
queued without waiting for the GPU and the host decodes and scores the responses meanwhile
(``_workload.grpo_phases``; the configuration "phases one at a time" runs score first and times
every phase alone, which is where the pass and update MFU come from; when the main steps overlap
passes and update, a few such steps follow them unless ``--no-serial``). The built-in engine (``rollout`` syncs its weights first: after each update that is the engine's
``load_weights``, timed as ``weight_sync_s``). Prints a table and one line ``RESULT_JSON {...}``.

FLOP convention (issue 5): training = 6 x params x tokens, a forward-only pass = 2 x params x
tokens, tokens = every real prompt+response token; the ceiling is a measured 8192^3 bf16 matmul.
``--variants`` (GPU) also times engine and log-prob variants and profiles the decode kernels;
``--check`` (GPU) compares the fast paths against the plain ones first; ``--configs`` times other
step configurations side by side (phases one at a time, no separate old-policy pass, larger
micro-batches, eager model). ``--profile TRACE.json.gz`` traces one more step and prints each
phase's GPU busy and idle time and its top kernels (``_trace.py``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _workload import PRESETS, Clock, Workload, build, child_json, emit_result, grpo_phases, param_count, reward  # noqa: E402
from _workload import sync as _sync  # noqa: E402


def measure_ceilings(device) -> dict:
    """bf16 matmul TFLOP/s (8192^3, random data) and device copy GB/s (read + write)."""
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    _sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    _sync(device)
    tflops = 2 * n**3 * 10 / (start.elapsed_time(end) / 1e3) / 1e12
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    y.copy_(x)
    start.record()
    for _ in range(5):
        y.copy_(x)
    end.record()
    _sync(device)
    gbps = 2 * x.numel() * 2 * 5 / (start.elapsed_time(end) / 1e3) / 1e9
    del a, b, x, y
    torch.cuda.empty_cache()
    return {"bf16_matmul_tflops": tflops, "copy_gbps": gbps}


def _masked_mean(x, mask):
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def grpo_step(state, prompts, wl, device):
    """One step through rlkit's transforms; returns ``(state, phase times, metrics)``."""
    from rlkit.transforms.rollout import rollout_metrics

    clock = Clock(device)
    extra = {}
    with clock("step"):
        state, batch, metrics = grpo_phases(state, prompts, wl, clock, reward, beta=wl.beta, micro_batch=wl.micro_batch)
        if "old_logprobs" in batch.keys():
            mask = batch["response_mask"].float()
            diff = batch["old_logprobs"].cpu() - batch["logprobs"]
            extra["behaviour_gap_mean_abs"] = _masked_mean(diff.abs(), mask)
            extra["behaviour_clipfrac"] = _masked_mean(((diff.exp() - 1).abs() > 0.2).float(), mask)
    tokens = batch["prompt_mask"].sum() + batch["response_mask"].sum()
    metrics = {**rollout_metrics(batch), **metrics, **extra, "tokens_total": float(tokens),
               "tokens_generated": float(batch["response_mask"].sum())}
    return state, clock.times, metrics


def profile_step(state, prompts, wl, device, path: str, stacks: bool = False):
    """One more step under ``torch.profiler``; writes the Chrome trace to ``path`` (gzipped when it
    ends in .gz) and prints ``_trace.py``'s per-phase summary with each phase's top kernels."""
    from _trace import export, print_summary, profiler, summarise

    with profiler(device, stacks) as prof:
        state, _, _ = grpo_step(state, prompts, wl, device)
    events = export(prof, path)
    print(f"-- profiled step, trace {os.path.basename(path)}", flush=True)
    print_summary(summarise(events, per_phase=12))
    return state


# ------------------------------------------------------------------------------------- checks


def run_checks(model, tok, wl, device) -> dict:
    """Fast paths vs plain ones on this device (fresh random inputs each)."""
    from rlkit.engines import SamplingParams, TorchEngine
    from rlkit.engines import torch_engine as te
    from rlkit.batch import make_batch
    from rlkit.models import logprobs as L
    from rlkit.models import response_logprobs, token_logprobs

    out = {}
    # 1. fused sampler: greedy == argmax, log-probs == log_softmax, sample frequencies == softmax
    vocab = model.config.vocab_size
    logits = (torch.randn(256, vocab, device=device) * 3).to(torch.bfloat16)
    sampler = te._make_sampler(256, vocab, device)
    sampler.seed.fill_(1234)
    step = torch.zeros((), dtype=torch.long, device=device)
    tokens, lp = te.fused_sample(logits, sampler, step, 0.0)
    ref = logits.float().log_softmax(-1)
    out["sampler_greedy_equal"] = bool(torch.equal(tokens, logits.float().argmax(-1)))
    out["sampler_greedy_lp_err"] = float((lp - ref.gather(-1, tokens[:, None]).squeeze(-1)).abs().max())
    tokens, lp = te.fused_sample(logits, sampler, step, 0.7)
    ref = (logits.float() / 0.7).log_softmax(-1)
    out["sampler_t07_lp_err"] = float((lp - ref.gather(-1, tokens[:, None]).squeeze(-1)).abs().max())
    rows, small = 200_000, 64
    row = torch.randn(small, device=device) * 1.5
    sampler = te._make_sampler(rows, small, device)
    sampler.seed.fill_(99)
    tokens, _ = te.fused_sample(row.expand(rows, small).contiguous(), sampler, step, 1.3)
    probs = torch.softmax(row.double() / 1.3, -1)
    freq = torch.bincount(tokens, minlength=small).double() / rows
    z = (freq - probs).abs() / torch.sqrt(probs * (1 - probs) / rows)
    out["sampler_freq_max_sigma"] = float(z.max())

    # 2. engine: default (graphs + fused weights + Triton sampler) vs plain eager, greedy
    prompts = [[int(t) for t in torch.randint(4, vocab, (wl.prompt_tokens,))] for _ in range(8)]
    params = SamplingParams(n=4, max_new_tokens=48, temperature=0, ignore_stop=True)
    fast = TorchEngine.from_model(model).generate(prompts, params)
    plain = TorchEngine.from_model(model, cuda_graphs=False, fuse=False, fused_sampling=False).generate(prompts, params)
    same = (fast.response_ids == plain.response_ids).float()
    out["engine_greedy_token_agreement"] = float(same.mean())
    first_diff = (same.cumprod(-1).sum(-1)).float()
    out["engine_greedy_first_divergence_mean"] = float(first_diff.mean())
    # behaviour log-probs of the fast engine vs the training forward on its own tokens
    batch = make_batch([prompts[i] for i in fast.prompt_index.tolist()], [r.tolist() for r in fast.response_ids.cpu()])
    args = [batch[k].to(device) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    with torch.no_grad():
        train_lp, _ = response_logprobs(model, *args)
    out["engine_vs_training_lp_mean_abs"] = float((train_lp - fast.logprobs).abs().mean())

    # 3. log-probs: varlen + Triton vs padded layout + torch log-softmax, values and gradients
    lens = torch.randint(8, 64, (16,)).tolist()
    responses = [[int(t) for t in torch.randint(4, vocab, (n,))] for n in lens]
    batch = make_batch([prompts[i % 8][: 10 + i] for i in range(16)], responses)
    args = [batch[k].to(device) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    weights = torch.randn(args[3].shape, device=device)
    grads = {}
    for name, (varlen, fused, layout) in {"fast": (True, True, "packed"), "plain": (False, False, "padded")}.items():
        L.USE_VARLEN_ATTENTION, L.USE_FUSED_LOGPROBS = varlen, fused
        model.zero_grad(set_to_none=True)
        lp, ent = response_logprobs(model, *args, with_entropy=True, layout=layout)
        ((lp * weights).sum() + ent.sum() * 0.1).backward()
        grads[name] = (lp.detach(), ent.detach(), torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None]))
    L.USE_VARLEN_ATTENTION = L.USE_FUSED_LOGPROBS = True
    model.zero_grad(set_to_none=True)
    out["logprobs_fast_vs_plain_max_abs"] = float((grads["fast"][0] - grads["plain"][0]).abs().max())
    out["entropy_fast_vs_plain_max_abs"] = float((grads["fast"][1] - grads["plain"][1]).abs().max())
    g1, g2 = grads["fast"][2], grads["plain"][2]
    out["grad_fast_vs_plain_rel"] = float((g1 - g2).norm() / g2.norm())
    # shared prompts (flash, bottom-right causal) vs the unshared packed forward on a GRPO-shaped
    # batch (8 prompts x 4 responses): log-probs and gradients
    batch = make_batch([prompts[i // 4] for i in range(32)], [responses[i % 16] for i in range(32)])
    args = [batch[k].to(device) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    weights = torch.randn(args[3].shape, device=device)
    shared = {}
    for share in (False, True):
        L.SHARE_PROMPTS = share
        model.zero_grad(set_to_none=True)
        lp, ent = response_logprobs(model, *args, with_entropy=True)
        ((lp * weights).sum() + ent.sum() * 0.1).backward()
        shared[share] = (lp.detach(), torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None]))
    L.SHARE_PROMPTS = "auto"
    model.zero_grad(set_to_none=True)
    out["shared_vs_unshared_lp_max_abs"] = float((shared[True][0] - shared[False][0]).abs().max())
    out["shared_vs_unshared_grad_rel"] = float((shared[True][1] - shared[False][1]).norm() / shared[False][1].norm())
    # Triton kernel alone vs float64 reference
    x = (torch.randn(512, vocab, device=device) * 2).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, vocab, (512,), device=device)
    lp, ent = L._FusedTokenLogprobs.apply(x, y, 0.9)
    x64 = x.detach().double().requires_grad_(True)
    rlp, rent = token_logprobs(x64, y, temperature=0.9, with_entropy=True)
    a, b = torch.randn(512, device=device), torch.randn(512, device=device)
    (lp * a + ent * b).sum().backward()
    (rlp * a.double() + rent * b.double()).sum().backward()
    out["kernel_lp_max_abs"] = float((lp.double() - rlp).abs().max())
    out["kernel_ent_max_abs"] = float((ent.double() - rent).abs().max())
    out["kernel_grad_rel"] = float((x.grad.double() - x64.grad).norm() / x64.grad.norm())
    out["kernel_grad_rel_bf16_floor"] = float((x64.grad.to(torch.bfloat16).double() - x64.grad).norm() / x64.grad.norm())
    del x, x64, logits
    torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------- variants


def run_variants(model, state, prompts, wl, device, n_params, engine_only: bool = False) -> dict:
    """Engine configurations, and the log-prob pass with each fast path on/off."""
    from rlkit.engines import SamplingParams, TorchEngine
    from rlkit.engines import torch_engine as te
    from rlkit.models import logprobs as L
    from rlkit.transforms.forward import compute_old_logprobs
    from rlkit.transforms.rollout import rollout

    res = {"engine": {}, "logprobs": {}}
    ids = prompts.ids
    configs = [
        # (name, engine kwargs, samples per prompt, te.FUSE_DECODE_EPILOGUES, te.FUSE_ROTARY_ATTENTION)
        ("graphs + fused weights + Triton sampler, SDPA, not compiled", dict(compile_decode=False, decode_attention="sdpa"), wl.n, True, True),
        ("+ compiled layer halves, separate cache copies", dict(decode_attention="sdpa"), wl.n, False, True),
        ("+ compiled layer entry/exit, in-graph cache writes", dict(decode_attention="sdpa"), wl.n, True, True),
        ("+ Triton decode attention, rotary/cache writes by inductor", {}, wl.n, True, False),
        ("+ rotary and cache writes in the attention kernel (default)", {}, wl.n, True, True),
        ("default, batch 512", {}, 2 * wl.n, True, True),
    ]
    for name, kw, n, fuse_epilogues, fuse_rotary in configs:
        te.FUSE_DECODE_EPILOGUES, te.FUSE_ROTARY_ATTENTION = fuse_epilogues, fuse_rotary
        try:
            eng = TorchEngine.from_model(model, **kw)
            params = SamplingParams(n=n, max_new_tokens=wl.max_new_tokens, temperature=1.0, ignore_stop=True)
            t0 = time.perf_counter()
            eng.generate(ids, params)  # warm-up: kernels, compilation, graph captures
            warm = time.perf_counter() - t0
            _sync(device)
            best = None
            for _ in range(2):
                t0 = time.perf_counter()
                out = eng.generate(ids, params)
                _sync(device)
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            tokens = float(out.response_mask.sum())
            res["engine"][name] = {"seconds": best, "tokens_per_s": tokens / best, "rows": out.response_ids.shape[0],
                                   "ms_per_decode_step": 1e3 * (best - out.metrics["prefill_seconds"]) / max(1, wl.max_new_tokens - 1),
                                   "prefill_s": out.metrics["prefill_seconds"], "first_call_s": warm,
                                   "graphs": out.metrics.get("graphs"), "compile_error": eng.compile_error}
            print(f"  engine {name:60s} {tokens / best:10.0f} tok/s  {best:.3f}s (first call {warm:.1f}s)", flush=True)
            eng.release()
            del eng, out
        except Exception as exc:  # noqa: BLE001 - a failing variant is reported, the rest still run
            res["engine"][name] = {"error": repr(exc)}
            traceback.print_exc()
        torch.cuda.empty_cache()
    te.FUSE_DECODE_EPILOGUES = te.FUSE_ROTARY_ATTENTION = True
    try:
        res["decode_kernels"] = profile_decode(model, ids, wl)
    except Exception as exc:  # noqa: BLE001
        res["decode_kernels"] = {"error": repr(exc)}
        traceback.print_exc()
    if engine_only:
        return res

    batch = rollout(state, prompts, n=wl.n, max_new_tokens=wl.max_new_tokens, ignore_stop=wl.ignore_eos)
    tokens = float(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    reference = None
    share_default = L.SHARE_PROMPTS
    for name, varlen, fused, micro, share in [
        ("varlen + Triton log-softmax, 256 rows/pass", True, True, None, False),
        ("prompts shared (flash, bottom-right causal), 256 rows/pass", True, True, None, True),
        ("varlen + Triton log-softmax, 128 rows/pass", True, True, 128, False),
        ("varlen, torch log-softmax, 128 rows/pass", True, False, 128, False),
        ("dense packed mask + torch log-softmax, 32 rows/pass", False, False, 32, False),
    ]:
        L.USE_VARLEN_ATTENTION, L.USE_FUSED_LOGPROBS, L.SHARE_PROMPTS = varlen, fused, share
        try:
            torch.cuda.reset_peak_memory_stats()
            compute_old_logprobs(state, batch, micro_batch_size=micro)
            _sync(device)
            t0 = time.perf_counter()
            lp = compute_old_logprobs(state, batch, micro_batch_size=micro)["old_logprobs"]
            _sync(device)
            dt = time.perf_counter() - t0
            reference = lp if reference is None else reference
            tf = 2 * n_params * tokens / dt / 1e12
            res["logprobs"][name] = {"seconds": dt, "tflops": tf, "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
                                     "max_abs_vs_first": float((lp - reference).abs().max())}
            print(f"  logprobs {name:60s} {dt:.3f}s {tf:6.1f} TFLOP/s (unshared-token count)", flush=True)
        except Exception as exc:  # noqa: BLE001
            res["logprobs"][name] = {"error": repr(exc)}
            traceback.print_exc()
        torch.cuda.empty_cache()
    L.SHARE_PROMPTS = share_default
    L.USE_VARLEN_ATTENTION = L.USE_FUSED_LOGPROBS = True
    return res


def profile_decode(model, ids, wl, tokens: int | None = None) -> dict:
    """Kernel time of the default engine's decode steps (CUDA graphs replayed), by kernel name:
    where a decode step's time goes. Prints the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    from rlkit.engines import SamplingParams, TorchEngine

    tokens = tokens or wl.max_new_tokens
    eng = TorchEngine.from_model(model)
    params = SamplingParams(n=wl.n, max_new_tokens=tokens, temperature=1.0, ignore_stop=True)
    for _ in range(2):
        eng.generate(ids, params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        out = eng.generate(ids, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    rows = []
    for e in prof.key_averages():
        if not str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue  # CPU-side ops and runtime calls; kernels (and memcpy/memset) are CUDA events
        dev = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if dev:
            rows.append((e.key, float(dev), int(e.count)))
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    steps = tokens - 1
    print(f"  decode kernels over {steps} steps (+ prefill), wall {wall:.3f}s, kernel time {total / 1e3:.1f} ms:", flush=True)
    for name, us, count in rows[:18]:
        print(f"    {us / steps:8.1f} us/step  {count / steps:6.1f} calls/step  {name[:90]}", flush=True)
    eng.release()
    return {"steps": steps, "wall_s": wall, "kernel_ms_total": total / 1e3, "kernels_per_step": sum(r[2] for r in rows) / steps,
            "top": [{"name": n[:120], "us_per_step": us / steps, "calls_per_step": c / steps} for n, us, c in rows[:25]],
            "tokens": float(out.response_mask.sum())}


# --------------------------------------------------------------------------------------- main


def _passes_spill(wl, phases: dict) -> bool:
    """Overlapped with log-prob passes queued: the update phase also holds the passes' GPU tail."""
    return "passes_score" in phases and (wl.old_logprobs is True or bool(wl.beta))


def summarize(wl, times_list, metrics_list, n_params, ceilings, device) -> dict:
    """Medians over the timed steps. Rates are each step's tokens over that step's time, then the
    median: where responses stop at EOS (the CPU presets) the token count varies by step, and one
    step's count over the median time put the rate wherever the last step's length fell."""
    med = {k: statistics.median(t[k] for t in times_list) for k in times_list[0]}

    def rate(count: str, seconds) -> float:  # median over steps of count / seconds(step)
        return statistics.median(mm[count] / seconds(t, mm) for t, mm in zip(times_list, metrics_list))

    tokens = statistics.median(mm["tokens_total"] for mm in metrics_list)
    generated = statistics.median(mm["tokens_generated"] for mm in metrics_list)
    out = {
        "preset": wl.name,
        "device": str(device),
        "params": n_params,
        "rows": wl.rows,
        "tokens_total": tokens,
        "tokens_generated": generated,
        "step_seconds_median": med["step"],
        "step_seconds_all": [t["step"] for t in times_list],
        "phase_seconds_median": med,
        "rollout_tokens_per_s": rate("tokens_generated", lambda t, mm: mm["rollout/seconds"]),
        "rollout_call_tokens_per_s": rate("tokens_generated", lambda t, mm: t["rollout"]),
        "responses_per_s": wl.rows / med["step"],
        "generated_tokens_per_s_step": rate("tokens_generated", lambda t, mm: t["step"]),
        "weight_sync_s": statistics.median(mm.get("sync/seconds", 0.0) for mm in metrics_list),
        "weight_sync_bytes": metrics_list[-1].get("sync/bytes", 0.0) + metrics_list[-1].get("sync/fused_bytes", 0.0),
        "logprob_gap_mean_abs": statistics.median(mm.get("actor/logprob_gap", float("nan")) for mm in metrics_list),
        "logprob_gap_max": max(mm.get("actor/logprob_gap_max", float("nan")) for mm in metrics_list),
        "clipfrac_step1": metrics_list[0].get("actor/clipfrac"),
        "clipfrac_vs_behaviour_step1": metrics_list[0].get("behaviour_clipfrac"),
    }
    if not _passes_spill(wl, med):
        out["update_tflops"] = 6 * n_params * rate("tokens_total", lambda t, mm: t["update"]) / 1e12
    for name in ("old_logprobs", "ref_logprobs"):
        if name in med:
            out[f"{name}_s"] = med[name]
            out[f"{name}_tflops"] = 2 * n_params * rate("tokens_total", lambda t, mm, name=name: t[name]) / 1e12
    if ceilings:
        c = ceilings["bf16_matmul_tflops"]
        out["ceiling"] = ceilings
        if "update_tflops" in out:
            out["update_pct_ceiling"] = 100 * out["update_tflops"] / c
        for name in ("old_logprobs", "ref_logprobs"):
            if f"{name}_tflops" in out:
                out[f"{name}_pct_ceiling"] = 100 * out[f"{name}_tflops"] / c
    return out


#: the configuration that times each phase alone (log-prob passes and update MFU come from it)
SERIAL = "phases one at a time (per-phase times)"


#: the configuration that steps the bf16 weights themselves, as TRL does
PLAIN_ADAMW = "AdamW on the bf16 weights themselves (master_weights=False, as TRL)"


def time_configs(state, model, prompts, wl, device, n_params, ceilings, out: dict, only: tuple[str, ...] | None = None):
    """Time other step configurations in the same process, each after one warm-up step (``only``:
    just the configurations of those names)."""
    import dataclasses

    from rlkit.models.compile import compile_layers, is_compiled, uncompile_layers

    from rlkit.models import logprobs as L

    configs = [
        (SERIAL, dict(overlap=False), None),
        ("old = the update's own forward, detached (TRL's path for one iteration)", dict(old_logprobs="current"), None),
        ("old = rollout log-probs (no separate old pass)", dict(old_logprobs=False), None),
    ]
    sharing = L.shares_prompts(device)
    configs.append((f"prompts {'not ' if sharing else ''}shared in the training forward", {}, "share"))
    if device.type == "cpu":
        configs.append(("rollout engine's decode step compiled (TorchEngine(compile_decode=True))", {}, "compiled_engine"))
    if device.type == "cuda":
        configs.append(("update in one piece (micro-batch 256)", dict(micro_batch=256), None))
        configs.append(("the head recomputed in the backward (KEEP_LOGITS=False)", {}, "checkpoint_logits"))
        if is_compiled(model):
            configs.append(("eager model (compile=False)", {}, "eager"))
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()):
        configs.append((PLAIN_ADAMW, {}, "plain_adamw"))
    for name, changes, mode in configs:
        if only is not None and name not in only:
            continue
        cwl = dataclasses.replace(wl, **changes)
        try:
            if mode == "eager":
                for m in (state.actor, state.ref):
                    if m is not None:
                        uncompile_layers(m)
            if mode == "share":
                L.SHARE_PROMPTS = not sharing
            if mode == "checkpoint_logits":
                L.KEEP_LOGITS = False
            if mode == "plain_adamw":
                kept = (state.optimizer, state.scheduler, state.optimizer_spec)
                spec = dataclasses.replace(state.optimizer_spec, master_weights=False)
                opt, sched = spec.build(state.actor)
                state = state.replace(optimizer=opt, scheduler=sched, optimizer_spec=spec)
            if mode == "compiled_engine":
                from rlkit.engines import TorchEngine

                default_engine = state._cache.get("engine")
                state._cache["engine"] = TorchEngine.from_model(state.actor, compile_decode=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times, metrics = [], []
            timed = 3 if device.type == "cuda" else 10  # CPU steps are short and noisier
            for i in range(1 + timed):  # one warm-up step (the compiling one, where anything compiles)
                state, t, m = grpo_step(state, prompts, cwl, device)
                print(f"[{name}] step {i}: " + ", ".join(f"{k} {v:.3f}s" for k, v in t.items()), flush=True)
                if i:
                    times.append(t)
                    metrics.append(m)
            res = summarize(cwl, times, metrics, n_params, ceilings, device)
            out[name] = {k: res[k] for k in res if k in (
                "step_seconds_median", "phase_seconds_median", "update_tflops", "update_pct_ceiling", "old_logprobs_pct_ceiling",
                "ref_logprobs_pct_ceiling", "old_logprobs_tflops", "ref_logprobs_tflops", "rollout_tokens_per_s", "logprob_gap_mean_abs", "clipfrac_step1", "responses_per_s")}
            if device.type == "cuda":
                out[name]["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
            print(f"[{name}] " + json.dumps(out[name]), flush=True)
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": repr(exc)}
            traceback.print_exc()
        finally:
            L.SHARE_PROMPTS = L.KEEP_LOGITS = "auto"
            if mode == "compiled_engine":
                engine = state._cache.get("engine")
                if engine is not None and getattr(engine, "compile_error", None):
                    out[name]["compile_error"] = engine.compile_error
                state._cache["engine"] = default_engine
            if mode == "eager":
                for m in (state.actor, state.ref):
                    if m is not None:
                        compile_layers(m)
            if mode == "plain_adamw":
                # back to the master copies (stale by these few steps: a timing run, not a training one)
                state = state.replace(optimizer=kept[0], scheduler=kept[1], optimizer_spec=kept[2])
    return state


def print_table(res: dict, trl: dict | None) -> None:
    rows = [
        ("step time (median)", f"{res['step_seconds_median']:.3f} s"),
        ("  rollout (generate + sync + batch)", f"{res['phase_seconds_median']['rollout']:.3f} s"),
    ]
    phases = res["phase_seconds_median"]
    serial = (res.get("configs") or {}).get(SERIAL, {})
    spill = "passes_score" in phases and "update_tflops" not in res
    if spill:  # overlapped: the passes' GPU time spills into the update phase
        rows += [("  log-prob passes queued, responses scored (host)", f"{phases['passes_score']:.3f} s"),
                 ("  update, after the rest of the passes", f"{phases['update']:.3f} s")]
        if serial:
            rows.append(("phases one at a time (step)", f"{serial['step_seconds_median']:.3f} s"))
    for k in ("old_logprobs", "ref_logprobs"):
        src = res if k in phases else serial if k in serial.get("phase_seconds_median", {}) else None
        if src is not None:
            pct = f", {src[k + '_pct_ceiling']:.0f}% of ceiling" if k + "_pct_ceiling" in src else ""
            rows.append((f"  {k.replace('_', ' ')} pass", f"{src['phase_seconds_median'][k]:.3f} s ({src[k + '_tflops']:.3g} TFLOP/s{pct})"))
    src = serial if spill else res
    if "update_tflops" in src:
        pct = f", {src['update_pct_ceiling']:.0f}% of ceiling" if "update_pct_ceiling" in src else ""
        rows.append(("  update (fwd+bwd+AdamW)", f"{src['phase_seconds_median']['update']:.3f} s ({src['update_tflops']:.3g} TFLOP/s{pct})"))
    rows += [
        ("rollout tokens/s (engine)", f"{res['rollout_tokens_per_s']:,.0f}"),
        ("weight sync", f"{res['weight_sync_s'] * 1e3:.2f} ms ({res['weight_sync_bytes'] / 1e9:.3f} GB)"),
        ("responses/s (whole step)", f"{res['responses_per_s']:,.1f}"),
        ("log-prob gap rollout vs training", f"mean {res['logprob_gap_mean_abs']:.2e}, max {res['logprob_gap_max']:.2e}"),
        ("clip fraction, step 1", f"{res['clipfrac_step1']}"),
    ]
    if res.get("clipfrac_vs_behaviour_step1") is not None:
        rows.append(("clip fraction vs behaviour, step 1", f"{res['clipfrac_vs_behaviour_step1']:.4f}"))
    if res.get("weights_bf16_adamw_can_move") is not None:
        master = "float32 master copies" if res.get("master_weights") else "none (AdamW on the bf16 weights)"
        rows.append(("optimizer master weights", master))
        rows.append(("  share a step of lr keeps in bf16 (TRL's AdamW)", f"{res['weights_bf16_adamw_can_move']:.0%} (rk.state.movable_fraction)"))
    if res.get("peak_memory_gb") is not None:
        rows.append(("peak GPU memory", f"{res['peak_memory_gb']:.1f} GB"))
    if trl:
        rows += [
            ("TRL GRPOTrainer step (median)", f"{trl['step_seconds_median']:.3f} s (first {trl['first_step_seconds']:.1f} s)"),
            ("TRL responses/s", f"{trl['responses_per_s']:,.1f}"),
        ]
        if trl.get("peak_memory_gb") is not None:
            rows.append(("TRL peak GPU memory", f"{trl['peak_memory_gb']:.1f} GB"))
        rows.append(("speed-up vs TRL (step time)", f"{trl['step_seconds_median'] / res['step_seconds_median']:.1f}x"))
    for name, c in (res.get("configs") or {}).items():
        if isinstance(c, dict) and "step_seconds_median" in c:
            vs = f", {trl['step_seconds_median'] / c['step_seconds_median']:.1f}x TRL" if trl else ""
            rows.append((f"[{name}] step", f"{c['step_seconds_median']:.3f} s{vs}"))
    width = max(len(r[0]) for r in rows)
    print("\n" + "-" * (width + 40))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 40))


def run_trl(args, device: torch.device) -> dict:
    """TRL's GRPOTrainer on the same workload in a subprocess (``trl_compare.py``): its JSON, or
    ``{"error": ...}``."""
    trl_steps = args.trl_steps if args.trl_steps is not None else (4 if device.type == "cuda" else 8)
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_compare.py"),
           "--preset", args.preset, "--device", str(device), "--steps", str(trl_steps)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return child_json(cmd, "TRL_JSON")


def run_rounds(args, state, prompts, wl: Workload, steps: int, device: torch.device) -> dict:
    """``--rounds R``: R times in turn, ``steps`` rlkit steps with the default engine, ``steps``
    with the decode step compiled, and a TRL run (``run_trl``); each arm's median step per round.
    A machine whose speed drifts then biases no arm: the ratios are taken within a round."""
    from rlkit.engines import TorchEngine

    if device.type != "cpu":
        raise ValueError("--rounds is for the CPU (on a GPU the rlkit state would share the device with TRL's run)")
    default = state._cache.get("engine")
    compiled = TorchEngine.from_model(state.actor, compile_decode=True)
    out: list[dict] = []
    for r in range(args.rounds):
        row = {}
        for arm, engine in (("rlkit", default), ("rlkit_compiled", compiled)):
            state._cache["engine"] = engine
            times = []
            for i in range(1 + steps):  # one untimed step (the compiled engine compiles in round 1)
                state, t, _ = grpo_step(state, prompts, wl, device)
                if i:
                    times.append(t["step"])
            row[f"{arm}_ms"] = 1e3 * statistics.median(times)
        trl = run_trl(args, device)
        if "error" in trl:
            raise RuntimeError("TRL failed in round %d:\n%s" % (r + 1, trl["error"]))
        row["trl_ms"] = 1e3 * trl["step_seconds_median"]
        row["speedup"] = row["trl_ms"] / row["rlkit_ms"]
        row["speedup_compiled"] = row["trl_ms"] / row["rlkit_compiled_ms"]
        print(f"round {r + 1}: TRL {row['trl_ms']:.1f} ms, rlkit {row['rlkit_ms']:.1f} ms ({row['speedup']:.2f}x), "
              f"decode step compiled {row['rlkit_compiled_ms']:.1f} ms ({row['speedup_compiled']:.2f}x)", flush=True)
        out.append(row)
    state._cache["engine"] = default
    summary = {"rounds": out, "speedup_median": statistics.median(r["speedup"] for r in out),
               "speedup_compiled_median": statistics.median(r["speedup_compiled"] for r in out)}
    print(f"rounds: median speed-up vs TRL {summary['speedup_median']:.2f}x, decode step compiled "
          f"{summary['speedup_compiled_median']:.2f}x", flush=True)
    return summary


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: cuda when available)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps after the warm-up step(s)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--compare", choices=["trl"], default=None)
    ap.add_argument("--trl-steps", type=int, default=None,
                    help="TRL steps to run (>= 2: the first, cold one is not in the median)")
    ap.add_argument("--variants", action="store_true", help="GPU: time engine and log-prob variants")
    ap.add_argument("--check", action="store_true", help="GPU: compare fast paths with plain ones first")
    ap.add_argument("--configs", action="store_true",
                    help="after the main steps, also time step configurations side by side: no separate old-policy pass "
                         "(old = the rollout's log-probs, the GRPO recipe's default), larger micro-batches, eager model")
    ap.add_argument("--no-serial", action="store_true",
                    help="skip the steps with the phases one at a time that follow overlapped main steps (they give the "
                         "log-prob passes' times and the update's TFLOP/s; --configs includes them)")
    ap.add_argument("--configs-budget-s", type=float, default=400.0,
                    help="skip --configs when the run has already taken longer than this")
    ap.add_argument("--engine-only", action="store_true", help="with --variants on a GPU: time the engine variants only, then stop")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json", default=None, help="also write the result JSON here")
    ap.add_argument("--profile", metavar="TRACE.json.gz", default=None,
                    help="after the timed steps, trace one more step with torch.profiler, write its Chrome trace here "
                         "and print each phase's GPU time and top kernels (benchmarks/_trace.py)")
    ap.add_argument("--profile-stacks", action="store_true",
                    help="with --profile: record Python stacks, so the summary names the rlkit call behind each host "
                         "wait; slows the host several-fold, so host-bound phases look longer than they are")
    ap.add_argument("--rounds", type=int, default=0,
                    help="CPU, with --compare trl: after everything else, alternate rlkit (default engine), rlkit (decode "
                         "step compiled) and TRL this many times, --steps / --trl-steps each, so that all three see the "
                         "same drift of a noisy machine; reports each round's ratios and their medians")
    args = ap.parse_args(argv)
    if args.rounds and args.compare != "trl":
        ap.error("--rounds needs --compare trl")
    if args.rounds < 0:
        ap.error(f"--rounds must be >= 0, got {args.rounds}")
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--trl-steps", args.trl_steps, 2),
                               ("--threads", args.threads, 1)):
        if value is not None and value < least:
            ap.error(f"{flag} must be >= {least}, got {value}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        # found before the run, not after it: the figures would be printed but not written
        ap.error(f"--json {args.json}: its folder does not exist; create it or pass another path")
    if args.json and os.path.isdir(args.json):
        ap.error(f"--json {args.json} is a folder; give a file path (e.g. {os.path.join(args.json, 'result.json')})")
    if args.engine_only and not args.variants:
        # it timed nothing and exited 0
        ap.error("--engine-only stops after the engine variants, so it needs --variants (a GPU run)")
    if args.engine_only and (args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())):
        ap.error("--engine-only times the GPU engine variants (--variants); on the CPU it would time nothing")
    if args.device != "auto":
        try:
            torch.device(args.device)
        except RuntimeError:
            ap.error(f"--device {args.device}: not a device; use cpu, cuda or cuda:N")
    if args.device not in ("auto", "cpu") and torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch has no CUDA device ({torch.__version__}); use --device cpu")
    started = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    gpu = device.type == "cuda"
    steps = args.steps if args.steps is not None else (3 if gpu else 10)
    warmup = args.warmup if args.warmup is not None else (1 if gpu else 2)

    from rlkit.data import as_prompts
    from rlkit.optim import adamw
    from rlkit.state import init

    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "python": platform.python_version()}
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    ceilings = None
    if gpu:
        result["gpu"] = torch.cuda.get_device_name(device)
        ceilings = measure_ceilings(device)
        print(f"ceilings: {ceilings}", flush=True)
    else:
        result["cpu_threads"] = torch.get_num_threads()
    from rlkit.models import logprobs as L

    result["keep_logits"] = L.KEEP_LOGITS
    wl, model, tok, texts = build(args.preset, device)
    n_params = param_count(model)
    from rlkit.optim import MasterWeightAdamW
    from rlkit.state import movable_fraction

    # bf16 weights at lr 1e-6 (TRL's default): AdamW on the bf16 weights themselves, as TRL runs it,
    # keeps only this share of a step; rlkit's default steps float32 master copies instead
    moved = movable_fraction(model, wl.lr)
    if moved is not None:
        result["weights_bf16_adamw_can_move"] = moved
    state = init(model, adamw(lr=wl.lr), tokenizer=tok, ref="copy" if wl.beta else None)
    result["master_weights"] = isinstance(state.optimizer, MasterWeightAdamW)
    prompts = as_prompts(texts, tok)

    if args.check and gpu:
        try:
            result["checks"] = run_checks(model, tok, wl, device)
        except Exception as exc:  # noqa: BLE001
            result["checks"] = {"error": repr(exc)}
            traceback.print_exc()
        print("checks:", json.dumps(result["checks"]), flush=True)
    if args.variants and gpu:
        result["variants"] = run_variants(model, state, prompts, wl, device, n_params, engine_only=args.engine_only)
    if args.engine_only:
        emit_result(result, args.json)
        return result

    times, metrics = [], []
    for i in range(warmup + steps):
        if gpu and i == warmup:
            torch.cuda.reset_peak_memory_stats(device)
        state, t, m = grpo_step(state, prompts, wl, device)
        print(f"step {i}: " + ", ".join(f"{k} {v:.3f}s" for k, v in t.items()), flush=True)
        if i >= warmup:
            times.append(t)
            metrics.append(m)
    res = summarize(wl, times, metrics, n_params, ceilings, device)
    if args.profile:
        state = profile_step(state, prompts, wl, device, args.profile, args.profile_stacks)
    if gpu:
        res["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    result.update(res)

    if args.configs and time.perf_counter() - started > args.configs_budget_s:
        result["configs"] = {"skipped": f"run already at {time.perf_counter() - started:.0f}s"}
    elif args.configs:
        result["configs"] = {}
        state = time_configs(state, model, prompts, wl, device, n_params, ceilings, result["configs"])
    elif _passes_spill(wl, result["phase_seconds_median"]) and not args.no_serial:
        # the main steps overlap the log-prob passes with the update, so neither has a time of its
        # own: time the phases one at a time too, for the passes' times and the update's TFLOP/s
        result["configs"] = {}
        state = time_configs(state, model, prompts, wl, device, n_params, ceilings, result["configs"], only=(SERIAL,))
    trl = None
    rounds_state = (state, prompts, wl, steps) if args.rounds else None
    if args.compare == "trl":
        del state, model
        if gpu:
            torch.cuda.empty_cache()
        trl = run_trl(args, device)
        result["trl"] = trl
        if "error" in trl:
            trl = None
            print("TRL failed:\n" + result["trl"]["error"], flush=True)
        else:
            result["speedup_vs_trl"] = trl["step_seconds_median"] / result["step_seconds_median"]
    print_table(result, trl)
    if rounds_state is not None:
        result["rounds"] = run_rounds(args, *rounds_state, device)
    emit_result(result, args.json)
    return result


if __name__ == "__main__":
    main()
