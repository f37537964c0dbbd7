"""rlkit.checkpoint: round trip, atomicity under crashes, keep-last-N, SIGTERM, and clear errors."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import rlkit as rk
from rlkit import checkpoint as ck
from rlkit.state import DonatedStateError


def tiny(*args, **kwargs):
    # imported on use: the 2-process test's workers import this module and need no transformers
    from rlkit.models import tiny as build

    return build(*args, **kwargs)


def _state(char_tok, *, hidden=32, seed=0, ref=True, spec=None):
    model = tiny(char_tok, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, seed=seed)
    spec = spec or rk.optim.adamw(lr=1e-2, warmup_steps=2, total_steps=10, schedule="cosine")
    return rk.init(model, spec, tokenizer=char_tok, ref="copy" if ref else None, seed=7)


def _fake_step(state, k: int = 1):
    """``k`` AdamW steps on a made-up loss, so the optimizer and schedule have state to save."""
    for _ in range(k):
        state.optimizer.zero_grad()
        loss = sum((p.float() ** 2).sum() for p in state.actor.parameters())
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state = state.replace(step=state.step + 1, policy_version=state.policy_version + 1, data_position=state.data_position + 1)
    return state


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_optimizer(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for i in sa["state"]:
        for name, value in sa["state"][i].items():
            assert torch.equal(value, sb["state"][i][name]), (i, name)


def test_round_trip_restores_everything_bit_for_bit(tmp_path, char_tok):
    state = _fake_step(_state(char_tok), 3)
    state = state.replace(extras={**state.extras, "kl_coef": 0.123, "note": [1, "a"]})
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    rng_before = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    path = ck.save(state, tmp_path)
    assert path.name == "step_000003" and (path / ck.MARKER).is_file()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    # a different random init everywhere, and advanced global RNGs: all of it must be overwritten
    template = _state(char_tok, seed=1)
    assert not torch.equal(template.actor.model.embed_tokens.weight, state.actor.model.embed_tokens.weight)
    random.random(), np.random.rand(), torch.rand(5)
    restored = ck.load(template, path)

    assert (restored.step, restored.policy_version, restored.data_position, restored.seed) == (3, 3, 3, 7)
    assert restored.extras == {"kl_coef": 0.123, "note": [1, "a"]}
    for role in ("actor", "ref"):
        mine, theirs = _params(getattr(restored, role)), _params(getattr(state, role))
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), role
    _assert_same_optimizer(restored.optimizer, state.optimizer)
    assert restored.lr == state.lr and restored.scheduler.state_dict() == state.scheduler.state_dict()
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == rng_before
    # the template aliased the loaded weights with step 0: it is donated, not silently stale
    with pytest.raises(DonatedStateError, match="rlkit.checkpoint.load"):
        template.actor


def test_meta_records_versions_shapes_and_config_hash(tmp_path, char_tok):
    state = _state(char_tok)
    path = ck.save(state.replace(step=5), tmp_path, step=5)
    meta = json.loads((path / ck.META).read_text())
    assert meta["step"] == 5 and meta["world_size"] == 1 and meta["rlkit_version"] == rk.__version__
    actor = meta["models"]["actor"]
    assert actor["parameters"]["model.embed_tokens.weight"] == [len(char_tok), 32]
    assert actor["config_hash"] == ck.config_hash(actor["config"]) and set(meta["models"]) == {"actor", "ref"}
    manifest = json.loads((path / ck.MARKER).read_text())
    assert set(manifest["files"]) == {p.name for p in path.iterdir() if p.name != ck.MARKER}
    assert all(len(f["sha256"]) == 64 and f["bytes"] == (path / n).stat().st_size for n, f in manifest["files"].items())


def test_save_before_first_step_leaves_optimizer_untouched(tmp_path, char_tok):
    # DCP's get_state_dict initialises an empty optimizer with a zero-lr step (AdamW step=1),
    # which would change the bias correction of the run's first real step
    state = _state(char_tok, ref=False)
    path = ck.save(state, tmp_path)
    assert len(state.optimizer.state) == 0
    restored = ck.load(_fake_step(_state(char_tok, seed=1, ref=False), 2), path)
    assert len(restored.optimizer.state) == 0 and restored.step == 0
    assert restored.lr == state.lr and restored.scheduler.state_dict() == state.scheduler.state_dict()
    a, b = _fake_step(state, 2), _fake_step(restored, 2)
    assert all(torch.equal(x, y) for x, y in zip(a.actor.parameters(), b.actor.parameters()))


def test_writer_failure_keeps_previous_checkpoint(tmp_path, char_tok, monkeypatch):
    state = _fake_step(_state(char_tok, ref=False))
    good = ck.save(state, tmp_path)
    state = _fake_step(state)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "_write_marker", disk_full)
    with pytest.raises(OSError, match="No space left"):
        ck.save(state, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]
    assert ck.latest(tmp_path) == good
    assert ck.load(_state(char_tok, seed=1, ref=False), good).step == 1


def test_ctrl_c_inside_the_writer_reaches_the_caller_as_keyboardinterrupt(tmp_path, char_tok, monkeypatch):
    """DCP wraps an exception of its writer in CheckpointException (a BaseException): a Ctrl-C
    landing in its fsync reached rk.fit and `rlkit run` as that, not as KeyboardInterrupt, so the
    run printed a traceback and exited 1 instead of its one-line message and 130."""
    import torch.distributed.checkpoint.filesystem as fs

    state = _fake_step(_state(char_tok, ref=False))
    good = ck.save(state, tmp_path)
    state = _fake_step(state)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fs._FileSystemWriter, "finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ck.save(state, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]  # nothing half-written left as a checkpoint


def _linear_state(seed=0):
    torch.manual_seed(seed)
    return rk.init(torch.nn.Linear(4, 3), rk.optim.adamw(lr=1e-2), seed=7)


def test_kill9_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    # a real SIGKILL: no exception handler runs, the half-written directory stays behind
    # (a plain torch model keeps the child process light: no transformers import)
    script = textwrap.dedent(f"""
        import os, signal, torch
        import rlkit as rk
        from rlkit import checkpoint as ck
        torch.manual_seed(0)
        state = rk.init(torch.nn.Linear(4, 3), rk.optim.adamw(lr=1e-2), seed=7)
        ck.save(state.replace(step=1), {str(tmp_path)!r})
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        ck._write_marker = die  # after the tensors and meta.json are on disk, before COMPLETE
        ck.save(state.replace(step=2), {str(tmp_path)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("step_000002.tmp-")]
    assert len(leftovers) == 1 and {"__0_0.distcp", ".metadata", "meta.json"} <= {p.name for p in leftovers[0].iterdir()}
    assert ck.latest(tmp_path) == tmp_path / "step_000001"
    with pytest.raises(ck.CheckpointCorruptError, match="no COMPLETE marker: its save was interrupted"):
        ck.load(_linear_state(), leftovers[0])
    restored = ck.load(_linear_state(seed=1), ck.latest(tmp_path))
    torch.manual_seed(0)
    assert restored.step == 1 and torch.equal(restored.actor.weight, torch.nn.Linear(4, 3).weight)
    ck.Checkpointer(tmp_path, save_on_sigterm=False)  # cleans up leftovers of interrupted saves
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]


def test_keep_last_n_and_marker_less_directories(tmp_path, char_tok):
    state = _state(char_tok, ref=False)
    fake = tmp_path / "step_000099"  # looks newest but has no COMPLETE: never loaded
    fake.mkdir()
    (fake / "__0_0.distcp").write_bytes(b"partial")
    with ck.Checkpointer(tmp_path, every=2, keep=3, save_on_sigterm=False) as saver:
        assert not fake.exists()
        fake.mkdir()
        assert saver.latest() is None
        for step in range(1, 12):
            saver.maybe_save(state.replace(step=step))
        assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [6, 8, 10]
        assert saver.latest() == tmp_path / "step_000010"
        assert saver.last_save_bytes == ck.checkpoint_bytes(tmp_path / "step_000010") > 0
    # keep=None keeps all; saving the newest step again replaces it (an older one: see the timeline test)
    again = ck.save(state.replace(step=10, data_position=42), tmp_path)
    assert ck.load(_state(char_tok, ref=False), again).data_position == 42
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [6, 8, 10]


def test_sigterm_saves_at_the_next_step_boundary_then_exits(tmp_path, char_tok):
    state = _state(char_tok, ref=False).replace(step=3)
    before = signal.getsignal(signal.SIGTERM)
    saver = ck.Checkpointer(tmp_path, every=100)
    assert signal.getsignal(signal.SIGTERM) == before  # nothing installed until the loop runs
    with pytest.raises(ck.Preempted) as info:
        with saver.armed():
            assert signal.getsignal(signal.SIGTERM) == saver._on_sigterm
            assert saver.maybe_save(state) is None
            os.kill(os.getpid(), signal.SIGTERM)
            assert saver.preempted  # the handler only sets a flag: the step in flight finishes
            saver.maybe_save(state.replace(step=4))
    assert info.value.code == 143 and info.value.path.endswith("step_000004")
    assert ck.latest(tmp_path) == tmp_path / "step_000004"
    assert signal.getsignal(signal.SIGTERM) == before
    # a later loop with the same Checkpointer starts clean: the old flag does not preempt it
    with saver.armed():
        assert saver.maybe_save(state.replace(step=5)) is None
    assert signal.getsignal(signal.SIGTERM) == before


def _sigterm_after_loop(d, say):
    # the notebook cell run twice, then work after the loop: SIGTERM must terminate (was swallowed)
    ck.Checkpointer(d, every=1)
    saver = ck.Checkpointer(d, every=1)
    with saver.armed():
        pass
    say("ready")


def _sigterm_twice_in_loop(d, say):
    # inside the loop the first SIGTERM only sets the flag; the second exits at once, even with a
    # stale Checkpointer from an earlier cell around (its handler once swallowed the second one)
    ck.Checkpointer(d, every=1)
    saver = ck.Checkpointer(d, every=1)
    with saver.armed():
        say("ready")
        while not saver.preempted:
            time.sleep(0.005)
        say("flagged")
        time.sleep(20)


def _sigterm_after_last_boundary(d, say):
    # a SIGTERM after the loop's last maybe_save is not lost: on exit the previous handler gets it
    saver = ck.Checkpointer(d, every=1)
    with saver.armed():
        say("ready")
        while not saver.preempted:
            time.sleep(0.005)


@pytest.mark.parametrize("case", [_sigterm_after_loop, _sigterm_twice_in_loop, _sigterm_after_last_boundary])
def test_sigterm_handler_only_while_the_loop_runs(tmp_path, case):
    # a forked copy of this process (no torch work in it): a SIGTERM must kill it, as by default
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 1
        try:
            os.close(r)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            case(tmp_path, lambda msg: os.write(w, msg.encode() + b"\n"))
            time.sleep(20)
            code = 0  # still alive: the SIGTERM was swallowed
        finally:
            os._exit(code)
    os.close(w)
    done, status = 0, 0
    try:
        with os.fdopen(r) as pipe:
            assert pipe.readline().strip() == "ready"
            os.kill(pid, signal.SIGTERM)
            if case is _sigterm_twice_in_loop:
                assert pipe.readline().strip() == "flagged"  # the first one did not kill it
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not done and time.monotonic() < deadline:
                time.sleep(0.01)
                done, status = os.waitpid(pid, os.WNOHANG)
    finally:
        if not done:
            os.kill(pid, signal.SIGKILL)
            status = os.waitpid(pid, 0)[1]
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, f"child status {status}: SIGTERM did not terminate it"


def test_resume_auto_and_missing_checkpoints(tmp_path, char_tok):
    saver = ck.Checkpointer(tmp_path / "run" / "checkpoints", save_on_sigterm=False)
    fresh = _state(char_tok, ref=False)
    assert saver.resume(fresh, "auto") is fresh  # nothing saved yet: start fresh
    with pytest.raises(ck.CheckpointNotFoundError, match="no complete checkpoint in"):
        saver.restore(fresh)
    missing = tmp_path / "nope"
    with pytest.raises(ck.CheckpointNotFoundError, match=f"checkpoint path '{missing}' does not exist"):
        ck.load(fresh, missing)
    saver.save(_fake_step(fresh, 2))
    # a run directory, its checkpoints folder and the step folder all resolve to the checkpoint
    for where in (tmp_path / "run", tmp_path / "run" / "checkpoints", tmp_path / "run" / "checkpoints" / "step_000002"):
        assert ck.resolve(where) == tmp_path / "run" / "checkpoints" / "step_000002"
    assert saver.resume(_state(char_tok, seed=3, ref=False), "auto").step == 2


def test_checkpoint_from_another_model_names_parameter_and_shapes(tmp_path, char_tok):
    path = ck.save(_state(char_tok, hidden=32, ref=False), tmp_path)
    with pytest.raises(ck.CheckpointMismatchError) as info:
        ck.load(_state(char_tok, hidden=48, ref=False), path)
    msg = str(info.value)
    v = len(char_tok)
    assert f"parameter actor.model.embed_tokens.weight has shape ({v}, 32) in the checkpoint but ({v}, 48) in the model" in msg
    assert "hidden_size=32" in msg and "Build the model with the checkpoint's architecture" in msg
    with pytest.raises(ck.CheckpointMismatchError, match="the state has a reference model but checkpoint .* does not"):
        ck.load(_state(char_tok, ref=True), path)
    template = _state(char_tok, ref=False)
    deeper = tiny(char_tok, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ck.CheckpointMismatchError, match=r"parameter actor\.model\.layers\.1\.\S+ \(shape \(\d+(, \d+)*\)\) of the model is missing from the checkpoint"):
        ck.load(rk.init(deeper, rk.optim.adamw(lr=1e-2), tokenizer=char_tok), path)
    assert not template.is_donated  # a failed load leaves the template usable


def test_truncated_or_corrupted_checkpoint_names_file_and_previous(tmp_path, char_tok):
    state = _fake_step(_state(char_tok, ref=False))
    first = ck.save(state, tmp_path)
    second = ck.save(_fake_step(state), tmp_path)
    data = second / "__0_0.distcp"
    blob = data.read_bytes()
    data.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ck.CheckpointCorruptError) as info:
        ck.load(_state(char_tok, ref=False), second)
    msg = str(info.value)
    assert f"file __0_0.distcp has {len(blob) // 2} bytes but the manifest says {len(blob)} (truncated" in msg
    assert f"resume from the previous checkpoint instead ({first}" in msg
    # same size, one flipped byte: only the checksum can tell
    data.write_bytes(blob[:100] + bytes([blob[100] ^ 0xFF]) + blob[101:])
    with pytest.raises(ck.CheckpointCorruptError, match="file __0_0.distcp fails its sha256 checksum"):
        ck.load(_state(char_tok, ref=False), second)
    (first / ck.MARKER).write_text("{not json")
    with pytest.raises(ck.CheckpointCorruptError, match="file COMPLETE .* is corrupted .* there is no older checkpoint"):
        ck.load(_state(char_tok, ref=False), first)


def test_saving_an_older_step_sets_the_abandoned_timeline_aside(tmp_path):
    # run A saves steps 2, 4, 6; run B rolls back to step 2 (A diverged) and saves step 4
    run_a = ck.Checkpointer(tmp_path, every=2, keep=3, save_on_sigterm=False)
    for step in (2, 4, 6):
        run_a.save(_linear_state().replace(step=step, extras={"run": "A"}))
    run_b = ck.Checkpointer(tmp_path, every=2, keep=2, save_on_sigterm=False)
    b2 = run_b.restore(_linear_state(seed=1), tmp_path / "step_000002")
    with pytest.warns(RuntimeWarning, match=r"later steps \(step_000004, step_000006\).* moved to .*abandoned"):
        run_b.save(b2.replace(step=4, extras={"run": "B"}))
    # pruning (keep=2) and "auto" see run B's timeline only; nothing of run A was deleted
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 4]
    assert sorted(p.name for p in (tmp_path / "abandoned").iterdir()) == ["step_000004", "step_000006"]
    resumed = ck.Checkpointer(tmp_path, keep=2, save_on_sigterm=False).resume(_linear_state(seed=2), "auto")
    assert (resumed.step, resumed.extras) == (4, {"run": "B"})
    assert ck.load(_linear_state(seed=2), tmp_path / "abandoned" / "step_000006").extras == {"run": "A"}
    # a second rollback (to step 2, then saving step 3) keeps both abandoned step-4 checkpoints
    with pytest.warns(RuntimeWarning, match="step_000004-2"):
        run_b.save(_linear_state().replace(step=3, extras={"run": "C"}))
    assert sorted(p.name for p in (tmp_path / "abandoned").iterdir()) == ["step_000004", "step_000004-2", "step_000006"]
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 3]


def test_resume_auto_skips_a_corrupted_newest_checkpoint(tmp_path):
    saver = ck.Checkpointer(tmp_path, keep=None, save_on_sigterm=False)
    for step in (1, 2, 3):
        saver.save(_linear_state().replace(step=step))
    for step in (3, 2):  # the newest two: same size, one flipped byte (only the checksum tells)
        data = tmp_path / ck.step_dir_name(step) / "__0_0.distcp"
        blob = data.read_bytes()
        data.write_bytes(blob[:50] + bytes([blob[50] ^ 0xFF]) + blob[51:])
    with pytest.warns(RuntimeWarning, match=r"skipped 2 corrupted checkpoint\(s\) newer than step_000001: .*step_000003: .*sha256.*step_000002"):
        restored = saver.resume(_linear_state(seed=1), "auto")
    assert restored.step == 1 and saver.last_saved_step == 1
    torch.manual_seed(0)
    assert torch.equal(restored.actor.weight, torch.nn.Linear(4, 3).weight)
    # an explicit path still fails loudly, and "auto" refuses to start over when none verifies
    with pytest.raises(ck.CheckpointCorruptError, match="step_000003 is corrupted"):
        saver.resume(_linear_state(), tmp_path / "step_000003")
    (tmp_path / "step_000001" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(ck.CheckpointCorruptError, match="none of the 3 checkpoint"):
        saver.resume(_linear_state(), "auto")


def test_arguments_are_checked_with_errors_that_name_them(tmp_path):
    for bad in ("5", 2.5, None, -1, True):
        with pytest.raises(ValueError, match=r"every must be an int >= 0 .*got " + re.escape(repr(bad))):
            ck.Checkpointer(tmp_path, every=bad, save_on_sigterm=False)
    for bad in ("3", 1.5, -1):
        with pytest.raises(ValueError, match=r"keep must be an int >= 0 or None .*got " + re.escape(repr(bad))):
            ck.Checkpointer(tmp_path, keep=bad, save_on_sigterm=False)
    saver = ck.Checkpointer(tmp_path / "ok", every=2, keep=None, save_on_sigterm=False)
    for bad in (True, 5, ["auto"]):
        with pytest.raises(ValueError, match=r"how must be 'auto', 'never', None or a checkpoint path .*got " + re.escape(repr(bad))):
            saver.resume(_linear_state(), bad)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=f"root '{a_file}' is a file, not a folder"):
        ck.save(_linear_state(), a_file)
    with pytest.raises(ValueError, match=f"directory '{a_file}' is a file, not a folder"):
        ck.Checkpointer(a_file, save_on_sigterm=False)
    with pytest.raises(ValueError, match=r"step must be an int >= 0 .*got 2.5"):
        ck.save(_linear_state(), tmp_path / "ok", step=2.5)
    assert a_file.read_text() == "x" and not list((tmp_path / "ok").iterdir())


class _Toy(torch.nn.Module):
    """Two blocks in a ``layers`` list (FSDP2 units) and a head; odd sizes shard unevenly."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(5, 7), torch.nn.Linear(7, 5)])
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _toy_state(seed, shard=False):
    torch.manual_seed(seed)
    model = _Toy()
    if shard:  # before the optimizer is built: it must hold the sharded parameters
        from rlkit.parallel.fsdp import shard_model

        shard_model(model)
    return rk.init(model, rk.optim.adamw(lr=1e-2, warmup_steps=1, total_steps=8, schedule="linear"), seed=7)


def _full(state):
    params = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.actor.state_dict().items()}
    moments = {name: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.optimizer.state[p].items()}
               for name, p in state.actor.named_parameters()}
    return params, moments


def _save_on_two_ranks(directory, saved_on_one):
    """Worker: FSDP2-shard the toy model over 2 ranks, take 2 steps on rank-specific data, save;
    then load ``saved_on_one`` (a 1-process checkpoint) into a fresh sharded state."""
    import torch.distributed as dist

    from rlkit.parallel.mesh import init_distributed, shutdown

    init_distributed()
    rank = dist.get_rank()
    state = _toy_state(seed=0, shard=True)
    model = state.actor
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1 + rank))
    for _ in range(2):
        state.optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        state.optimizer.step()
        state.scheduler.step()
    state = state.replace(step=2, policy_version=2, data_position=2, extras={"ranks": dist.get_world_size()})
    torch.manual_seed(100 + rank)  # every rank's global RNG differs: each must be saved
    rng = torch.get_rng_state()
    path = ck.save(state, directory)
    params, moments = _full(state)
    lr = state.lr
    template = _toy_state(seed=2, shard=True)
    loaded = ck.load(template, saved_on_one)
    loaded_full = (*_full(loaded), loaded.lr, loaded.step)
    shutdown()
    return str(path), params, moments, rng, lr, loaded_full


@pytest.mark.distributed
def test_saved_on_two_fsdp_ranks_loads_on_one_process_and_back(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from rlkit.parallel.local import run_local

    one = _toy_state(seed=3)
    x = torch.randn(4, 5)
    for _ in range(3):
        one.optimizer.zero_grad()
        one.actor(x).pow(2).sum().backward()
        one.optimizer.step()
        one.scheduler.step()
    one = one.replace(step=3)
    saved_on_one = ck.save(one, tmp_path / "one")
    results = run_local(_save_on_two_ranks, 2, str(tmp_path / "two"), str(saved_on_one), timeout=180)
    path, params, moments, rng, lr, _ = results[0]
    assert results[1][0] == path
    # 1 process -> 2 FSDP ranks: every rank holds exactly the saved values (gathered here)
    want_params, want_moments = _full(one)
    for rank, result in enumerate(results):
        got_params, got_moments, got_lr, got_step = result[-1]
        assert got_step == 3 and got_lr == one.lr, rank
        assert all(torch.equal(got_params[k], want_params[k]) for k in want_params), rank
        assert all(torch.equal(got_moments[n][k], want_moments[n][k]) for n in want_moments for k in want_moments[n]), rank
    meta = json.loads((tmp_path / "two" / "step_000002" / ck.META).read_text())
    assert meta["world_size"] == 2 and meta["models"]["actor"]["parameters"]["layers.0.weight"] == [7, 5]
    keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    assert {"rng.rank0", "rng.rank1", "trainer"} <= keys

    template = _toy_state(seed=1)
    assert not torch.equal(template.actor.head.weight, params["head.weight"])
    restored = ck.load(template, path)  # 1 process, no process group
    assert (restored.step, restored.policy_version, restored.data_position, restored.extras) == (2, 2, 2, {"ranks": 2})
    for k, v in restored.actor.state_dict().items():
        assert torch.equal(v, params[k]), k  # resharding only moves bytes: exact
    for name, p in restored.actor.named_parameters():
        for k, v in restored.optimizer.state[p].items():
            assert torch.equal(v, moments[name][k]), (name, k)
    assert restored.lr == lr
    assert torch.equal(torch.get_rng_state(), rng)  # this process is rank 0: it gets rank 0's RNG
