"""TRL's GRPOTrainer on the same workload as ``grpo_step.py`` (same model shape, prompts, reward).

Run by ``grpo_step.py --compare trl`` (in a subprocess, so each side's peak memory is its own),
or alone: ``python benchmarks/trl_compare.py --preset cpu --steps 5``. Prints one JSON line.

Settings that make TRL do this work: ``num_generations = n``, a generation batch of all rows
(``per_device_train_batch_size x gradient_accumulation_steps``), ``max_completion_length``,
``min_new_tokens`` = max (EOS ignored) where the workload ignores EOS, ``beta`` as the workload,
transformers ``generate`` (no vLLM). With one generation per optimizer step TRL skips the
old-policy log-prob pass (it reuses the detached current log-probs), so on the GPU preset it
does one forward pass less than rlkit's step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _workload import PRESETS, build, reward  # noqa: E402


def run_trl(preset: str, device: str, steps: int) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    dev = torch.device(device)
    wl, model, tok, texts = build(preset, torch.device("cpu"))
    # TRL builds the reference model (beta > 0) from the policy's path: save the random model once
    path = tempfile.mkdtemp(prefix="trl_model_")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    rows = wl.rows
    micro = 32 if dev.type == "cuda" else rows
    accumulation = rows // micro
    data = Dataset.from_dict({"prompt": texts * (steps + 1)})
    generation_kwargs = {"min_new_tokens": wl.max_new_tokens} if wl.ignore_eos else {}
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_bench_"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        num_generations=wl.n,
        max_completion_length=wl.max_new_tokens,
        generation_kwargs=generation_kwargs,
        beta=wl.beta,
        learning_rate=wl.lr,
        temperature=1.0,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=wl.dtype == torch.bfloat16,
        use_cpu=dev.type == "cpu",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": wl.dtype, "attn_implementation": "sdpa"},
    )
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(model=path, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok, callbacks=[Timer()])
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steady = times[1:] if len(times) > 1 else times
    step = statistics.median(steady)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    tokens = None
    if logs and "completions/mean_length" in logs[-1]:
        tokens = logs[-1]["completions/mean_length"] * rows
    out = {
        "framework": "trl",
        "preset": preset,
        "device": str(dev),
        "step_seconds_median": step,
        "step_seconds_all": times,
        "first_step_seconds": times[0] if times else None,
        "responses_per_s": rows / step,
        "generated_tokens_per_step": tokens,
        "generated_tokens_per_s": (tokens / step) if tokens else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else None,
    }
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_trl(args.preset, args.device, args.steps)
    print("TRL_JSON " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
