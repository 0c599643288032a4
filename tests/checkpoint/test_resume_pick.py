"""What resume picks: never a model-only checkpoint (save_only_model), never one killed between its manifest and
the removal of its sentinel. Crafted directories (``ckpt_factory``) and child processes killed for real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import ckpt_factory
from jit_helpers import (
    ckpt_check,
)

from slurm_jit.checkpoint import protocol


def test_model_only_checkpoint_is_never_picked_for_resume(tmp_path: Path) -> None:
    # save_only_model: a periodic model-only save written after the last full one. It was `complete`, picked by
    # ckpt-check and by resume, then refused at resume: a crash loop on every requeue.
    full = ckpt_factory.checkpoint(tmp_path, 4, created=1_700_000_000.0, contents="full")
    model_only = ckpt_factory.checkpoint(tmp_path, 6, created=1_700_000_100.0, model_only=True,
                                         contents="model_only")
    resolution = protocol.find_resumable(tmp_path)
    assert resolution.checkpoint is not None and resolution.checkpoint.path == full
    assert [c.status for c in resolution.passed_over] == [protocol.Status.MODEL_ONLY]
    check = ckpt_check(tmp_path)
    assert check.returncode == 0 and check.stdout.splitlines()[-1] == str(full), check.stdout + check.stderr
    assert "model-only" in check.stdout
    # --quarantine sets aside what is broken; a model-only checkpoint is whole: it stays
    assert ckpt_check(tmp_path, "--quarantine").returncode == 0
    assert model_only.is_dir()


KILL_BEFORE_SENTINEL_REMOVAL = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from slurm_jit.checkpoint import protocol

    def die(path, *args, **kwargs):  # the manifest is renamed into place; the sentinel not yet removed
        os.kill(os.getpid(), signal.SIGKILL)

    ckpt = Path(sys.argv[1])
    protocol.write_sentinel(ckpt, 6, "jit")
    (ckpt / "trainer_state.json").write_text('{"global_step": 6}')
    os.remove = die
    protocol.write_manifest(ckpt, step=6, kind="jit", world_size=1, zero_stage=None, deepspeed_tag=None,
                            files=protocol.file_entries(ckpt, protocol.payload_files(ckpt)))
""")


def test_kill_between_manifest_and_sentinel_removal_is_incomplete(tmp_path: Path) -> None:
    # Held: the sentinel is read first, so a manifest already in place does not make the checkpoint complete.
    older = ckpt_factory.checkpoint(tmp_path, 4)
    child = subprocess.run([sys.executable, "-c", KILL_BEFORE_SENTINEL_REMOVAL, str(tmp_path / "checkpoint-6")],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert (tmp_path / "checkpoint-6" / protocol.MANIFEST_NAME).is_file()
    resolution = protocol.find_resumable(tmp_path)
    assert resolution.checkpoint is not None and resolution.checkpoint.path == older
    assert [c.status for c in resolution.passed_over] == [protocol.Status.INCOMPLETE]
