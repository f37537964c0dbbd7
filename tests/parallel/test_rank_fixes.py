"""Ranks that disagree, a state dict load that wrote into its argument, and rk.launch's signals and blame.

- settings or a model that differ on one rank (batch_size, steps, lr, the model's seed) raise a
  RanksDisagreeError naming them on every rank, instead of training silently or hanging;
- ``load_full_state_dict(model, sd)`` leaves ``sd`` as it was (rank 0's full tensors became
  DTensor shards);
- under rk.launch a SIGTERM to the whole process group, and a SIGINT (Ctrl-C), reach the workers
  once, through the launcher, and a Checkpointer in them saves the step reached every time;
- a rank killed by a signal (the OOM killer's SIGKILL) is named as the cause, not the rank whose
  collective lost it.

One 2-process job (gloo, CPU) runs every agreement scenario; one launcher process runs every launch.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from _workers import disagreement, join, tiny_model, tiny_recipe, tiny_state, tiny_task

pytestmark = pytest.mark.distributed


def _agreement_job() -> dict:
    """Every scenario on each of 2 ranks: ``{name: None (no error) or "Type: message"}``."""
    from types import SimpleNamespace

    import torch

    import rlkit as rk
    from rlkit import parallel as par

    rank, out, attempt = join(timeout=60)

    def settings(**kw):
        from rlkit.parallel import check_ranks_agree

        check_ranks_agree(kw, "fit")

    attempt("same_settings", lambda: settings(batch_size=4, steps=2, lr=1e-2, recipe="GRPO(n=2)"))
    attempt("batch_size", lambda: settings(batch_size=4 if rank == 0 else 6, steps=2, lr=1e-2))
    attempt("steps", lambda: settings(batch_size=4, steps=2 if rank == 0 else 3, lr=1e-2))

    task = tiny_task()
    recipe = tiny_recipe()

    def lowered(seed=0, lr=1e-2):
        state = tiny_state(task, seed, lr=lr)
        plan = rk.Pipeline(recipe, reward=task.reward).lower()
        return plan, plan.shard(state)

    def fit_check(lr=1e-2, batch_size=4, steps=2):
        from rlkit.parallel.agree import check_fit_agrees

        plan, state = lowered(lr=lr)
        # what Plan.fit hands rk.fit: a namespace holding the recipe's bound step
        check_fit_agrees(state, SimpleNamespace(step=plan.pipeline._fn()), task.train, steps=steps, batch_size=batch_size)

    attempt("fit_same", fit_check)
    attempt("fit_lr", lambda: fit_check(lr=1e-2 if rank == 0 else 1.0))
    attempt("fit_batch_size", lambda: fit_check(batch_size=4 if rank == 0 else 6))
    attempt("fit_steps", lambda: fit_check(steps=2 if rank == 0 else 3))
    attempt("shard_seed", lambda: lowered(seed=rank) and None)
    attempt("shard_same_seed", lambda: lowered(seed=3) and None)

    def load_keeps_sd():
        from rlkit.models.logprobs import LogprobModule

        m = par.shard_model(LogprobModule(tiny_model(task)), par.device_mesh(), gradient_reduction="sum")
        sd = par.full_state_dict(m)  # full CPU tensors on rank 0, {} elsewhere
        before = {k: (v, tuple(v.shape), v.clone()) for k, v in sd.items()}
        par.load_full_state_dict(m, sd)
        after = par.full_state_dict(m)
        return {
            "keys_same": sorted(sd) == sorted(before),
            "objects_same": all(sd[k] is before[k][0] for k in before),
            "plain_tensors": all(type(v) is torch.Tensor for v in sd.values()),
            "shapes_same": all(tuple(sd[k].shape) == before[k][1] for k in before),
            "values_same": all(type(sd[k]) is torch.Tensor and torch.equal(sd[k], before[k][2]) for k in before),
            "loaded": all(torch.equal(after[k], before[k][2]) for k in before),
            "n": len(before),
        }

    attempt("load_full_state_dict", load_keeps_sd)
    par.shutdown()
    return out


@pytest.fixture(scope="module")
def ranks():
    from rlkit.parallel.local import run_local

    return run_local(_agreement_job, 2, timeout=150)


def test_equal_settings_and_models_pass(ranks):
    for r in ranks:
        assert r["same_settings"] is None and r["fit_same"] is None and r["shard_same_seed"] is None, r


def test_a_batch_size_that_differs_on_one_rank_is_named_on_every_rank(ranks):
    for r in ranks:
        message = disagreement(r, "batch_size")
        assert "fit:" in message and "batch_size: 4 on rank 0, 6 on rank 1" in message
        assert "steps" not in message.split(". Every rank")[0]  # only what differs
        assert "batch_size: 4 on rank 0, 6 on rank 1" in disagreement(r, "fit_batch_size")


def test_steps_that_differ_on_one_rank_raise_instead_of_hanging(ranks):
    for r in ranks:
        assert "steps: 2 on rank 0, 3 on rank 1" in disagreement(r, "steps")
        assert "steps: 2 on rank 0, 3 on rank 1" in disagreement(r, "fit_steps")


def test_an_lr_that_differs_on_one_rank_is_named(ranks):
    for r in ranks:
        message = disagreement(r, "fit_lr")
        assert "optimizer.lr: 0.01 on rank 0, 1.0 on rank 1" in message


def test_plan_shard_refuses_models_built_with_another_seed_per_rank(ranks):
    for r in ranks:
        message = disagreement(r, "shard_seed")
        assert message.startswith("RanksDisagreeError: Plan.shard: the ranks do not hold the same model")
        assert "'actor.model.embed_tokens.weight'" in message  # the first parameter, named
        assert "on rank 0" in message and "on rank 1" in message
        assert "same seed on every rank" in message and "same directory" in message


def test_load_full_state_dict_leaves_the_callers_dict_alone(ranks):
    r0 = ranks[0]["load_full_state_dict"]
    assert isinstance(r0, dict), r0
    assert r0["n"] > 0 and all(r0[k] for k in ("keys_same", "objects_same", "plain_tensors", "shapes_same", "values_same", "loaded")), r0
    assert ranks[1]["load_full_state_dict"]["n"] == 0  # {} on the other ranks, as given


def test_the_checks_are_no_ops_on_one_process(char_tok):
    from rlkit.models import tiny
    from rlkit.parallel import check_models_agree, check_ranks_agree

    assert check_ranks_agree({"batch_size": 4}, "fit") is None
    assert check_models_agree({"actor": tiny(char_tok, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                             num_key_value_heads=1)}) is None


# --------------------------------------------------------------------------------------- launch


def test_worker_error_names_the_rank_killed_by_a_signal_not_its_collateral(tmp_path):
    """Rank 1 SIGKILLed (OOM killer): rank 0's gloo "Connection closed by peer" was blamed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from rlkit.launch import _worker_error

    gloo = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in train\n    dist.all_reduce(t)\n"
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242\n")
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank0.txt").write_text(gloo)
    missing = str(tmp_path / "none.json")
    killed = ChildFailedError("train", {1: ProcessFailure(local_rank=1, pid=4321, exitcode=-9, error_file=missing)})
    e = _worker_error(str(tmp_path), killed)
    assert e.rank == 1 and sorted(e.failures) == [0, 1]
    first = str(e).splitlines()[0]
    assert first.startswith("worker rank 1 was killed by signal SIGKILL") and "[0] failed after it" in first
    assert "SIGKILL" in e.worker_traceback

    # a bare exit without a traceback (os._exit(3), a native crash) is the cause too
    exited = ChildFailedError("train", {1: ProcessFailure(local_rank=1, pid=4321, exitcode=3, error_file=missing)})
    e = _worker_error(str(tmp_path), exited)
    assert e.rank == 1 and "exited with code 3 without a Python traceback" in str(e).splitlines()[0]

    # a Python exception of the rank's own beats an earlier collective error of its peer
    (tmp_path / "errors" / "rank1.txt").write_text("Traceback (most recent call last):\n  File \"r.py\", line 1, in reward\n"
                                                   "ValueError: boom in reward on rank 1\n")
    os.utime(tmp_path / "errors" / "rank0.txt", (time.time() - 5, time.time() - 5))
    os.utime(tmp_path / "errors" / "rank1.txt", (time.time(), time.time()))
    first_seen = ChildFailedError("train", {0: ProcessFailure(local_rank=0, pid=1234, exitcode=1, error_file=missing)})
    e = _worker_error(str(tmp_path), first_seen)
    assert e.rank == 1 and "boom in reward" in e.worker_traceback


def test_a_forwarded_sigint_is_the_graceful_stop_when_fn_handles_sigterm():
    from rlkit.launch import _on_sigint

    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        _on_sigint(signal.SIGINT, None)
        assert calls == [signal.SIGTERM]
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with pytest.raises(KeyboardInterrupt):  # no SIGTERM handler: Ctrl-C as before
            _on_sigint(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGTERM, previous)


LAUNCHER = textwrap.dedent(
    '''
    import json, os, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with SIGINT ignored
    import rlkit as rk
    from rlkit.launch import Terminated, WorkerError

    def killed():
        import torch
        import torch.distributed as dist
        from rlkit.parallel import init_distributed
        torch.set_num_threads(1)
        init_distributed(timeout=60)
        for step in range(1000):
            if dist.get_rank() == 1 and step == 3:
                time.sleep(0.5)  # rank 0 waits in the collective
                os.kill(os.getpid(), signal.SIGKILL)
            t = torch.ones(1)
            dist.all_reduce(t)

    def train(ckdir):
        import torch
        from rlkit.parallel import init_distributed
        torch.set_num_threads(1)
        init_distributed(timeout=60)
        rank = int(os.environ["RANK"])
        with open(os.path.join(ckdir, f"session{rank}.json"), "w") as f:
            json.dump({"sid": os.getsid(0), "pgid": os.getpgrp()}, f)
        task = rk.tasks.arithmetic(n_train=16, n_test=4)
        model = rk.models.tiny(task.tokenizer, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1)
        state = rk.init(model, rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer)
        plan = rk.Pipeline(rk.recipes.get("grpo").with_(n=2, max_new_tokens=2), reward=task.reward).lower()
        state = plan.shard(state)
        ckpt = rk.Checkpointer(ckdir, every=100000)  # only a signal saves
        sinks = [rk.observe.JSONLSink(os.path.join(ckdir, "metrics.jsonl"))] if rank == 0 else []
        plan.fit(state, task.train, steps=100000, batch_size=2, checkpointer=ckpt, sinks=sinks)

    if __name__ == "__main__":
        base, signals = sys.argv[1], sys.argv[2].split(",")
        try:
            rk.launch(killed, nproc_per_node=2, echo_logs=False, on_metrics=lambda r, m: None)
            print("KILLED " + json.dumps(None), flush=True)
        except WorkerError as e:
            print("KILLED " + json.dumps({"rank": e.rank, "first": str(e).splitlines()[0]}), flush=True)
        for i, name in enumerate(signals):
            ckdir = os.path.join(base, f"run{i}")
            os.makedirs(ckdir)
            print("START " + json.dumps({"run": i, "ckdir": ckdir}), flush=True)
            try:
                rk.launch(train, ckdir, nproc_per_node=2, echo_logs=False, on_metrics=lambda r, m: None)
                outcome = "returned"
            except Terminated as e:
                outcome = f"Terminated {e.code}"
            except KeyboardInterrupt:
                outcome = "KeyboardInterrupt"
            print("OUTCOME " + json.dumps({"run": i, "outcome": outcome}), flush=True)
    '''
)


def _lines(stream, sink: queue.Queue) -> None:
    for line in stream:
        sink.put(line.rstrip("\n"))
    sink.put(None)


def _next(lines: queue.Queue, prefix: str, deadline: float, seen: list[str]):
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        if line is None:
            raise AssertionError(f"the launcher ended before {prefix}:\n" + "\n".join(seen[-40:]))
        seen.append(line)
        if line.startswith(prefix + " "):
            return json.loads(line[len(prefix) + 1:])


def _logged_steps(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


#: a group SIGTERM (timeout(1), kill -TERM -PGID, Jupyter's os.killpg) three times, then a group
#: SIGINT (the terminal's Ctrl-C, Jupyter's interrupt) twice: each saves the step reached
SIGNALS = ("TERM", "TERM", "TERM", "INT", "INT")


def test_group_signals_and_ctrl_c_save_the_step_reached_every_time_and_a_sigkill_is_blamed(tmp_path, child_env):
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    env = {**child_env(2), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"}
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), ",".join(SIGNALS)], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    outcomes = []
    try:
        killed = _next(lines, "KILLED", time.monotonic() + 90, seen)
        for i, name in enumerate(SIGNALS):
            start = _next(lines, "START", time.monotonic() + 60, seen)
            metrics = os.path.join(start["ckdir"], "metrics.jsonl")
            deadline = time.monotonic() + 90
            while _logged_steps(metrics) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _logged_steps(metrics) >= 2, f"run {i} logged no steps"
            t0 = time.monotonic()
            os.killpg(proc.pid, getattr(signal, "SIG" + name))  # the launcher and all in its group
            outcome = _next(lines, "OUTCOME", time.monotonic() + 60, seen)
            stopped_after = time.monotonic() - t0
            with open(metrics, encoding="utf-8") as f:
                last = json.loads(f.read().strip().splitlines()[-1])["step"]
            saved = sorted(d for d in os.listdir(start["ckdir"]) if d.startswith("step_"))
            sessions = [json.load(open(os.path.join(start["ckdir"], f"session{r}.json"))) for r in (0, 1)]
            outcomes.append({"signal": name, "outcome": outcome["outcome"], "last": last, "saved": saved,
                             "seconds": stopped_after, "sessions": sessions})
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    summary = [(o["signal"], o["outcome"], f"last step {o['last']}", o["saved"], round(o["seconds"], 1)) for o in outcomes]
    for o in outcomes:
        # a checkpoint of the step reached, every time
        assert o["saved"] == [f"step_{o['last']:06d}"], summary
        assert o["outcome"] == ("Terminated 143" if o["signal"] == "TERM" else "KeyboardInterrupt"), summary
        assert o["seconds"] < 30, summary  # stopped promptly (the next step boundary, then the save)
        # the workers are not in the launcher's session or group: group signals reach them once, forwarded
        assert all(s["sid"] != proc.pid and s["pgid"] != proc.pid for s in o["sessions"]), o
    assert len(outcomes) == len(SIGNALS)
    # the real SIGKILL of rank 1 (the OOM killer) while rank 0 waits in a collective: rank 1 is named
    assert killed is not None and killed["rank"] == 1, killed
    assert killed["first"].startswith("worker rank 1 was killed by signal SIGKILL"), killed


def test_settings_that_name_each_ranks_own_device_compare_equal():
    # each rank drives its own GPU: a recipe or engine field naming cuda:0 on rank 0 and cuda:1 on
    # rank 1 is the same setting, and the check must not call it a disagreement
    import torch

    from rlkit.parallel.agree import _plain

    class Engine:
        def __init__(self, device):
            self.device = device

        def __repr__(self):
            return f"Engine(device={self.device!r}, dtype=torch.bfloat16)"

    for rank0, rank1 in ((torch.device("cuda", 0), torch.device("cuda", 1)), (Engine("cuda:0"), Engine("cuda:1")),
                         (Engine(torch.device("cuda", 0)), Engine(torch.device("cuda", 1))),
                         ({"w": torch.ones(2, device="cpu")}, {"w": torch.zeros(2, device="cpu")})):
        assert _plain(rank0) == _plain(rank1), (rank0, rank1)
    # what does differ still does: the kind of device, a scalar's value
    assert _plain(torch.device("cuda", 0)) != _plain(torch.device("cpu"))
    assert _plain(Engine("cuda:0")) != _plain(Engine("cpu"))
    assert _plain(torch.tensor(0.1)) != _plain(torch.tensor(0.2))
