"""Rotation (protocol.rotation_victims): a kill in the middle of a delete never leaves a resume point that is not
whole, and the only full checkpoint is never deleted under save_only_model. Crafted directories, real SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import ckpt_factory
from jit_helpers import (
    ckpt_check,
)

from slurm_jit.checkpoint import protocol
from slurm_jit.train import save_path

KILL_MID_DELETE = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from slurm_jit.checkpoint import protocol

    real_unlink = os.unlink

    def unlink_then_die(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        if os.fspath(path).endswith(protocol.MANIFEST_NAME):  # the manifest gone, the data still there
            os.kill(os.getpid(), signal.SIGKILL)

    os.unlink = unlink_then_die
    protocol.delete_checkpoint(Path(sys.argv[1]))
""")


def test_kill_during_rotation_never_leaves_a_resume_point(tmp_path: Path) -> None:
    # Rotation deleted checkpoint-2 in place. SIGKILL after its manifest was removed left the rest: `unverified`
    # and whole, and the removal had just set its directory mtime, so it was the newest: resume picked it over
    # checkpoint-4, the one just written.
    old = ckpt_factory.checkpoint(tmp_path, 2, world=1)
    new = ckpt_factory.checkpoint(tmp_path, 4, world=1)
    child = subprocess.run([sys.executable, "-c", KILL_MID_DELETE, str(old)], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == -signal.SIGKILL, child.stderr
    resolution = protocol.find_resumable(tmp_path)
    assert resolution.checkpoint is not None and resolution.checkpoint.path == new, resolution
    check = ckpt_check(tmp_path)
    assert check.stdout.splitlines()[-1] == str(new), check.stdout
    assert not old.exists()
    leftovers = list(tmp_path.glob(f"{protocol.DELETING_PREFIX}*"))
    assert len(leftovers) == 1
    protocol.remove_deletion_leftovers(tmp_path)  # the next rotation finishes the deletion
    assert not list(tmp_path.glob(f"{protocol.DELETING_PREFIX}*"))
    assert json.loads((new / protocol.MANIFEST_NAME).read_text())["step"] == 4


def test_rotation_never_deletes_the_only_full_checkpoint_under_save_only_model(tmp_path: Path) -> None:
    # save_only_model, save_total_limit=1: resumed from the JIT checkpoint-6 (the only full one), this run wrote
    # the model-only checkpoint-8. Model-only counted as resumable, so rotation deleted checkpoint-6: after a
    # SIGKILL nothing was left to resume from.
    full = ckpt_factory.checkpoint(tmp_path, 6, created=1_700_000_000.0, contents="full")
    model_only = ckpt_factory.checkpoint(tmp_path, 8, created=1_700_000_100.0, model_only=True,
                                         contents="model_only")
    checkpoints, _ = protocol.scan(tmp_path)
    assert protocol.rotation_victims(checkpoints, 1, keep=[model_only]) == []
    assert protocol.find_resumable(tmp_path).checkpoint.path == full  # type: ignore[union-attr]


def test_a_background_rotation_keeps_the_best_checkpoint_of_its_submit(tmp_path: Path) -> None:
    """An async save's rotation runs in rank 0's writer thread while training goes on: an evaluation there may
    already name as best a checkpoint not yet written. The best one when the save was submitted stays (it was
    deleted under save_total_limit=1, and a kill then left no best checkpoint at all)."""
    best = ckpt_factory.checkpoint(tmp_path, 2, created=1_700_000_000.0)
    ckpt_factory.checkpoint(tmp_path, 4, created=1_700_000_100.0)
    written = ckpt_factory.checkpoint(tmp_path, 6, created=1_700_000_200.0)
    trainer = SimpleNamespace(args=SimpleNamespace(save_total_limit=1),
                              state=SimpleNamespace(best_model_checkpoint=str(tmp_path / "checkpoint-8")))
    session = SimpleNamespace(trainer=trainer, run=None)
    save_path.rotate_checkpoints_safely(session, tmp_path, just_written=written, best_before=str(best))
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-6"]
