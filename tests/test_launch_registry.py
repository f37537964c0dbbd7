"""rk.launch and names registered in the launching process.

The workers import rlkit afresh: an advantage estimator registered in a notebook cell used to be
unknown there ("unknown advantage estimator 'nb_median'", after the first rollout)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from rlkit.algos.registry import Registry, restore_registrations, user_registrations

# Run with ``python -c``, as a notebook kernel runs a cell: __main__ has no file, so the spawned
# workers cannot import it and know only what travels with the payload. The registrations sit at
# the top level, where a notebook has them.
NOTEBOOK = textwrap.dedent(
    '''
    import json, sys, threading, warnings
    import torch
    import rlkit as rk
    from rlkit.launch import launch

    def nb_median(token_rewards, response_mask, group, **_):
        scores = token_rewards.sum(-1)
        ids = torch.unique(group, return_inverse=True)[1]
        medians = torch.stack([scores[ids == g].median() for g in range(int(ids.max()) + 1)])
        adv = (scores - medians[ids])[:, None] * response_mask
        return adv, adv

    rk.algos.ADVANTAGE_ESTIMATORS.register("nb_median")(nb_median)
    rk.algos.KL_PENALTIES.register("nb_k1")(rk.algos.kl.k1)      # an rlkit function under a notebook name

    def nb_recipe(**fields):
        return rk.recipes.GRPO(n=2, **fields)

    rk.recipes.RECIPES["nb_recipe"] = nb_recipe

    lock = threading.Lock()

    def nb_locked(logprobs, old_logprobs, advantages, response_mask, **_):
        with lock:                                                # a lock cannot be pickled
            return (advantages * logprobs).sum(), {}

    rk.algos.POLICY_LOSSES.register("nb_locked")(nb_locked)

    def job():
        import torch.distributed as dist
        from rlkit.parallel.mesh import init_distributed

        info = init_distributed(timeout=60)
        estimator = rk.algos.ADVANTAGE_ESTIMATORS.get("nb_median")
        rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.0, 2.0], [5.0, 0.0], [1.0, 0.0]]) * (info.rank + 1)
        adv, _ = estimator(token_rewards=rewards, response_mask=torch.ones(5, 2), group=torch.tensor([0, 0, 0, 1, 1]))
        dist.all_reduce(adv)
        return {
            "world": info.world_size,
            "adv": adv[:, 0].tolist(),
            "same_object": estimator is nb_median,                # one pickle: fn's global and the entry
            "nb_k1": rk.algos.KL_PENALTIES.get("nb_k1") is rk.algos.kl.k1,
            "recipe_n": rk.recipes.get("nb_recipe").n,
            "grpo_builtin": rk.recipes.RECIPES["grpo"] is rk.recipes.GRPO,
            "locked_known": "nb_locked" in rk.algos.POLICY_LOSSES,
        }

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = launch(job, nproc_per_node=2, run_dir=sys.argv[1], echo_logs=False)
    print("RESULT " + json.dumps({"result": result, "warnings": [str(w.message) for w in caught]}), flush=True)
    '''
)


@pytest.mark.distributed
def test_names_registered_in_a_notebook_reach_the_launch_workers(tmp_path, child_env):
    proc = subprocess.run([sys.executable, "-c", NOTEBOOK, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=240, env=child_env(2), cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    result = out["result"]
    assert result["world"] == 2
    # medians 2 of (1, 3, 2) and 1 of (5, 1) (torch takes the lower middle value), on both ranks
    # (rewards x1 and x2), summed by the all-reduce: x3
    assert result["adv"] == [-3.0, 3.0, 0.0, 12.0, 0.0]
    assert result["same_object"] and result["nb_k1"] and result["grpo_builtin"]
    assert result["recipe_n"] == 2
    # the entry that cannot be pickled is skipped, named, and the launch still runs
    assert result["locked_known"] is False
    skipped = [w for w in out["warnings"] if "nb_locked" in w]
    assert len(skipped) == 1 and "policy loss 'nb_locked'" in skipped[0] and "will not know" in skipped[0], out["warnings"]


def test_user_entries_are_the_ones_registered_outside_rlkit():
    registry = Registry("test thing")
    assert registry.home == __name__

    def mine(x):
        return x

    def builtin(x):
        return -x

    # registered from an rlkit module (as rlkit.algos.advantages registers "grpo"): not a user entry
    exec("registry.register('builtin', 'alias')(builtin)", {"__name__": "rlkit.fake", "registry": registry, "builtin": builtin})
    registry.register("mine")(mine)
    registry.register(mine)  # bare: its __name__, already the same function
    assert registry.user_entries() == {"mine": mine}
    registry.register("alias", override=True)(mine)  # a built-in name replaced from user code travels too
    assert registry.user_entries() == {"alias": mine, "mine": mine}
    shipped = [entry for entry in user_registrations() if entry[1] == "test thing"]
    assert shipped == [(__name__, "test thing", "alias", mine), (__name__, "test thing", "mine", mine)]

    # a worker's fresh registry holds the built-ins only; restoring adds the caller's entries
    fresh = Registry("test thing")
    exec("fresh.register('builtin', 'alias')(builtin)", {"__name__": "rlkit.fake", "fresh": fresh, "builtin": builtin})
    del registry  # the worker has one registry of this kind in this module
    import gc

    gc.collect()
    restore_registrations(shipped)
    assert fresh.get("mine") is mine and fresh.get("alias") is mine and fresh.get("builtin") is builtin
    assert fresh.user_entries() == {"alias": mine, "mine": mine}
