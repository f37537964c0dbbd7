"""A launched ``fn`` that raises leaves no process group open for interpreter exit.

The worker wrote the error records and re-raised with the gloo group (and any DeviceMesh
sub-group) still alive; tearing them down at interpreter finalization aborted a worker now and
then under CPU load ("terminate called without an active exception" / "Fatal Python error:
Aborted"), text that reached the terminal under ``rlkit run``'s one-line error (seen in
``test_cli_fixes29``'s two-process bad resume). The worker now destroys the group when ``fn``
raises, without a barrier; the error reported is still the worker's own.
"""
from __future__ import annotations

import pytest

from rlkit.launch import WorkerError, launch

pytestmark = pytest.mark.distributed


def test_a_worker_whose_fn_raises_destroys_its_process_group_before_exit(tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_DEVICE", "cpu")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    folder = str(tmp_path / "at_exit")

    def broken(folder):
        import atexit
        import os

        import torch
        import torch.distributed as dist

        from rlkit.parallel import device_mesh, init_distributed

        info = init_distributed(timeout=60)
        mesh = device_mesh()
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh.get_group())
        os.makedirs(folder, exist_ok=True)

        def note():  # what interpreter exit finds
            with open(os.path.join(folder, f"rank{info.rank}"), "w") as f:
                f.write(str(dist.is_initialized()))

        atexit.register(note)
        raise ValueError(f"rank {info.rank} broke")

    with pytest.raises(WorkerError) as err:
        launch(broken, folder, nproc_per_node=2, run_dir=str(tmp_path / "run"), echo_logs=False)
    assert "broke" in str(err.value) and "ValueError" in str(err.value)
    seen = {p.name: p.read_text() for p in (tmp_path / "at_exit").iterdir()}
    assert seen == {"rank0": "False", "rank1": "False"}, seen  # before: "True" on both
