"""Row 3: a read-only output directory at the start: one line with a HINT before any training step, on every
rank, and nothing of what is there touched.

Root ignores permission bits, so "cannot be written" is made for real with mounts root cannot write either: an
empty read-only tmpfs (a fresh start), and (full run) a read-only bind mount of a directory holding a complete
checkpoint (a resume). A permission-denied directory takes the same path (``open`` fails with EACCES).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from slurm_jit.faults import common

READ_ONLY_SIZE_BYTES = 1024 * 1024


def _judge(name: str, codes: list[int | None], log: str, tally: common.Tally) -> str:
    lines = [line for line in log.splitlines() if "cannot be written" in line and "HINT:" in line]
    tally.trials += 1
    tally.check(codes == [2, 2], f"{name}: exit {codes}, expected the refusal (2) on both ranks")
    tally.check(len(lines) >= 1, f"{name}: no one-line refusal with a HINT: {log[-300:]}")
    tally.check("'loss'" not in log, f"{name}: a training step ran before the refusal")
    tally.check("Traceback" not in log, f"{name}: a traceback")
    return lines[0].strip() if lines else ""


def run_row(root: Path, quick: bool, sample: Path, resume_args: list[str]) -> common.Row:
    t0 = time.monotonic()
    tally = common.Tally()
    line = ""
    try:
        mount = common.fresh(root / "read-only") / "out"
        with common.tmpfs(mount, READ_ONLY_SIZE_BYTES, read_only=True):
            codes, log = common.run(mount, ["--max-steps", "4"])
            line = _judge("fresh start", codes, log, tally)
        if not quick:
            source = common.fresh(root / "read-only-source") / "out"
            shutil.copytree(sample, source / sample.name, symlinks=True)
            before = common.ckpt_check(source, "--deep")
            with common.read_only_bind(source, common.fresh(root / "read-only-resume") / "out") as out:
                codes, log = common.run(out, [*resume_args, "--resume"])
                _judge("resume", codes, log, tally)
            after = common.ckpt_check(source, "--deep")
            tally.check(before["checkpoints"] == after["checkpoints"], "the checkpoint changed")
    except common.MountError as exc:
        tally.fail(f"no read-only file system could be mounted ({exc}); run tools/faults as root")
    cases = "an empty read-only tmpfs" + ("" if quick else " and a read-only bind mount holding a checkpoint")
    detail = (f"{cases} as output_dir: both ranks exit 2 before any step, the line: {line[:200]!r}")
    return tally.row("read-only output directory", detail, time.monotonic() - t0)
