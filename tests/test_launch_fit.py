"""rk.launch(plan, state, prompts, steps=..., batch_size=...): the notebook's plan on N processes.

DESIGN.md's promise: the four lines of a notebook cell become a Pipeline, a plan and
``rk.launch(plan, ...)``. Checked here: a launch on one process computes exactly what
``plan.fit`` does in the notebook (weights, AdamW moments, schedule, counters, metrics), and the
notebook goes on training the returned state as if it had never left; a launch on two processes
returns exactly the state that two workers reach by the hand-written route (a function that
builds, lowers, shards and fits), which is one process's up to the order of float sums, as are a
tensor-parallel launch and a split-placement one (training and generation on different ranks); the
caller's sinks get every step; a failing worker leaves the
caller's state untouched; wrong arguments are named before any process starts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import rlkit as rk
from rlkit.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Run with ``python -c``, as a notebook kernel runs a cell: __main__ has no file, so the reward,
# the reference function and the sink reach the workers (or stay) by value.
NOTEBOOK = textwrap.dedent(
    '''
    import json, math, sys
    import torch
    import rlkit as rk
    from rlkit.launch import WorkerError

    task = rk.tasks.arithmetic(digits=2, n_train=32, n_test=8)

    def ones(completions, **_):                       # a reward that differs within groups
        return [float(c.count("1")) for c in completions]

    def fresh():
        model = rk.models.tiny(task.tokenizer, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=2, seed=0)    # 2 kv heads: tensor-parallel over 2 ranks too
        return rk.init(model, rk.optim.adamw(lr=1e-2, warmup_steps=2), tokenizer=task.tokenizer)

    recipe = rk.recipes.get("grpo").with_(n=4, max_new_tokens=task.max_new_tokens, log_samples=4)
    plan = rk.Pipeline(recipe, reward=ones).lower()

    def tensors(state):
        names = dict(state.actor.named_parameters())
        moments = {n: {k: v.tolist() for k, v in state.optimizer.state[p].items() if torch.is_tensor(v) and v.ndim}
                   for n, p in names.items() if p in state.optimizer.state}
        return {"params": {n: p.detach().tolist() for n, p in names.items()}, "moments": moments,
                "lr": state.optimizer.param_groups[0]["lr"], "last_epoch": state.scheduler.last_epoch,
                "counters": [state.step, state.policy_version, state.data_position],
                "extras": sorted(state.extras)}

    def by_hand(steps):                               # the route of tutorials/distributed.md, section 0b
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
        from rlkit.parallel.mesh import init_distributed

        init_distributed(timeout=60)
        state = plan.pipeline.lower().shard(fresh())
        state, history = plan.pipeline.lower().fit(state, task.train, steps=steps, batch_size=4)
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        own = dict(state.actor.named_parameters())    # a tied lm_head.weight is one parameter, as in tensors()
        params = {n: p for n, p in get_model_state_dict(state.actor, options=full).items() if n in own}
        moments = get_optimizer_state_dict(state.actor, state.optimizer, options=full)
        if dist.get_rank():                           # full state dicts offloaded to the CPU are rank 0's alone
            return None
        moments = moments["state"]
        return {"params": {n: p.tolist() for n, p in params.items()},
                "moments": {n: {k: v.tolist() for k, v in m.items() if torch.is_tensor(v) and v.ndim} for n, m in moments.items()},
                "history": history}

    def plain(history):
        return [{k: v for k, v in h.items() if not k.startswith(("time/", "rollout/")) and k != "sync/seconds"}
                for h in history]

    class Keep:
        def __init__(self):
            self.rows, self.ends = [], []
        def on_step(self, step, metrics):
            self.rows.append([step, dict(metrics)])
        def on_end(self, step):                       # as fit, the launch tells the sinks the run ended
            self.ends.append(step)

    if __name__ == "__main__":
        out = {}
        # the notebook's own run: 2 steps, then a third
        a, ha = plan.fit(fresh(), task.train, steps=2, batch_size=4)
        out["local"] = tensors(a)
        a, ha3 = plan.fit(a, task.train, steps=3, batch_size=4)
        out["local3"] = tensors(a)
        out["local_history"] = plain(ha)

        # the same two steps launched on one process, the third in the notebook again
        keep = Keep()
        start = fresh()
        folder = sys.argv[1]
        b, hb = rk.launch(plan, start, task.train, steps=2, batch_size=4, nproc_per_node=1, sinks=keep, echo_logs=False,
                          checkpointer=rk.Checkpointer(folder, every=1))
        out["one"] = tensors(b)
        out["resumed"] = tensors(rk.Checkpointer(folder).resume(fresh()))   # the workers' checkpoints, read here
        try:
            start.step
            out["stale"] = None
        except rk.DonatedStateError as e:
            out["stale"] = str(e)
        out["one_history"] = plain(hb)
        out["one_sink"] = [[step, plain([m])[0]] for step, m in keep.rows]
        out["one_ends"] = keep.ends
        b, _ = plan.fit(b, task.train, steps=3, batch_size=4)
        out["one3"] = tensors(b)

        # two processes: the launched plan against the hand-written route
        two, h2 = rk.launch(plan, fresh(), task.train, steps=2, batch_size=4, nproc_per_node=2, echo_logs=False)
        out["two"] = tensors(two)
        out["two_history"] = plain(h2)
        tp, htp = rk.launch(plan, fresh(), task.train, steps=2, batch_size=4, nproc_per_node=2, echo_logs=False,
                            lower={"tp": 2})                     # one tensor-parallel generation replica over 2 ranks
        out["tp"] = tensors(tp)
        out["tp_history"] = plain(htp)
        sp, hsp = rk.launch(plan, fresh(), task.train, steps=2, batch_size=4, nproc_per_node=2, echo_logs=False,
                            lower={"placement": {"actor": 1, "rollout": 1}})   # training on rank 0, generation on rank 1
        out["split"] = tensors(sp)
        out["split_history"] = plain(hsp)
        ref = rk.launch(by_hand, 2, nproc_per_node=2, echo_logs=False)
        out["by_hand"] = {"params": ref["params"], "moments": ref["moments"], "history": plain(ref["history"])}

        # a sink that raises: the other sinks get every step, the trained state comes back on the error
        class Bad:
            def on_step(self, step, metrics):
                raise ValueError("sink broke")
        keep2 = Keep()
        try:
            rk.launch(plan, fresh(), task.train, steps=2, batch_size=4, nproc_per_node=1, sinks=[Bad(), keep2],
                      echo_logs=False)
            out["sink_error"] = None
        except RuntimeError as e:
            out["sink_error"] = str(e)
            out["sink_error_state"] = tensors(e.state)
            out["sink_error_history"] = len(e.history)
        out["sink_kept"] = [step for step, _ in keep2.rows]

        # a worker that fails: the caller's state is neither donated nor changed
        def broken(completions, **_):
            raise ValueError("the reward broke")
        kept = fresh()
        before = tensors(kept)["params"]
        keep3 = Keep()
        try:
            rk.launch(rk.Pipeline(recipe, reward=broken), kept, task.train, steps=1, batch_size=4, nproc_per_node=1,
                      echo_logs=False, sinks=keep3)
            out["error"] = None
        except WorkerError as e:
            out["error"], out["error_notes"] = str(e), "\\n".join(getattr(e, "__notes__", []))
        out["kept_same"] = tensors(kept)["params"] == before
        out["error_ends"] = keep3.ends
        print("RESULT " + json.dumps(out))
    '''
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints")
    env = dict(os.environ)
    if torch.cuda.device_count() < 2:  # NCCL needs a GPU per process: on a 1-GPU machine the 2-process runs use gloo
        env["RLKIT_DEVICE"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", NOTEBOOK, str(folder)], capture_output=True, text=True, timeout=600,
                          env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(lines[-1][len("RESULT "):])
    out["stdout"], out["stderr"] = proc.stdout, proc.stderr
    return out


def test_one_process_launch_computes_what_plan_fit_does_in_the_notebook(runs):
    assert runs["one"] == runs["local"]  # weights, AdamW moments, lr, schedule, counters, extras: bit for bit
    assert runs["one"]["counters"] == [2, 2, 2]
    assert "fit/elapsed_s" in runs["one"]["extras"] and "fit/prompts" in runs["one"]["extras"]
    assert runs["one_history"] == runs["local_history"]
    assert any(h["actor/grad_norm"] > 0 for h in runs["one_history"])  # it trained: the comparison is not of two no-ops


def test_the_notebook_goes_on_from_the_launched_state_as_if_it_never_left(runs):
    assert runs["one3"] == runs["local3"]


def test_a_checkpointer_goes_to_the_workers_and_the_notebook_resumes_from_their_checkpoints(runs):
    """A Checkpointer holds a threading.Event: pickling it for the workers failed before any started."""
    assert runs["resumed"] == runs["one"]


def test_the_handle_passed_in_names_the_launch_and_what_to_use(runs):
    assert "donated to rlkit.launch" in runs["stale"] and "rk.launch(plan, state, prompts" in runs["stale"]


def test_lower_gives_the_workers_what_exists_only_on_several_processes(runs):
    """``lower={"tp": 2}``: ``pipe.lower(tp=2)`` is an error in one process; in the workers one
    tensor-parallel replica over 2 ranks samples what one process samples and trains the same."""
    import torch

    for key in ("reward/mean", "response/len_mean"):
        assert [h[key] for h in runs["tp_history"]] == [h[key] for h in runs["local_history"]], key
    for name, ref in runs["local"]["params"].items():
        torch.testing.assert_close(torch.tensor(runs["tp"]["params"][name]), torch.tensor(ref), rtol=1e-4, atol=1e-5, msg=name)


def test_a_split_placement_launch_trains_what_one_process_trains(runs):
    """``lower={"placement": {"actor": 1, "rollout": 1}}``: the actor trains on rank 0 and rank 1
    generates with the weights sent to it after every update; the rows sampled, and so the rewards,
    are one process's, and the weights differ only by the order of float sums."""
    import torch

    for key in ("reward/mean", "reward/std", "response/len_mean"):
        assert [h[key] for h in runs["split_history"]] == [h[key] for h in runs["local_history"]], key
    for name, ref in runs["local"]["params"].items():
        torch.testing.assert_close(torch.tensor(runs["split"]["params"][name]), torch.tensor(ref), rtol=1e-4, atol=1e-5, msg=name)
    assert runs["split"]["counters"] == [2, 2, 2]
    # after the first update the weights crossed from the training rank to the generation rank (the
    # first step's rollout used the weights placed at shard time); one process shares the storage
    assert runs["split_history"][1]["sync/bytes"] > 0, runs["split_history"][1]
    assert all(h.get("sync/bytes", 0) == 0 for h in runs["local_history"])


def test_the_callers_sinks_get_every_step_as_the_workers_log_it(runs):
    assert [step for step, _ in runs["one_sink"]] == [1, 2]
    assert [{"step": step, **metrics} for step, metrics in runs["one_sink"]] == runs["one_history"]  # history rows: a ListSink's


def test_the_callers_sinks_are_told_the_run_ended_with_its_last_step(runs):
    # a notebook dashboard draws the last step then, which its `every` may skip; a failed launch
    # that logged no step ends at the state's own step
    assert runs["one_ends"] == [2]
    assert runs["error_ends"] == [0]


def test_a_launch_without_sinks_shows_a_progress_bar_not_a_line_of_metrics_per_step(runs):
    # the two-process launches pass no sinks: the caller shows a bar over the steps (stderr is a pipe
    # here, so the bar prints its plain record lines) with the latest reward, and no metric lines
    assert "rk.launch 2/2" in runs["stderr"], runs["stderr"][-3000:]
    assert "reward=" in runs["stderr"]
    assert "[rank 0]" not in runs["stdout"], runs["stdout"][-3000:]


def test_a_sink_that_raises_stops_neither_the_other_sinks_nor_the_return_of_the_trained_state(runs):
    # the sink listed after the broken one used to get no step, and the launch raised "on_metrics
    # raised ..." (a name the caller never passed) without the trained state
    assert runs["sink_kept"] == [1, 2]
    assert runs["sink_error"].startswith("rk.launch: sink ") and "ValueError: sink broke at step 1" in runs["sink_error"]
    assert runs["sink_error_state"]["params"] == runs["one"]["params"]  # the same two steps as the clean launch
    assert runs["sink_error_state"]["counters"][0] == 2 and runs["sink_error_history"] == 2


def test_two_process_launch_returns_the_state_the_hand_written_route_reaches(runs):
    ref = runs["by_hand"]
    assert runs["two"]["params"] == ref["params"]
    assert runs["two"]["moments"] == ref["moments"]
    assert runs["two_history"] == ref["history"]
    assert runs["two"]["counters"] == [2, 2, 2]


def test_two_processes_train_what_one_process_trains(runs):
    """The whole step, not only the update: the two generation replicas sample the rows one process
    samples, so the rewards are the same and the weights differ only by the order of float sums."""
    import torch

    for key in ("reward/mean", "reward/std", "response/len_mean"):
        assert [h[key] for h in runs["two_history"]] == [h[key] for h in runs["local_history"]], key
    # the sample responses logged are the global batch's, one per prompt first, as one process logs them
    for two, local in zip(runs["two_history"], runs["local_history"]):
        assert [(r["prompt"], r["response"], r["reward"]) for r in two["samples"]] == \
            [(r["prompt"], r["response"], r["reward"]) for r in local["samples"]]
        assert len({r["prompt"] for r in local["samples"]}) == 4
    for name, ref in runs["local"]["params"].items():
        torch.testing.assert_close(torch.tensor(runs["two"]["params"][name]), torch.tensor(ref), rtol=1e-4, atol=1e-5, msg=name)
    assert runs["local"]["params"] != runs["local3"]["params"]  # the runs moved the weights: not a comparison of no-ops


def test_a_failing_worker_leaves_the_callers_state_untouched(runs):
    assert runs["error"] is not None and "the reward broke" in runs["error"]
    assert "the state passed in is unchanged" in runs["error_notes"]
    assert runs["kept_same"] is True


@pytest.fixture()
def parts():
    task = rk.tasks.arithmetic(digits=2, n_train=8, n_test=4)
    model = rk.models.tiny(task.tokenizer, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                           max_position_embeddings=64)
    state = rk.init(model, tokenizer=task.tokenizer)
    plan = rk.Pipeline(rk.recipes.get("grpo").with_(n=2, max_new_tokens=task.max_new_tokens), reward=task.reward).lower()
    return task, state, plan


@pytest.mark.parametrize("call, message", [
    (lambda t, s, p, d: launch(p, nproc_per_node=2, run_dir=d), "after the plan come exactly the state and the prompts"),
    (lambda t, s, p, d: launch(p.pipeline, s, t.train, batch_size=2, run_dir=d), "it needs steps"),
    (lambda t, s, p, d: launch(p, s, t.train, steps=1, batch_size=2, epochs=3, run_dir=d), "'epochs' is not an argument of plan.fit"),
    (lambda t, s, p, d: launch(p, t.train, s, steps=1, batch_size=2, run_dir=d), "must be a TrainState"),
    (lambda t, s, p, d: launch(p, s, t.train, steps=1, batch_size=0, run_dir=d), "batch_size"),
])
def test_wrong_arguments_are_named_before_any_process_starts(parts, tmp_path, call, message):
    task, state, plan = parts
    with pytest.raises((TypeError, ValueError), match=message):
        call(task, state, plan, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert not state.is_donated


@pytest.mark.parametrize("kw, message", [
    (dict(lower=dict(tpp=2)), "'tpp' is not a keyword of Pipeline.lower"),
    (dict(lower=[("tp", 2)]), "lower must be a dict"),
    (dict(lower=dict(placement=object())), r"lower\['placement'\] must be None .* or a dict of role -> number"),
    (dict(lower=dict(placement={"actor": 1, "rollout": 2})), "places 3 process"),
    (dict(lower=dict(tp=3)), r"lower\['tp'\]=3 does not divide the 2 process"),
    (dict(batch_size=3), "batch_size=3 prompts cannot be split evenly over the 2 generation replica"),
    (dict(eval_every=1), "eval_every=1 asks for evaluation but eval_fn is None"),
])
def test_what_the_workers_would_refuse_is_named_before_they_start(parts, tmp_path, kw, message):
    task, state, plan = parts
    args = dict(steps=1, batch_size=2, nproc_per_node=2, run_dir=str(tmp_path / "run")) | kw
    with pytest.raises((TypeError, ValueError), match=message):
        launch(plan, state, task.train, **args)
    assert not (tmp_path / "run").exists()


def test_a_checkpointer_pickles_without_its_signal_state(tmp_path):
    import pickle

    ckpt = rk.Checkpointer(str(tmp_path / "c"), every=3, keep=2)
    with ckpt.armed():
        copy = pickle.loads(pickle.dumps(ckpt))
    assert (copy.directory, copy.every, copy.keep) == (ckpt.directory, 3, 2)
    assert not copy._installed and not copy._sigterm.is_set()


def test_a_prompt_too_long_for_the_context_is_named_before_the_launch(parts, tmp_path):
    task, state, plan = parts
    with pytest.raises(ValueError, match="do not fit|context"):
        launch(plan, state, ["1" * 100], steps=1, batch_size=2, run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


ON_GPU = textwrap.dedent(
    '''
    import json
    import torch
    import rlkit as rk
    from rlkit.models.compile import is_compiled

    task = rk.tasks.arithmetic(digits=2, n_train=32, n_test=8)

    def ones(completions, **_):
        return [float(c.count("1")) for c in completions]

    def fresh():
        model = rk.models.tiny(task.tokenizer, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, seed=0)
        return rk.init(model, rk.optim.adamw(lr=1e-2), tokenizer=task.tokenizer, device="cuda", compile=True)

    plan = rk.Pipeline(rk.recipes.get("grpo").with_(n=4, max_new_tokens=task.max_new_tokens), reward=ones).lower()

    if __name__ == "__main__":
        a, ha = plan.fit(fresh(), task.train, steps=2, batch_size=4)
        start = fresh()
        b, hb = rk.launch(plan, start, task.train, steps=2, batch_size=4, nproc_per_node=1, echo_logs=False)
        pairs = list(zip(a.actor.parameters(), b.actor.parameters()))
        print("RESULT " + json.dumps({
            "device": str(b.device), "compiled": is_compiled(b.actor),
            "max_diff": max((p - q).abs().max().item() for p, q in pairs),
            "moved": max((p.detach() - q.detach()).abs().max().item() for p, q in zip(b.actor.parameters(), fresh().actor.parameters())),
            "grad_norms": [h["actor/grad_norm"] for h in hb]}))
    '''
)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_a_compiled_cuda_state_launches_on_its_gpu_and_computes_what_plan_fit_does():
    """The state's device and its compiled blocks travel: each worker maps the state onto its own
    GPU (not the caller's device index) and compiles the blocks the caller had compiled (a pickle
    brings them back eager), so one worker computes what the notebook's compiled plan.fit does."""
    proc = subprocess.run([sys.executable, "-c", ON_GPU], capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["device"].startswith("cuda") and out["compiled"]
    assert out["moved"] > 0 and any(g > 0 for g in out["grad_norms"])
    assert out["max_diff"] == 0.0, out


def test_a_worker_that_cannot_see_the_run_dir_names_the_shared_folder_it_needs(parts, tmp_path):
    """On several machines each worker reads the caller's state from run_dir: a worker on a machine
    where run_dir is another folder (its local disk) failed in torch.load with a bare "No such file";
    it now says which rank, on which machine, and that run_dir must be shared."""
    from rlkit.launch_fit import _fit_worker

    task, state, plan = parts
    missing = tmp_path / "elsewhere" / "state.pt"
    with pytest.raises(FileNotFoundError, match=r"launch: rank 0 \(on .+\) cannot see the state the caller wrote to .*state\.pt\. "
                                                r"run_dir must be a folder every machine of the launch reaches at the same path"):
        _fit_worker(plan.pipeline, {}, str(missing), task.train, 1, 2, {}, str(tmp_path / "result"), False, ())
    assert not (tmp_path / "result").exists()
