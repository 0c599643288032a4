"""A save that the file system refuses on one rank only (its node's mount turned read-only) is one line with a HINT
on every rank: that rank names the refusal, the others say that a rank ended during the save, never a gloo
traceback; the earlier checkpoint stays the resume point.

Real: 2 ranks of demo_train (DDP over gloo: rank 1 writes its own RNG state file into every checkpoint), rank 1 in a
mount namespace of its own where the output directory is bind-mounted read-only over itself when its second save
begins. ~15 s.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import jit_helpers
import pytest

from slurm_jit.checkpoint import protocol

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace and a bind mount need root")

READ_ONLY_AT_RANK_1_SECOND_SAVE = textwrap.dedent("""
    import ctypes, os, runpy, subprocess, sys
    CLONE_NEWNS = 0x00020000
    if os.environ.get("RANK") == "1":
        if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNS) != 0:
            sys.exit(f"unshare: errno {ctypes.get_errno()}")
        out = sys.argv[sys.argv.index("--output-dir") + 1]
        subprocess.run(["mount", "--make-rprivate", "/"], check=True, timeout=60)
        import transformers
        upstream, saves = transformers.Trainer._save_checkpoint, []
        def read_only_at_second(self, model, trial):
            saves.append(self.state.global_step)
            if len(saves) == 2:  # a new read-only mount on top: the open timing log stays on the one below
                for argv in (["mount", "--bind", out, out], ["mount", "-o", "remount,bind,ro", out]):
                    subprocess.run(argv, check=True, timeout=60)
            return upstream(self, model, trial)
        transformers.Trainer._save_checkpoint = read_only_at_second
    sys.argv = ["demo_train", *sys.argv[1:]]
    runpy.run_module("slurm_jit.demo_train", run_name="__main__", alter_sys=True)
""")


def test_a_save_refused_on_one_rank_is_one_line_on_every_rank_and_the_earlier_checkpoint_resumes(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    program = tmp_path / "read_only_at_rank_1_second_save.py"
    program.write_text(READ_ONLY_AT_RANK_1_SECOND_SAVE)
    result = jit_helpers.run_logged(out, ["--zero-stage", "0", "--max-steps", "4", "--save-steps", "2"],
                                    program=[str(program)])
    assert result.codes == [1, 1], result.log[-4000:]
    assert "Traceback" not in result.log, result.log[-4000:]
    lines = [line for line in result.log.splitlines() if "checkpoint-4 could not be" in line]
    assert len(lines) == 2 and all("HINT:" in line for line in lines), result.log[-4000:]
    assert sum("Read-only file system (EROFS)" in line for line in lines) == 1, lines  # rank 1's own
    assert sum("another rank ended or stopped answering during the save" in line for line in lines) == 1, lines
    assert (out / "checkpoint-4" / protocol.SENTINEL_NAME).exists()
    resolution = protocol.find_resumable(out, deep=True)
    assert resolution.checkpoint is not None and resolution.checkpoint.path.name == "checkpoint-2", resolution
