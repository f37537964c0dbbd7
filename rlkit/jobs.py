"""Built-in jobs behind ``rlkit run <task>``: warm-up, RL with any recipe, held-out evaluation.

``run_task("arithmetic", options)`` is also callable from Python; it returns a summary dict
(the object ``--json`` prints).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

import torch

#: defaults of the embedded main job, tuned to finish in a few minutes on a 2-core CPU
DEFAULTS = dict(
    task="arithmetic",
    algo="grpo",
    steps=30,
    sft_steps=1500,
    batch_size=16,
    n=8,
    lr=3e-4,
    sft_lr=3e-3,
    seed=0,
    device="cpu",
    size="tiny",
    eval_every=10,
    eval_size=200,
    temperature=1.0,
    kl=0.0,
    out=None,
    json=False,
    quiet=False,
    nproc_per_node=None,
    resume=None,
    checkpoint_every=0,
    keep_checkpoints=3,
    teacher_error=0.6,
    samples=0,
)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    from rlkit.recipes import RECIPES
    from rlkit.tasks import TASKS

    d = DEFAULTS
    p.add_argument("task", help=f"built-in task: {', '.join(sorted(TASKS))}")
    p.add_argument("--algo", default=d["algo"], help=f"recipe: {', '.join(RECIPES)} (default {d['algo']})")
    p.add_argument("--steps", type=int, default=d["steps"],
                   help="the RL step to reach (a resumed run continues up to it: --steps 50 after step 30 runs 20 more)")
    p.add_argument("--sft-steps", type=int, default=d["sft_steps"], help="supervised warm-up steps before RL")
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="prompts per RL step")
    p.add_argument("--n", type=int, default=d["n"], help="samples per prompt")
    p.add_argument("--lr", type=float, default=d["lr"], help="RL learning rate")
    p.add_argument("--sft-lr", type=float, default=d["sft_lr"], help=f"warm-up learning rate (default {d['sft_lr']:g})")
    p.add_argument("--kl", type=float, default=d["kl"], help="low_var_kl coefficient to a frozen reference (0: no reference)")
    p.add_argument("--temperature", type=float, default=d["temperature"],
                   help=f"sampling temperature of the RL rollouts, > 0 (default {d['temperature']:g}; evaluation is always greedy)")
    p.add_argument("--teacher-error", type=float, default=d["teacher_error"],
                   help="how often the warm-up teacher writes a redundant '+0' after the answer ('46+0'), which the "
                        "verifier rejects; RL has to unlearn the habit (0: a perfect teacher)")
    p.add_argument("--seed", type=int, default=d["seed"],
                   help=f"seeds the model's initial weights, the warm-up and RL sampling (default {d['seed']}; "
                        "a resumed run keeps its checkpoint's seed)")
    p.add_argument("--device", default=d["device"], help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--size", default=d["size"], help="model preset (tiny, small, ...)")
    p.add_argument("--eval-every", type=int, default=d["eval_every"],
                   help=f"measure held-out accuracy every K RL steps and after the last (default {d['eval_every']}; "
                        "0: only after the warm-up and at the end)")
    p.add_argument("--samples", type=int, default=d["samples"],
                   help="show what the model writes: K sampled responses (from different prompts) with their rewards, as a "
                        "table at every evaluation (--eval-every) and in OUT/metrics.jsonl each step (default 0: none)")
    p.add_argument("--eval-size", type=int, default=d["eval_size"],
                   help=f"held-out prompts scored (greedy) for accuracy, at most the task's test set (default {d['eval_size']})")
    p.add_argument("--out", default=None, help="directory: saves the model (save_pretrained), metrics.jsonl and summary.json; "
                   "an earlier run found there is moved to OUT/previous-<k> unless this run resumes one of its checkpoints")
    p.add_argument("--resume", default=None, help="'auto' (needs --out: the newest complete checkpoint in OUT/checkpoints, or a fresh start) "
                   "or a checkpoint path (a step_* directory, a checkpoints directory or another run's --out); skips the warm-up")
    p.add_argument("--checkpoint-every", type=int, default=d["checkpoint_every"],
                   help="save a checkpoint every K steps into OUT/checkpoints (with --out the last step is saved too, "
                   "and a SIGTERM saves, then exits with 143)")
    p.add_argument("--keep-checkpoints", type=int, default=d["keep_checkpoints"], help="keep the newest N checkpoints (0: all)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="run data-parallel over N local processes")
    p.add_argument("--json", action="store_true", help="print one JSON summary object as the last stdout line")
    p.add_argument("--quiet", action="store_true",
                   help="hide the progress bars (warm-up, RL steps, saving the model) and the --samples tables; the held-out "
                        "accuracies and the summary table still print (to stderr), as do warnings and errors")


def _options(options: dict[str, Any] | None) -> argparse.Namespace:
    merged = dict(DEFAULTS)
    for k, v in (options or {}).items():
        merged[k.replace("-", "_")] = v
    unknown = set(merged) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    for key, value in merged.items():
        want = type(DEFAULTS[key])
        if DEFAULTS[key] is None or value is None:
            continue
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            merged[key] = float(value)
        elif not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise TypeError(f"option {key!r} must be {want.__name__}, got {type(value).__name__} {value!r} (default {DEFAULTS[key]!r})")
    positive = ("steps", "batch_size", "n", "eval_size")
    for key in positive:
        if merged[key] < 1:
            raise ValueError(f"option {key!r} must be >= 1, got {merged[key]}")
    if not 0 <= merged["seed"] < 2**63:
        # rk.init refused it only after the whole warm-up (a number past 64 bits as "Overflow when unpacking long long")
        raise ValueError(f"option 'seed' (--seed) must be in [0, 2**63), got {merged['seed']}")
    if merged["sft_steps"] < 0:
        raise ValueError(f"option 'sft_steps' must be >= 0, got {merged['sft_steps']}")
    # checked here, before the warm-up, rather than by fit() / the Checkpointer after it
    if merged["eval_every"] < 0:
        raise ValueError(f"option 'eval_every' (--eval-every) must be >= 0 (0: no evaluation during RL), got {merged['eval_every']}")
    # with the other option checks: --out is created (and tested for writing) right after them
    if merged["checkpoint_every"] < 0:
        raise ValueError(f"--checkpoint-every must be >= 0 (0: no periodic saves; the last step and a SIGTERM still save), "
                         f"got {merged['checkpoint_every']}")
    if merged["checkpoint_every"] and not merged["out"]:
        raise ValueError("--checkpoint-every needs --out DIR (checkpoints are written to DIR/checkpoints)")
    from rlkit.models import PRESETS

    if merged["size"] not in PRESETS:
        # refused by tiny() only after the previous run's output was set aside
        raise ValueError(f"option 'size' (--size) is {merged['size']!r}; the model presets are {sorted(PRESETS)}")
    if merged["samples"] < 0:
        raise ValueError(f"option 'samples' (--samples) must be >= 0 (sampled responses shown per step; 0: none), got {merged['samples']}")
    if merged["keep_checkpoints"] < 0:
        raise ValueError(f"option 'keep_checkpoints' (--keep-checkpoints) must be >= 0 (0: keep every checkpoint), "
                         f"got {merged['keep_checkpoints']}")
    return argparse.Namespace(**merged)


def _check_against_task(opts: argparse.Namespace, task) -> None:
    """The options that need the task's data, checked before the warm-up (the prompt stream
    would otherwise refuse the batch size only at the first RL step)."""
    n_train = len(task.train)
    if opts.batch_size > n_train:
        raise ValueError(f"option 'batch_size' (--batch-size) is {opts.batch_size}, more than the {n_train} training prompts "
                         f"of task {opts.task!r}; use --batch-size {n_train} or less")
    n_test = len(task.test)
    if opts.eval_size > n_test:
        # it was capped silently: the accuracies were over fewer prompts than asked, and nothing said so
        raise ValueError(f"option 'eval_size' (--eval-size) is {opts.eval_size}, more than the {n_test} held-out test prompts "
                         f"of task {opts.task!r}; use --eval-size {n_test} or less")


#: what a run writes into ``--out``
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "model", "checkpoints")


def _continues_out(out: str, resume_from) -> bool:
    """Whether this run continues the run already in ``out``: it resumes a checkpoint kept in
    ``out/checkpoints`` (``--resume auto``, ``--resume OUT`` or a path under it)."""
    if resume_from is None:
        return False
    root = os.path.realpath(os.path.join(out, "checkpoints"))
    return os.path.commonpath([root, os.path.realpath(resume_from)]) == root


def _set_aside_previous_run(out: str) -> tuple[str, list[str]] | None:
    """Move an earlier run's outputs in ``out`` into a new ``out/previous-<k>``; returns that
    folder and the names moved (None: nothing to move).

    A fresh run (no ``--resume``, ``--resume auto`` with no checkpoint yet, or a checkpoint from
    elsewhere) used to append its steps to the old run's ``metrics.jsonl`` (steps 1, 2, 1, 2 in
    one file) and overwrite its ``summary.json`` and ``model/`` at the end. Refusing instead
    would break the one command a preemptible job re-runs (``--resume auto`` starts afresh while
    no checkpoint exists, and must start cleanly after a kill before the first one), and
    truncating or overwriting loses a run. So the earlier run is moved aside whole, together
    (its metrics, summary, model and checkpoints stay consistent with each other), nothing is
    deleted, OUT holds exactly one run, and stderr says where the old one went.
    """
    found = [name for name in RUN_OUTPUTS if os.path.lexists(os.path.join(out, name))
             and not (os.path.isdir(os.path.join(out, name)) and not os.listdir(os.path.join(out, name)))]
    if not found:
        return None
    taken = [int(name.removeprefix("previous-")) for name in os.listdir(out)
             if name.startswith("previous-") and name.removeprefix("previous-").isdigit()]
    where = os.path.join(out, f"previous-{max(taken, default=0) + 1}")
    os.makedirs(where)
    for name in found:
        os.replace(os.path.join(out, name), os.path.join(where, name))
    return where, found


def _continue_hint(opts: argparse.Namespace) -> str:
    """The end of the message about an earlier run set aside from ``--out``: how to continue that
    run instead, only where that would work. It always said "pass --resume auto", also to a run
    given --resume auto (which found no complete checkpoint there), and to one whose earlier run
    left no checkpoint to continue from."""
    from rlkit.checkpoint import latest

    root = os.path.join(opts.out, "checkpoints")
    if opts.resume == "auto":
        return f" (--resume auto found no complete checkpoint in {root} to continue from.)"
    if latest(root) is None:
        return ""
    return " To continue the run in --out instead, pass --resume auto."


def _recipe_before_warmup(opts: argparse.Namespace):
    """The job's recipe, with its sampling and KL options, built (and so checked) before the
    warm-up, with the options that would otherwise fail only at the first RL step."""
    from rlkit import recipes
    from rlkit.state import _checked_device

    if opts.nproc_per_node is not None and opts.nproc_per_node < 1:
        raise ValueError(f"option 'nproc_per_node' must be >= 1, got {opts.nproc_per_node}")
    if opts.nproc_per_node and opts.nproc_per_node > 1 and opts.batch_size % opts.nproc_per_node:
        # checked here, before the processes start (it failed in every worker, after the warm-up)
        raise ValueError(f"--batch-size {opts.batch_size} must be a multiple of the {opts.nproc_per_node} processes "
                         f"(--nproc-per-node); e.g. --batch-size {opts.batch_size - opts.batch_size % opts.nproc_per_node or opts.nproc_per_node}")
    _checked_device(opts.device)
    if opts.kl < 0:
        raise ValueError(f"option 'kl' must be >= 0 (0: no reference), got {opts.kl}")
    from rlkit.optim import adamw

    for name in ("lr", "sft_lr"):  # adamw's own check (a positive finite lr), naming the flag, before the warm-up
        try:
            adamw(lr=getattr(opts, name))
        except ValueError:
            raise ValueError(f"option '{name}' (--{name.replace('_', '-')}) must be a positive finite number, "
                             f"got {getattr(opts, name)!r}") from None
    if opts.out and os.path.exists(opts.out) and not os.path.isdir(opts.out):
        raise ValueError(f"option 'out' is {opts.out!r}, an existing file; give a directory (it is created when missing)")
    if opts.out:
        # created (and tried) now: a path that cannot be written failed with a traceback after the warm-up
        try:
            os.makedirs(opts.out, exist_ok=True)
            with tempfile.TemporaryFile(dir=opts.out):
                pass
        except OSError as e:
            raise ValueError(f"option 'out' (--out {opts.out}) cannot be created or written to ({type(e).__name__}: "
                             f"{e.strerror or e}); give a directory you can write to") from None
    # checked on the algorithm's default recipe first, to name the flag (the recipe names its field)
    if opts.n < 2 and recipes.get(opts.algo).compares_groups():
        raise ValueError(f"option 'n' is {opts.n}, but --algo {opts.algo} compares the samples of each prompt with each "
                         "other; use --n 2 or more (or --algo ppo, whose critic needs no groups)")
    return recipes.get(opts.algo, n=opts.n, temperature=opts.temperature,  # the recipe checks these
                       kl=("low_var_kl", opts.kl) if opts.kl else None, log_samples=opts.samples)


def _overlong_shaping(recipe) -> dict[str, int]:
    """DAPO's overlong buffer for the job: 1 token. The task's ``max_new_tokens`` is its longest
    answer + 2 (5 for 2-digit sums), so a right answer and its EOS end at least one token before
    the limit; the soft overlong punishment should touch only the responses that reach the limit
    (cut off, or rambling: the warm-up teacher's ``"+0"``). DAPO's default buffer of 4 made the
    penalty ramp from length 1: every answer was penalised, 0.25 per token."""
    from rlkit.recipes import DAPO

    return {"overlong_buffer": 1} if isinstance(recipe, DAPO) else {}


def _resume_target(opts: argparse.Namespace):
    """The checkpoint ``--resume`` points at, or None (a fresh start).

    ``auto``: the newest complete checkpoint in ``OUT/checkpoints`` (none yet: a fresh start);
    a path: a step_* directory, a checkpoints directory or another run's ``--out``.
    """
    from rlkit.checkpoint import latest, resolve

    if not opts.resume:
        return None
    if opts.resume == "auto":
        if not opts.out:
            raise ValueError("--resume auto needs --out DIR (it continues from the newest checkpoint in DIR/checkpoints)")
        found = latest(os.path.join(opts.out, "checkpoints"))
    else:
        found = resolve(opts.resume)
    step = _checkpoint_step(found) if found is not None else None
    if step is not None and opts.steps < step:
        raise ValueError(f"--steps {opts.steps} is below step {step} of the checkpoint this run resumes ({found}): --steps is the "
                         f"step to reach, not a count; pass --steps {step + opts.steps} for {opts.steps} more")
    return found


def _keeps_no_checkpoint(out: str, resume_from, state) -> bool:
    """Whether ``out/checkpoints`` lacks a checkpoint of ``state`` as its newest: false only when
    ``state`` was just loaded, unchanged, from that newest checkpoint itself (saving it again would
    copy it onto itself)."""
    from rlkit.checkpoint import latest

    newest = latest(os.path.join(out, "checkpoints"))
    if newest is None or resume_from is None:
        return True
    return os.path.realpath(newest) != os.path.realpath(resume_from) or _checkpoint_step(newest) != state.step


def _checkpoint_step(path) -> int | None:
    """The step a checkpoint directory restores (its ``meta.json``), None where it does not say."""
    from rlkit.checkpoint import META

    try:
        with open(os.path.join(path, META), encoding="utf-8") as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


#: ``state.extras`` keys the job keeps in its checkpoints, so that a resumed run can tell what it continues
ACCURACY_BEFORE_KEY = "job/accuracy_before_rl"
EVAL_SIZE_KEY = "job/eval_size"  # the --eval-size that accuracy was measured on
ALGOS_KEY = "job/algos"  # [[algo, first step it trained], ...]: which recipe trained which steps


def _check_resumed_eval_size(opts: argparse.Namespace, state, resume_from) -> None:
    """Refuse a resumed run whose ``--eval-size`` differs from the one its checkpoint's accuracy
    after warm-up was measured on (``state.extras``): ``accuracy_gain`` subtracted an accuracy
    over the first 20 held-out prompts from one over the first 4, without a word.

    Refused rather than re-measured: the "before" accuracy is that of the model right after the
    warm-up, which the checkpoint does not hold (it holds the model after RL step k). Evaluating
    the checkpoint on the new prompts would report the gain of the remaining steps only, labelled
    as the gain of RL. A checkpoint that does not record its --eval-size (saved before it was kept,
    or by one's own code) is not checked."""
    saved = state.extras.get(EVAL_SIZE_KEY)
    if saved is None or saved == opts.eval_size:
        return
    raise ValueError(
        f"option 'eval_size' (--eval-size) is {opts.eval_size}, but the run this resumes ({resume_from}) measured its "
        f"held-out accuracy after warm-up on --eval-size {saved} prompts: the accuracy gain would compare different "
        f"prompt sets, and the warm-up model is not in the checkpoint to measure again. Pass --eval-size {saved} to "
        f"continue it, or start a fresh run (no --resume) to evaluate on {opts.eval_size} prompts")


def _resumed_algos(opts: argparse.Namespace, state, resume_from) -> list[list[Any]]:
    """The run's ``[[algo, first step], ...]`` once this run's steps are added, warning when
    ``--algo`` differs from the recipe that trained the checkpoint's last steps.

    The recipes that load each other's checkpoints (the critic-free ones: a critic or a
    reference model that one has and the other lacks is refused by the load) train the same
    weights with the same optimizer, so continuing with another one works, and is the user's
    explicit choice: the new recipe trains the new steps (unlike --lr or --seed, where the
    checkpoint's optimizer and seed govern). But it was silent, and the summary said "algo":
    "dapo" for a run whose first steps were grpo; now it warns, as a changed --lr does, and the
    summary's ``algos`` lists which recipe trained which steps. ``None``: steps of a checkpoint
    that does not record its recipe (saved before it was kept, or by one's own code)."""
    import warnings

    algos = [list(segment) for segment in state.extras.get(ALGOS_KEY) or ([[None, 1]] if state.step else [])]
    algos = [segment for segment in algos if segment[1] <= state.step]  # a recipe that trained no step is none of the run's
    if state.step >= opts.steps:
        return algos  # no step to train: nothing is trained with --algo
    last = algos[-1][0] if algos else None
    if last is not None and last != opts.algo:
        warnings.warn(
            f"checkpoint {resume_from} was trained with --algo {last} (steps {algos[-1][1]}-{state.step}) but this run "
            f"continues it with --algo {opts.algo}: steps {state.step + 1}-{opts.steps} use the {opts.algo} recipe, on the "
            f"{last}-trained model and optimizer state, and the summary's 'algos' lists both. To continue with {last}, "
            f"pass --algo {last}; to train with {opts.algo} alone, start a fresh run (no --resume)",
            RuntimeWarning, stacklevel=3)
    if last != opts.algo:
        algos.append([opts.algo, state.step + 1])
    return algos


#: the RL options a resumed run may change, warned about as a changed --lr is: each shapes the steps
#: it trains (samples per prompt, their temperature, the KL coefficient) and nothing in the
#: checkpoint holds them; --kl on or off changes the state's roles and is refused by the load
SAMPLING_KEY = "job/sampling"
SAMPLING_OPTIONS = ("n", "temperature", "kl")


def _sampling(opts: argparse.Namespace) -> dict[str, Any]:
    """This run's :data:`SAMPLING_OPTIONS`, as the checkpoints keep them."""
    return {name: getattr(opts, name) for name in SAMPLING_OPTIONS}


def _warn_changed_sampling(opts: argparse.Namespace, state, resume_from) -> dict[str, Any]:
    """Warn for each of :data:`SAMPLING_OPTIONS` that differs from the run the checkpoint holds
    (``state.extras``): a resume with --n 16 after --n 4 trained its new steps on four times the
    samples without a word. Returns this run's values, to keep in the checkpoints."""
    import warnings

    now = _sampling(opts)
    saved = state.extras.get(SAMPLING_KEY) or {}
    if state.step >= opts.steps:
        return {**now, **saved}  # no step to train: nothing is trained with the new values
    changed = [name for name in SAMPLING_OPTIONS if name in saved and saved[name] != now[name]]
    if changed:
        flags = ", ".join(f"--{name} {saved[name]:g} -> {now[name]:g}" for name in changed)
        warnings.warn(
            f"checkpoint {resume_from} was trained with other RL options than this run continues it with ({flags}): "
            f"steps {state.step + 1}-{opts.steps} use the new values. To continue the run as it was, pass "
            + " ".join(f"--{name} {saved[name]:g}" for name in changed),
            RuntimeWarning, stacklevel=3)
    return now


def _algos_summary(algos: list[list[Any]], last_step: int) -> list[dict[str, Any]]:
    """``[[algo, first step], ...]`` as the summary's ``[{"algo": ..., "steps": [first, last]}, ...]``
    (the steps that were trained: a segment that trained none is left out)."""
    out = []
    for i, (algo, first) in enumerate(algos):
        last = algos[i + 1][1] - 1 if i + 1 < len(algos) else last_step
        if last >= first:
            out.append({"algo": algo, "steps": [first, last]})
    return out


def json_ready(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with every non-finite number (NaN, inf) as None, so ``json.dumps(...,
    allow_nan=False)`` writes strict JSON: ``null``, as :class:`JSONLSink` does, not ``NaN``, which
    strict parsers reject. (The accuracy before RL is NaN when a resumed checkpoint does not
    record it, e.g. one saved by the user's own code.)"""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}


def check_options(task_name: str, options: dict[str, Any] | None = None):
    """Every check that needs no model: ``(opts, recipe, resume_from, task)`` or a ``ValueError``
    naming the option. Run first by :func:`run_task`, and by ``rlkit run --nproc-per-node N`` before
    it starts the workers, so a bad option never costs the warm-up (or a process launch)."""
    from rlkit import tasks

    opts = _options({**(options or {}), "task": task_name})
    recipe = _recipe_before_warmup(opts)
    resume_from = _resume_target(opts)
    task = tasks.get(task_name, **({"teacher_error": opts.teacher_error} if task_name == "arithmetic" else {}))
    _check_against_task(opts, task)
    return opts, recipe, resume_from, task


def run_task(task_name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Warm up a tiny model on ``task_name``, run RL, evaluate before/after; return the summary."""
    from rich.console import Console

    from rlkit.evaluate import evaluate
    from rlkit.loop import fit
    from rlkit.models import tiny
    from rlkit.observe.console import ConsoleSink, summary_table
    from rlkit.observe.sinks import JSONLSink
    from rlkit.optim import adamw
    from rlkit.sft import warmup
    from rlkit.state import init

    opts, recipe, resume_from, task = check_options(task_name, options)
    if opts.quiet:
        # transformers' own bars too ("Writing model shards" when the model is saved), in every
        # process of a multi-process run: --quiet says none
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    t_start = time.perf_counter()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = 0
    if distributed:
        # under `rlkit run --nproc-per-node N` / rlkit.launch / torchrun: the same job, lowered
        # onto all ranks (FSDP2 actor, rollout split over replicas); rank 0 reports
        from rlkit.parallel import init_distributed

        info = init_distributed()
        rank = info.rank
        if opts.device.startswith("cuda"):
            opts.device = f"cuda:{info.local_rank}"
            torch.cuda.set_device(info.local_rank)
    if opts.out and not _continues_out(opts.out, resume_from):
        if rank == 0 and os.path.isdir(opts.out):
            hint = _continue_hint(opts)  # before the move: it looks for a checkpoint in OUT/checkpoints
            moved = _set_aside_previous_run(opts.out)
            if moved:
                where, names = moved
                print(f"rlkit run: --out {opts.out} held an earlier run and this run starts afresh (it resumes no checkpoint "
                      f"of {os.path.join(opts.out, 'checkpoints')}): that run's {', '.join(names)} were moved to {where}, "
                      f"nothing deleted, nothing mixed into this run's outputs.{hint}", file=sys.stderr, flush=True)
        if distributed:
            from rlkit.parallel import barrier

            barrier()  # no rank touches OUT before rank 0 has moved the old run out of it
    # --quiet hides the progress bars (each is built only without it), not the result: it printed
    # nothing at all, so without --json the run's accuracies never appeared
    console = Console(stderr=True, quiet=rank != 0)
    device = torch.device(opts.device)
    torch.manual_seed(opts.seed)
    model = tiny(task.tokenizer, size=opts.size, seed=opts.seed).to(device)
    tok = task.tokenizer
    eval_set = task.test.take(range(opts.eval_size))  # at most len(task.test): check_options refuses more

    def accuracy(m, state=None) -> float:
        # a lowered state evaluates with its rollout engine, synced to the sharded actor's weights
        return evaluate(state if state is not None else m, tok, eval_set, task.reward, max_new_tokens=task.max_new_tokens)["accuracy"]

    if resume_from is None:
        sft_sink = ConsoleSink(opts.sft_steps, "warm-up", keys=("sft/loss",), console=console) if not opts.quiet and opts.sft_steps else None
        warmup(model, tok, task.sft_examples, steps=opts.sft_steps, lr=opts.sft_lr, seed=opts.seed,
               sinks=[sft_sink] if sft_sink else ())
        if sft_sink:
            sft_sink.close()
        acc_before = accuracy(model)
        console.print(f"held-out accuracy after warm-up: [bold]{acc_before:.3f}[/bold]")

    recipe = recipe.with_(max_new_tokens=task.max_new_tokens, **_overlong_shaping(recipe))
    critic = None
    if recipe.needs_critic():
        from rlkit.models import critic as make_critic

        critic = make_critic(model)
    state = init(model, adamw(lr=opts.lr, weight_decay=0.0), tokenizer=tok, ref="copy" if recipe.needs_ref() else None, critic=critic, seed=opts.seed)
    if distributed:
        from rlkit.pipeline import Pipeline

        if opts.batch_size % int(os.environ["WORLD_SIZE"]):
            raise ValueError(f"--batch-size {opts.batch_size} must be a multiple of the {os.environ['WORLD_SIZE']} processes")
        state = Pipeline(recipe, task.reward).lower().shard(state)
    if resume_from is not None:
        # the checkpoint holds the warmed-up (and partly RL-trained) model, the ref and the optimizer
        from rlkit.checkpoint import load

        state = load(state, resume_from)
        _check_resumed_eval_size(opts, state, resume_from)
        acc_before = state.extras.get(ACCURACY_BEFORE_KEY, float("nan"))
        algos = _resumed_algos(opts, state, resume_from)
        sampling = _warn_changed_sampling(opts, state, resume_from)
        console.print(f"resumed from {resume_from} at step {state.step} (data position {state.data_position})")
        state = state.replace(extras={**state.extras, ALGOS_KEY: algos, SAMPLING_KEY: sampling})
    else:
        # kept in the checkpoints so a resumed job still reports the accuracy before RL, and can
        # tell whether it is measured on the same prompts and which recipe trained which steps
        algos = [[opts.algo, 1]]
        state = state.replace(extras={**state.extras, ACCURACY_BEFORE_KEY: acc_before, EVAL_SIZE_KEY: opts.eval_size,
                                      ALGOS_KEY: algos, SAMPLING_KEY: _sampling(opts)})
    checkpointer = None
    if opts.out:
        # with --out a SIGTERM always saves (at the next step boundary) and exits with status 143, and
        # fit saves the final state (so a longer --steps continues from it); --checkpoint-every K
        # also saves every K steps into OUT/checkpoints
        from rlkit.checkpoint import Checkpointer

        checkpointer = Checkpointer(os.path.join(opts.out, "checkpoints"), every=opts.checkpoint_every, keep=opts.keep_checkpoints)
    sinks: list[Any] = []
    if opts.out and rank == 0:
        os.makedirs(opts.out, exist_ok=True)
        sinks.append(JSONLSink(os.path.join(opts.out, "metrics.jsonl")))
    # --samples: the table at each evaluation's step (and the last), where the accuracy shows too
    shown_every = (opts.eval_every or opts.steps) if opts.samples else None
    bar = (ConsoleSink(opts.steps, f"RL ({opts.algo})", console=console, samples_every=shown_every)
           if not opts.quiet and rank == 0 else None)
    if bar:
        sinks.append(bar)
    try:
        state, history = fit(
            state, recipe, task.reward, task.train, steps=opts.steps, batch_size=opts.batch_size, sinks=sinks,
            # --eval-every 0: no evaluation during RL (the job measures the accuracy after it)
            eval_fn=(lambda s: {"accuracy": accuracy(s.actor, s)}) if opts.eval_every else None, eval_every=opts.eval_every,
            checkpointer=checkpointer,
        )
        if checkpointer is not None and not history and _keeps_no_checkpoint(opts.out, resume_from, state):
            # fit saves the final state only after a step: a run that trains none (resumed at --steps
            # already) still writes its model and summary into --out, and, with no checkpoint next to
            # them, a later --resume auto set that run aside and started afresh, warm-up included
            checkpointer.save_final(state)
    finally:
        for s in sinks:
            s.close()
        if checkpointer is not None:
            checkpointer.close()
    acc_after = history[-1]["eval/accuracy"] if history and "eval/accuracy" in history[-1] else accuracy(state.actor, state)
    wall = time.perf_counter() - t_start
    summary = {
        "task": task_name,
        "algo": opts.algo,  # the recipe of this run's steps; "algos" says which trained the earlier ones
        "algos": _algos_summary(algos, state.step),
        "seed": state.seed,  # a resumed run goes on with its checkpoint's seed, whatever --seed says
        "steps": state.step,
        "accuracy_before_rl": acc_before,
        "accuracy_after_rl": acc_after,
        "accuracy_gain": acc_after - acc_before,
        "reward_first": history[0]["reward/mean"] if history else None,
        "reward_last": history[-1]["reward/mean"] if history else None,
        "wall_s": wall,
        "device": str(device),
        "processes": int(os.environ.get("WORLD_SIZE", "1")),
    }
    if resume_from is not None:
        summary["resumed_from"] = str(resume_from)
    if checkpointer is not None and checkpointer.last_save_seconds is not None:
        summary["checkpoint_save_s"] = checkpointer.last_save_seconds
        summary["checkpoint_bytes"] = checkpointer.last_save_bytes
    known_before = math.isfinite(acc_before)
    rows = [("held-out accuracy after warm-up", f"{acc_before:.3f}" if known_before else "unknown (not in the checkpoint)"),
            ("held-out accuracy after RL", f"{acc_after:.3f}"),
            ("gain (points)", f"{100 * (acc_after - acc_before):+.1f}" if known_before else "unknown"), ("RL steps", str(state.step)),
            ("wall time", f"{wall:.1f} s")]
    if len(summary["algos"]) > 1:
        rows.insert(3, ("algorithms", ", ".join(f"{a['algo'] or 'unknown'} (steps {a['steps'][0]}-{a['steps'][1]})"
                                                for a in summary["algos"])))
    console.print(summary_table(f"rlkit run {task_name} --algo {opts.algo} (seed {state.seed})", rows))
    if opts.out:
        full = None
        if distributed:
            from rlkit.parallel import full_state_dict

            # collective: every rank takes part, rank 0 receives the unsharded weights
            full = {k[len("model."):]: v for k, v in full_state_dict(state._cache["actor_module"]).items()}
        if rank == 0:
            state.actor.save_pretrained(os.path.join(opts.out, "model"), state_dict=full)
            tok.save_pretrained(os.path.join(opts.out, "model"))
            with open(os.path.join(opts.out, "summary.json"), "w") as f:
                json.dump(json_ready(summary), f, indent=2, allow_nan=False)
    if distributed:
        from rlkit.parallel import shutdown

        shutdown()
    return summary
