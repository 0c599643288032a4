"""Every rank checks that it can write the output directory before the first step, not only rank 0: a rank that
sees it read-only (another node's mount) refuses in one line naming it, every rank exits, nothing saved changes.

Real: 2 ranks of demo_train (DDP over gloo, no DeepSpeed), rank 1 in a mount namespace of its own where the output
directory is a read-only bind mount, as a node with a read-only mount of the shared file system sees it. ~20 s.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import ckpt_factory
import jit_helpers
import pytest

from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record, writable

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace and a bind mount need root")

# Rank 1 only: a private mount namespace, the output directory bind-mounted read-only onto itself, then demo_train.
READ_ONLY_ON_RANK_1 = textwrap.dedent("""
    import ctypes, os, runpy, subprocess, sys
    CLONE_NEWNS = 0x00020000
    if os.environ.get("RANK") == "1":
        if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNS) != 0:
            sys.exit(f"unshare: errno {ctypes.get_errno()}")
        out = sys.argv[sys.argv.index("--output-dir") + 1]
        for argv in (["mount", "--make-rprivate", "/"], ["mount", "--bind", out, out],
                     ["mount", "-o", "remount,bind,ro", out]):
            subprocess.run(argv, check=True, timeout=60)
    sys.argv = ["demo_train", *sys.argv[1:]]
    runpy.run_module("slurm_jit.demo_train", run_name="__main__", alter_sys=True)
""")


def _tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_rank_that_cannot_write_the_output_dir_stops_every_rank_before_the_first_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    ckpt = ckpt_factory.checkpoint(out, 4)
    stop_record.write(out, "jit_stop", step=4, checkpoint=str(ckpt))
    before = _tree(out)
    program = tmp_path / "read_only_on_rank_1.py"
    program.write_text(READ_ONLY_ON_RANK_1)
    result = jit_helpers.run_logged(out, ["--zero-stage", "0", "--max-steps", "3"],
                                    program=[str(program)])
    assert result.codes == [2, 2], result.log[-4000:]
    lines = [line for line in result.log.splitlines() if "cannot be written by rank 1" in line]
    assert len(lines) == 2, result.log[-4000:]  # each rank says it, one line each
    assert all("HINT:" in line and "Read-only file system (EROFS)" in line for line in lines), lines
    assert "Traceback" not in result.log and "'loss'" not in result.log, result.log[-4000:]
    assert _tree(out) == before  # the checkpoint and the stop record as they were; no probe file left
    assert protocol.inspect(ckpt, 4, deep=True).status is protocol.Status.COMPLETE
    assert not list(out.rglob(f"{writable.PROBE_PREFIX}*"))


# Rank 0 only (the saving rank, which creates output_dir at JitTrainer(...)): the parent bind-mounted read-only.
PARENT_READ_ONLY_ON_RANK_0 = (
    READ_ONLY_ON_RANK_1.replace('os.environ.get("RANK") == "1"', 'os.environ.get("RANK") == "0"')
    .replace('out = sys.argv[sys.argv.index("--output-dir") + 1]',
             'out = os.path.dirname(sys.argv[sys.argv.index("--output-dir") + 1])'))


def test_an_output_dir_the_saving_rank_cannot_create_is_one_line_on_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "out"  # does not exist yet; rank 0 sees runs/ read-only
    out.parent.mkdir()
    program = tmp_path / "parent_read_only_on_rank_0.py"
    program.write_text(PARENT_READ_ONLY_ON_RANK_0)
    result = jit_helpers.run_logged(out, ["--zero-stage", "0", "--max-steps", "3"], program=[str(program)])
    assert result.codes == [2, 2], result.log[-4000:]
    assert "Traceback" not in result.log and "'loss'" not in result.log, result.log[-4000:]
    made = [line for line in result.log.splitlines() if f"output_dir {out} cannot be created" in line]
    assert len(made) == 1 and "Read-only file system (EROFS)" in made[0] and "HINT:" in made[0], result.log[-4000:]
    reach = [line for line in result.log.splitlines() if "rank 1 could not reach the other ranks" in line]
    assert len(reach) == 1 and "HINT:" in reach[0], result.log[-4000:]
    assert not out.exists()
