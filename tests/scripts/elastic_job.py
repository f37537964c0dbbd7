"""A short GRPO job under `rlkit launch` that loses a worker once (tests/test_elastic.py).

Usage: rlkit launch --nproc-per-node 2 --max-restarts 1 elastic_job.py OUT STEPS KILL_AT
On the first attempt rank 1 kills itself with SIGKILL right after step KILL_AT (never if KILL_AT
is 0); the elastic agent restarts the group and the job resumes from the newest checkpoint in
OUT. Rank 0 writes OUT/done.json and the unsharded final weights to OUT/final.pt.
"""
import json
import os
import signal
import sys

import rlkit as rk
from rlkit.parallel import init_distributed, shutdown

info = init_distributed()
out, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
task = rk.tasks.arithmetic(n_train=64, n_test=8)
model = rk.models.tiny(task.tokenizer, seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
recipe = rk.recipes.get("grpo").with_(n=4, max_new_tokens=4)
state = rk.init(model, rk.optim.adamw(lr=1e-3), tokenizer=task.tokenizer, seed=0)
state = rk.Pipeline(recipe, task.reward).lower().shard(state)
checkpointer = rk.Checkpointer(os.path.join(out, "checkpoints"), every=2, save_on_sigterm=False)
state = checkpointer.resume(state, "auto")
first_step = state.step


class FaultInjector:
    all_ranks = True  # fit calls the sinks of rank 0 only, unless they ask for every rank

    def on_step(self, step, metrics):
        with open(os.path.join(out, f"steps.rank{info.rank}"), "a") as f:
            f.write(f"{attempt} {step}\n")
        if attempt == 0 and info.rank == 1 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


state, history = rk.fit(state, recipe, task.reward, task.train, steps=steps, batch_size=4,
                        sinks=[FaultInjector()], checkpointer=checkpointer)
from rlkit.parallel import full_state_dict  # noqa: E402

final = full_state_dict(state._cache["actor_module"])  # collective; rank 0 receives the tensors
if info.rank == 0:
    import torch

    torch.save(final, os.path.join(out, "final.pt"))
    with open(os.path.join(out, "done.json"), "w") as f:
        json.dump({"step": state.step, "attempt": attempt, "resumed_at": first_step}, f)
checkpointer.close()
shutdown()
