"""Row 2: the output directory on a tmpfs with room for one checkpoint; the second save fills it.

Training must stop with one clear error line (with a HINT), the sentinel of the failed checkpoint stays, and the
previous checkpoint stays complete, resumable, and not rotated away (``save_total_limit=1``). The full run also
copies the output directory to a disk with room and resumes it: its losses equal the uninterrupted run's.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from slurm_jit.checkpoint import protocol
from slurm_jit.faults import common

ARGS = ["--zero-stage", "2", "--max-steps", "8", "--save-steps", "2", "--save-total-limit", "1", "--kill-wait", "0"]
ROOM_FOR_CHECKPOINTS = 1.5  # the tmpfs holds the first checkpoint and half of the second
LOG_ROOM_BYTES = 256 * 1024  # timing logs, the stop record, the loss log


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _judge(out: Path, codes: list[int | None], log: str, tally: common.Tally) -> None:
    error_lines = [line for line in log.splitlines() if "could not be written" in line and "HINT:" in line]
    tally.check(codes[0] not in (0, None), f"rank 0 exited {codes[0]} on a full disk")
    tally.check(bool(error_lines), f"no one-line error with a HINT: {log[-400:]}")
    tally.check((out / "checkpoint-4" / protocol.SENTINEL_NAME).exists(), "the failed checkpoint lost its sentinel")
    check = common.ckpt_check(out, "--deep")
    statuses = common.statuses(check)
    if statuses.get(4) in ("complete", "unverified"):
        tally.false_complete += 1
    if statuses.get(2) != "complete" or not str(check.get("resume_from")).endswith("checkpoint-2"):
        tally.lost_steps += 2
        tally.fail(f"previous checkpoint not the resume point: {statuses}, resume {check.get('resume_from')}")


def run_row(root: Path, quick: bool) -> common.Row:
    t0 = time.monotonic()
    tally = common.Tally()
    reference = common.fresh(root / "disk-full-reference")
    codes, log = common.run(reference, ARGS)
    if codes != [0, 0]:
        tally.fail(f"reference run exited {codes}: {log[-300:]}")
        return tally.row("disk full during a save", "", time.monotonic() - t0)
    size = int(_tree_bytes(reference / "checkpoint-8") * ROOM_FOR_CHECKPOINTS) + LOG_ROOM_BYTES  # the one kept
    mount = common.fresh(root / "disk-full")
    resumed = "not resumed (quick)"
    try:
        with common.tmpfs(mount, size):
            out = mount / "out"
            codes, log = common.run(out, ARGS)
            tally.trials += 1
            _judge(out, codes, log, tally)
            line = next((x for x in log.splitlines() if "could not be written" in x), "").strip()
            if not quick:
                moved = common.fresh(root / "disk-full-resumed")
                shutil.copytree(out, moved, symlinks=True)
                codes, _ = common.run(moved, [*ARGS, "--resume"])
                why = common.compare_losses(common.losses(moved), common.losses(reference))
                tally.check(codes == [0, 0] and why is None, f"resume on a disk with room: {codes} {why}")
                resumed = "copied to a disk with room and resumed: every loss equals the uninterrupted run's"
    except common.MountError as exc:
        tally.fail(f"no tmpfs could be mounted ({exc}); run tools/faults as root")
        line = ""
    detail = (f"tmpfs of {size // 1024} KiB (1.5 checkpoints), save_total_limit=1: exit {codes}; the line: "
              f"{line[:220]!r}; checkpoint-4 keeps its sentinel, checkpoint-2 complete (--deep) and the resume "
              f"point; {resumed}")
    return tally.row("disk full during a save", detail, time.monotonic() - t0)
