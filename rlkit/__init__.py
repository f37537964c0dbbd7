"""rlkit: reinforcement-learning post-training of language models.

A functional core — ``rollout``, ``score``, ``advantage``, ``update`` — over explicit
:class:`TrainState` and :class:`Batch` values, and a small scheduler that lowers the same
pipeline onto torch.distributed meshes.

    import rlkit as rk
    task  = rk.tasks.arithmetic(digits=2)
    state = rk.init(rk.models.tiny(task.tokenizer), rk.optim.adamw(lr=3e-4), tokenizer=task.tokenizer)
    for prompts in task.prompts(batch_size=32, steps=200):
        batch = rk.rollout(state, prompts, n=8, max_new_tokens=8)
        batch = rk.score(batch, task.reward)
        batch = rk.advantage(batch, "grpo")
        state, metrics = rk.update(state, batch, loss="ppo_clip")
"""
__version__ = "0.1.0"

from rlkit import algos, optim  # noqa: E402
from rlkit.batch import Batch, BatchError, column, make_batch, packed, set_column, validate  # noqa: E402
from rlkit.data import Prompts, PromptSet, load_prompts  # noqa: E402
from rlkit.state import DonatedStateError, TrainState, fold_in, init  # noqa: E402
from rlkit.transforms.advantage import advantage  # noqa: E402
from rlkit.transforms.forward import compute_old_logprobs, compute_ref_logprobs, compute_values  # noqa: E402
from rlkit.transforms.rollout import concat, rollout, rollout_metrics  # noqa: E402
from rlkit.transforms.score import RewardError, score  # noqa: E402
from rlkit.transforms.update import update  # noqa: E402

# a function that shares a name with its module: bind the function (importing the module first
# would otherwise leave ``rk.evaluate`` pointing at the module)
from rlkit.evaluate import evaluate  # noqa: E402

# ``rk.launch`` is the module rlkit.launch, which is callable (``rk.launch(fn, ...)`` launches) and
# holds ``WorkerError`` and ``emit`` (``rk.launch.WorkerError`` was an AttributeError while the
# package bound the function). Imported on first use, so ``python -m rlkit.launch`` runs it without
# runpy's "found in sys.modules" warning.


def __getattr__(name):
    # heavier layers load on first use, so `import rlkit` stays light
    import importlib

    lazy = {
        "models": "rlkit.models", "engines": "rlkit.engines", "tasks": "rlkit.tasks", "recipes": "rlkit.recipes",
        "rewards": "rlkit.rewards", "observe": "rlkit.observe", "parallel": "rlkit.parallel",
        "checkpoint": "rlkit.checkpoint", "sft": "rlkit.sft", "loop": "rlkit.loop", "jobs": "rlkit.jobs",
        "launch": "rlkit.launch",
    }
    if name in lazy:
        return importlib.import_module(lazy[name])
    if name in ("fit",):
        from rlkit.loop import fit

        return fit
    if name == "Checkpointer":
        from rlkit.checkpoint import Checkpointer

        return Checkpointer
    if name in ("Pipeline", "mesh"):
        from rlkit import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'rlkit' has no attribute {name!r}")


def __dir__():
    # the lazy names too: Tab completion in a notebook (jedi, IPython) lists dir(rk), which without
    # this left out rk.models, rk.tasks, rk.fit, rk.recipes, rk.Pipeline, ...
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "Batch", "BatchError", "make_batch", "validate", "packed", "column", "set_column",
    "Prompts", "PromptSet", "load_prompts",
    "TrainState", "DonatedStateError", "init", "fold_in",
    "rollout", "score", "advantage", "update", "concat", "rollout_metrics", "RewardError",
    "compute_old_logprobs", "compute_ref_logprobs", "compute_values",
    "algos", "optim", "models", "engines", "tasks", "recipes", "rewards", "observe",
    "fit", "evaluate", "launch", "Pipeline", "mesh", "Checkpointer",
]
