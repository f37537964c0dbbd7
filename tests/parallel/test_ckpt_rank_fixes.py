"""A Checkpointer on ranks that disagree, and a bf16 checkpoint's master weights on FSDP.

- ``resume("auto")`` decided from each rank's own listing whether to enter the collective verify
  and load: ranks that saw different checkpoint folders (each node's local disk), or a resume on
  rank 0 only, ran mismatched collectives (rank 0 called a valid checkpoint corrupt, rank 1 failed
  with an AttributeError). Now the ranks agree on the list first and raise RanksDisagreeError;
- building a Checkpointer ran a barrier: built on rank 0 only it hung until the collective timeout;
- an ``every`` or a folder that differs per rank hung, or failed with ``FileNotFoundError ...
  .distcp`` leaving ``*.tmp-*`` folders: both are named before the first step;
- save on rank 0 only fails after the process group's timeout with a CheckpointError saying why,
  and warns within seconds which rank it is waiting for;
- a bf16 checkpoint's float32 master copies, loaded where the optimizer keeps none (FSDP), were
  dropped silently: now a RuntimeWarning says so.

One 2-process job (gloo, CPU, a short collective timeout) runs every scenario in turn.
"""
from __future__ import annotations

import os

import pytest

from _workers import disagreement, join, tiny_recipe, tiny_state, tiny_task

pytestmark = pytest.mark.distributed

TIMEOUT = 30  # seconds for a collective (a scenario that hangs fails instead)


def _job(base: str, bf16_dir: str) -> dict:
    """Every scenario on each of 2 ranks: ``{name: None or a result, or "Type: message"}``."""
    import time
    import warnings

    import rlkit as rk
    import rlkit.checkpoint as ckpt_mod
    from rlkit import parallel as par
    from rlkit.checkpoint import Checkpointer

    rank, out, attempt = join("gloo", timeout=TIMEOUT)
    warnings.simplefilter("ignore")

    task = tiny_task()
    plan = rk.Pipeline(tiny_recipe(), reward=task.reward).lower()

    def lowered(dtype=None):
        return plan.shard(tiny_state(task, dtype=dtype))

    def fit(ck, steps=1):
        state, _ = plan.fit(lowered(), task.train, steps=steps, batch_size=2, checkpointer=ck)
        return state.step

    shared = os.path.join(base, "shared")

    def shared_ok():
        # the ordinary case keeps working: same folder, same settings; then resume on every rank
        step = fit(Checkpointer(shared, every=1, save_on_sigterm=False))
        again = Checkpointer(shared, save_on_sigterm=False).resume(lowered(), "auto")
        restored = Checkpointer(shared, save_on_sigterm=False).restore(lowered())
        return [step, again.step, restored.step]

    ckpt_mod.WAIT_WARN_S = 5.0  # a save or resume waiting this long for a rank warns which ranks are missing

    def waited(fn):
        """``fn()``'s "has waited" warnings (from the watching thread), recorded in ``out``."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return fn()
            finally:
                out.setdefault("waited", {})[fn.__name__] = [str(w.message) for w in caught if "has waited" in str(w.message)]

    attempt("shared_ok", lambda: waited(shared_ok))

    def listing_differs():
        # the same path, but rank 1's file system shows no checkpoint (each node's local disk)
        real = ckpt_mod.list_checkpoints
        if rank == 1:
            ckpt_mod.list_checkpoints = lambda root: []
        try:
            Checkpointer(shared, save_on_sigterm=False).resume(lowered(), "auto")
        finally:
            ckpt_mod.list_checkpoints = real

    attempt("listing_differs", listing_differs)
    attempt("resume_folder_per_rank",
            lambda: Checkpointer(shared if rank == 0 else os.path.join(base, "empty1"), save_on_sigterm=False).resume(lowered(), "auto") and None)
    attempt("every", lambda: fit(Checkpointer(os.path.join(base, "every"), every=1 if rank == 0 else 2, save_on_sigterm=False), steps=2))
    attempt("fit_folder_per_rank", lambda: fit(Checkpointer(os.path.join(base, f"rank{rank}"), every=1, save_on_sigterm=False)))
    out["left_over"] = sorted(name for d in ("every", "rank0", "rank1") if os.path.isdir(os.path.join(base, d))
                              for name in os.listdir(os.path.join(base, d)))

    def built_on_rank0_only():
        t0 = time.perf_counter()
        ck = Checkpointer(os.path.join(base, "only0"), every=1, save_on_sigterm=False) if rank == 0 else None
        built = time.perf_counter() - t0
        try:
            fit(ck)
        except Exception as e:  # noqa: BLE001
            return {"built_s": built, "error": f"{type(e).__name__}: {e}"}
        return {"built_s": built, "error": None}

    attempt("built_on_rank0_only", built_on_rank0_only)

    def bf16_masters():
        import torch

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = Checkpointer(bf16_dir, save_on_sigterm=False).resume(lowered(torch.bfloat16), "auto")
        return {"step": state.step, "optimizer": type(state.optimizer).__name__,
                "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}

    attempt("bf16_masters", bf16_masters)

    def resume_on_rank0_only():
        if rank == 0:
            Checkpointer(shared, save_on_sigterm=False).resume(lowered(), "auto")
        else:
            fit(None)

    attempt("resume_on_rank0_only", resume_on_rank0_only)

    def save_on_rank0_only():
        # last: rank 0 waits for the collective timeout; rank 1 stays out of collectives meanwhile
        state = lowered()
        if rank == 0:
            t0 = time.perf_counter()
            try:
                Checkpointer(os.path.join(base, "save0"), save_on_sigterm=False).save(state)
            finally:
                out["save_waited_s"] = time.perf_counter() - t0
        else:
            time.sleep(TIMEOUT + 15)

    attempt("save_on_rank0_only", lambda: waited(save_on_rank0_only))
    try:
        par.shutdown()
    except RuntimeError:  # the timed-out collective above closed the connection between the ranks
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import warnings

    import torch

    import rlkit as rk
    from rlkit.checkpoint import save
    from rlkit.parallel.local import run_local

    base = tmp_path_factory.mktemp("ckpt_ranks")
    # a one-process bf16 checkpoint with float32 master copies (MasterWeightAdamW, the bf16 default)
    task = tiny_task()
    state = tiny_state(task, dtype=torch.bfloat16)
    assert type(state.optimizer).__name__ == "MasterWeightAdamW"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state, _ = rk.fit(state, tiny_recipe(), task.reward, task.train, steps=1, batch_size=2)
    bf16_dir = base / "bf16"
    save(state, bf16_dir)
    return run_local(_job, 2, str(base), str(bf16_dir), timeout=400)


def test_the_same_shared_folder_saves_and_resumes_on_every_rank(ranks):
    for r in ranks:
        assert r["shared_ok"] == [1, 1, 1], r["shared_ok"]


def test_ranks_that_see_different_checkpoints_raise_on_every_rank(ranks):
    for r in ranks:
        message = disagreement(r, "listing_differs")
        assert "see different checkpoints" in message and "step_000001 on rank 0; none on rank 1" in message
        assert "same shared folder on every rank" in message


def test_a_resume_folder_per_rank_is_named(ranks):
    for r in ranks:
        message = disagreement(r, "resume_folder_per_rank")
        assert "checkpointer.directory" in message and "on rank 0" in message and "on rank 1" in message
        assert "same shared folder" in message


def test_every_that_differs_between_ranks_is_named_instead_of_hanging(ranks):
    for r in ranks:
        message = disagreement(r, "every")
        assert "checkpointer.every: 1 on rank 0, 2 on rank 1" in message


def test_a_fit_folder_per_rank_is_named_before_any_save(ranks):
    for r in ranks:
        message = disagreement(r, "fit_folder_per_rank")
        assert "checkpointer.directory" in message and "same shared folder" in message
    assert not [n for n in ranks[0]["left_over"] if ".tmp-" in n or n.startswith("step_")], ranks[0]["left_over"]


def test_a_checkpointer_built_on_rank_0_only_does_not_hang_and_fit_names_it(ranks):
    for r in ranks:
        result = r["built_on_rank0_only"]
        assert isinstance(result, dict), result
        assert result["built_s"] < 5, result  # no barrier waiting for the other rank
        message = result["error"]
        assert message and message.startswith("RanksDisagreeError"), message
        assert "checkpointer: True on rank 0, False on rank 1" in message
        assert "Build the Checkpointer on every rank" in message


def test_a_bf16_checkpoints_master_copies_unused_under_fsdp_warn(ranks):
    for r in ranks:
        result = r["bf16_masters"]
        assert isinstance(result, dict), result
        assert result["step"] == 1 and result["optimizer"] != "MasterWeightAdamW", result
        found = [w for w in result["warnings"] if "master copies" in w]
        assert found, result["warnings"]
        assert "float32 master copies in the checkpoint are not used" in found[0] and "bf16 weights" in found[0]


def test_resume_on_rank_0_only_is_named_on_every_rank(ranks):
    for r in ranks:
        message = disagreement(r, "resume_on_rank0_only")
        assert "the ranks are not in the same call" in message
        assert "rank 0 in Checkpointer.resume" in message and "rank 1 in fit" in message


def test_save_on_rank_0_only_fails_after_the_timeout_saying_why(ranks):
    message = ranks[0]["save_on_rank0_only"]
    assert isinstance(message, str) and message.startswith("CheckpointError"), message
    assert "on every rank" in message and "if rank == 0" in message
    assert ranks[0]["save_waited_s"] < TIMEOUT + 10
    assert ranks[1]["save_on_rank0_only"] is None


def test_a_rank_waiting_at_a_save_says_within_seconds_which_ranks_are_missing(ranks):
    """Before, nothing was said until the process group's timeout (30 minutes by default): after
    WAIT_WARN_S (5 s here) the waiting rank warns, naming the rank that never arrived and the fix;
    the ordinary saves and resumes, where every rank arrives, warn nothing."""
    (message,) = ranks[0]["waited"]["save_on_rank0_only"]
    assert message.startswith("Checkpointer.save on rank 0 has waited 5 s for rank 1, which has not reached it"), message
    assert "call them on every rank, not under `if rank == 0`" in message
    assert ranks[1]["waited"]["save_on_rank0_only"] == []
    for r in ranks:
        assert r["waited"]["shared_ok"] == [], r["waited"]
