"""Why did training stop? The stop record ``OUT_DIR/slurm-jit/stop.json``, written by global rank 0.

- ``running``: written when ``train()`` starts. Still there after the processes exited: they crashed or were
  killed (a failure: do not requeue blindly).
- ``jit_stop``: a stop signal arrived; the JIT checkpoint (``checkpoint``) is complete (the record is written after
  its manifest), or, for a signal before the first step, the checkpoint resumed from is still the newest. Requeue.
- ``finished``: training reached its end. Do not requeue.
- ``failed``: ``train()`` raised; ``error`` says what. When a peer rank was lost (its process ended mid-collective),
  ``lost_peer`` names it: ``{"rank", "step", "node", "how"}`` (:mod:`slurm_jit.train.lost_peers`).
- ``hung``: a rank's hang watchdog (:mod:`slurm_jit.train.watchdog`) ended it; ``ranks`` holds each hung rank's
  report (rank, node, step, phase, seconds since its last boundary, the frame its main thread waited in),
  ``unreported`` each rank without one when the record was written (``{"rank", "node"}``: its process or node
  gone, or the rank the others wait for), the stacks are in the job log. The newest complete checkpoint is the
  one to resume.

``python -m slurm_jit.stop_record OUT_DIR`` prints the state and exits 0 (finished), 10 (jit_stop: requeue),
11 (hung), 1 (running or failed: a crash) or 2 (no record, or unreadable). The launchers' requeue loop uses this.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_jit import safe_read
from slurm_jit.timing import TIMING_DIR
from slurm_jit.train import output_lock, save_errors
from slurm_jit.train.save_errors import CheckpointWriteError

STOP_RECORD_NAME = "stop.json"
STATES = ("running", "jit_stop", "finished", "failed", "hung")
EXIT_FINISHED = 0
EXIT_CRASHED = 1
EXIT_NO_RECORD = 2
EXIT_REQUEUE = 10
EXIT_HUNG = 11
EXIT_BY_STATE = {"finished": EXIT_FINISHED, "jit_stop": EXIT_REQUEUE, "running": EXIT_CRASHED,
                 "failed": EXIT_CRASHED, "hung": EXIT_HUNG}
HANG_REPORT_GLOB = "hang-rank*.json"  # one per rank whose watchdog fired, beside the stop record
PEER_LOST_GLOB = "peer-lost-rank*.json"  # one per rank that saw a peer gone (train/lost_peers.py)
FAILED_GLOB = "failed-rank*.json"  # one per rank whose train() raised its own error: a survivor quotes it
REPORT_POLL_S = 0.1  # how often a rank waiting for the others' reports looks
# Read bounds: a file others can write is never loaded beyond them. A report is a few short fields and at most an
# error cut to 2000 characters (stop_path.py); a ``hung`` record holds one ~300-byte report per hung rank, so
# 16 MiB is ~50 000 ranks' reports, beyond any run published.
REPORT_MAX_BYTES = 1024 * 1024
STOP_RECORD_MAX_BYTES = 16 * 1024 * 1024
WHY_MAX_CHARS = 200  # of the error in the command's one line
# The watchdog's thread writes ``hung`` while the main thread may be writing ``jit_stop``: both use one temporary
# file, so one write at a time (re-entrant: a caller holds it across its decision and its write)
WRITE_LOCK = threading.RLock()


PATH_FIELDS = ("checkpoint", "resumed_from")  # written absolute: a relative output_dir is relative to one cwd


def path(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / TIMING_DIR / STOP_RECORD_NAME


def hang_report_path(output_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(output_dir) / TIMING_DIR / f"hang-rank{rank}.json"


def peer_lost_report_path(output_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(output_dir) / TIMING_DIR / f"peer-lost-rank{rank}.json"


def failed_report_path(output_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(output_dir) / TIMING_DIR / f"failed-rank{rank}.json"


def write_hang_report(output_dir: str | os.PathLike[str], rank: int, report: dict[str, Any]) -> None:
    """This rank's hang report (every rank writes its own file; only rank 0 writes the stop record)."""
    write_report(hang_report_path(output_dir, rank), report)


def write_report(target: Path, report: dict[str, Any]) -> None:
    """One rank's report file (hang, peer lost), whole or not at all."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, default=str), encoding="utf-8")
    os.rename(tmp, target)


def clear_hang_reports(output_dir: str | os.PathLike[str]) -> None:
    """Rank 0, once it holds the output_dir's lock: an earlier run's hang (and peer-lost, failed) reports are not
    this run's."""
    found = [p for glob in (HANG_REPORT_GLOB, PEER_LOST_GLOB, FAILED_GLOB)
             for p in (Path(output_dir) / TIMING_DIR).glob(glob)]
    for report_path in found:
        with contextlib.suppress(OSError):  # one left behind is still read as this run's: never worse than before
            report_path.unlink(missing_ok=True)


def hang_reports(output_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every rank's hang report of this run (rank 0 removes the earlier runs' ones when it takes the lock)."""
    return reports(output_dir, HANG_REPORT_GLOB)


def reports(output_dir: str | os.PathLike[str], glob: str) -> list[dict[str, Any]]:
    """Every rank's report of one kind (``glob``), by rank; a file that is no report (not a regular file, over
    REPORT_MAX_BYTES, not JSON, nested past the recursion limit, a rank that is no plain number) is left out: its
    rank counts as one without a report."""
    found = []
    for report_path in sorted((Path(output_dir) / TIMING_DIR).glob(glob)):
        try:
            report = output_lock.read_json(report_path, REPORT_MAX_BYTES)
        except safe_read.READ_ERRORS:
            continue
        if isinstance(report, dict) and _plain_int(report.get("rank")):
            found.append(report)
    return sorted(found, key=lambda r: int(r["rank"]))


def _plain_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def wait_for_reports(output_dir: str | os.PathLike[str], glob: str, count: int, wait_s: float) -> list[dict[str, Any]]:
    """Every rank's report of one kind (``glob``), once ``count`` of them are there or ``wait_s`` has passed."""
    deadline = time.monotonic() + wait_s
    while True:
        found = reports(output_dir, glob)
        if len(found) >= count or time.monotonic() >= deadline:
            return found
        time.sleep(REPORT_POLL_S)

class StopRecordError(CheckpointWriteError, OSError):
    """The stop record could not be written (disk full, quota, read-only); one line with a HINT. The record before
    it is left as it was, no temporary file is left behind, and no checkpoint is touched. An OSError too: a failed
    train() records its failure where it can and goes on to its own error (stop_path.record_failure)."""


def write(output_dir: str | os.PathLike[str], state: str, **fields: Any) -> None:
    """Atomically replace the stop record (temporary file, fsync, rename, fsync of the directory); a refused write
    (ENOSPC, EDQUOT, EROFS) is :class:`StopRecordError`, one line."""
    if state not in STATES:
        raise ValueError(f"unknown stop state {state!r}")
    target = path(output_dir)
    try:
        with WRITE_LOCK:
            _write(target, state, fields)
    except OSError as exc:
        with contextlib.suppress(OSError):
            target.with_suffix(".tmp").unlink(missing_ok=True)
        if exc.errno not in save_errors.REFUSED_ERRNOS:
            raise
        raise StopRecordError(_refused_line(target, state, fields, exc)) from None


def _refused_line(target: Path, state: str, fields: dict[str, Any], exc: OSError) -> str:
    checkpoint = fields.get("checkpoint") if state == "jit_stop" else None
    saved = (f"the JIT checkpoint {checkpoint} is complete and untouched" if checkpoint
             else "no checkpoint is touched")
    hint = save_errors.REFUSAL_HINTS[exc.errno or 0].format(where=target.parent.parent)
    return (f"slurm_jit: stop record {target} ({state}) could not be written: {exc.strerror} "
            f"({errno.errorcode.get(exc.errno or 0, exc.errno)}); {saved}. HINT: {hint}; a requeue or resubmit "
            "resumes from the newest complete checkpoint (ckpt-check names it)")


def _write(target: Path, state: str, fields: dict[str, Any]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    for key in PATH_FIELDS:  # read later from another working directory (a requeued job, a script)
        if isinstance(fields.get(key), str):
            fields[key] = os.path.abspath(fields[key])
    record = {"state": state, "time": time.time(), "job_id": os.environ.get("SLURM_JOB_ID"),
              "restart_count": os.environ.get("SLURM_RESTART_COUNT"), **fields}
    tmp = target.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)  # created anew: a link left in its place is never written through (truncated)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(tmp, target)
    fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(output_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The stop record, or None when there is none or it is unreadable."""
    return read_or_why(output_dir)[0]


def read_or_why(output_dir: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, str | None]:
    """(the stop record, None), or (None, why there is none to read: one phrase). Read as the manifest is: a
    regular file only (a FIFO is never waited on), at most STOP_RECORD_MAX_BYTES, every error caught."""
    try:
        record = output_lock.read_json(path(output_dir), STOP_RECORD_MAX_BYTES)
    except FileNotFoundError:
        return None, "none written"
    except safe_read.READ_ERRORS as exc:
        return None, f"unreadable: {' '.join(str(exc).split())[:WHY_MAX_CHARS]}"
    if not isinstance(record, dict) or record.get("state") not in STATES:
        return None, f"not a stop record (want an object whose state is one of {', '.join(STATES)})"
    return record, None


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m slurm_jit.stop_record OUT_DIR  (exit 0 finished, 10 requeue, 11 hung, 1 crashed, "
              "2 no record)", file=sys.stderr)
        sys.exit(EXIT_NO_RECORD)
    record, why = read_or_why(args[0])
    if record is None:
        hint = "did the job reach train()?" if why == "none written" else "move it away; ckpt-check OUT_DIR " \
            "names the newest complete checkpoint to resume from"
        print(f"stop_record: no readable {path(args[0])} ({why}). HINT: {hint}", file=sys.stderr)
        sys.exit(EXIT_NO_RECORD)
    detail = record.get("checkpoint") or _lost_peer_detail(record) or record.get("error") or _hang_detail(record)
    _say(f"{record['state']} step={record.get('step')} {detail}".rstrip())
    sys.exit(EXIT_BY_STATE[record["state"]])


def _say(line: str) -> None:
    """``line`` on stdout as one line whatever it quotes: a path's byte that is not UTF-8 (a lone surrogate in
    Python) or a line break is written escaped (``\\udcff``, ``\\n``); a print() under a strict UTF-8 stdout
    would raise, exit 1, read as "crashed"."""
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in line)
    sys.stdout.buffer.write(shown.encode(sys.stdout.encoding or "utf-8", "backslashreplace") + b"\n")
    sys.stdout.flush()


def _lost_peer_detail(record: dict[str, Any]) -> str:
    """``failed`` because a peer was lost: ``peer rank R lost (node N, at step S: how)``."""
    lost = record.get("lost_peer") if record.get("state") == "failed" else None
    if not isinstance(lost, dict):
        return ""
    return (f"peer rank {lost.get('rank')} lost (node {lost.get('node')}, at step {lost.get('step')}: "
            f"{lost.get('how')})")


def _hang_detail(record: dict[str, Any]) -> str:
    """``hung``: each hung rank, its node and the frame it waited in (the stacks are in the job log)."""
    ranks = record.get("ranks") if record.get("state") == "hung" else None
    if not isinstance(ranks, list):
        return ""
    said = [f"rank {r.get('rank')} (node {r.get('node')}) {r.get('since_s')} s in '{r.get('phase')}' at "
            f"{r.get('frame')}" for r in ranks if isinstance(r, dict)]
    silent = record.get("unreported")
    said += [f"no report from rank {r.get('rank')} (node {r.get('node')})" for r in
             (silent if isinstance(silent, list) else []) if isinstance(r, dict)]
    more = f"; {len(said) - DETAIL_RANKS} more in {STOP_RECORD_NAME}" if len(said) > DETAIL_RANKS else ""
    return "hang: " + "; ".join(said[:DETAIL_RANKS]) + more + "; stacks in the job log"


DETAIL_RANKS = 8  # one line, also for 512 hung ranks: the first ones, then how many more the record holds


if __name__ == "__main__":
    main()
