"""The ``ckpt-check`` gate, run before every start of the training (at submit and in each job run).

``python -m slurm_jit.launch.gate OUT_DIR [--quarantine]`` exits 0 when a resumable checkpoint exists or there is
none at all (a fresh start), and 1 when checkpoints exist but none is resumable: resuming would silently start
over (or a plain ``Trainer`` would pick a broken one). ``--quarantine`` renames the non-resumable directories
newer than the resume point (``checkpoint-<step>.incomplete``, never deleted) and lets the run go on; never
while a live training holds the directory's ``output.lock`` (it may be writing the checkpoint right now).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from slurm_jit import held_locks
from slurm_jit.checkpoint import elastic_plan, protocol
from slurm_jit.checkpoint.ckpt_check import UsageError, parse_world_size, printable
from slurm_jit.train import output_lock, output_lock_record

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_ERROR = 2


@dataclass(frozen=True, kw_only=True)
class GateResult:
    ok: bool
    resume_point: str | None  # the checkpoint the next run resumes from; None: a fresh start
    message: str  # one line
    elastic: elastic_plan.Plan | None = None  # resuming on another world size (None: the same, or not asked)


# struct flock (fcntl(2)) for F_GETLK: l_type, l_whence, l_start, l_len, l_pid, in native layout; room for padding.
_FLOCK = struct.Struct("@hhqqi")
_FLOCK_ROOM = 64


def lock_holder(out_dir: str | os.PathLike[str]) -> str | None:
    """Who holds ``OUT_DIR/slurm-jit/output.lock`` now (a live training), or None. Asked with F_GETLK, which
    takes no lock (taking one, even for a moment, could make a starting training refuse the directory); where the
    file system cannot lock, the holder named in the file unless it is a dead process on this host."""
    path = output_lock.lock_path(out_dir)
    if held_locks.held_here(path):  # this process trains: opening (closing) the file would drop its lock
        return f"this process (pid {os.getpid()})"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        holder = output_lock_record.read_holder(fd)  # the lock file's one format
        named = holder.describe() if holder is not None else "a process that has not written its name yet"
        try:
            query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0).ljust(_FLOCK_ROOM, b"\0")
            l_type, *_ = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_GETLK, query)[:_FLOCK.size])
            return None if l_type == fcntl.F_UNLCK else named
        except OSError as exc:
            if exc.errno not in output_lock.UNSUPPORTED_ERRNOS | {errno.EBADF}:
                raise
        alive = holder is not None and not output_lock._stale(holder, output_lock.this_process())
        return named if alive else None
    finally:
        os.close(fd)


def check(out_dir: str | os.PathLike[str], quarantine: bool = False, world_size: int | None = None) -> GateResult:
    """Run the gate (for a run on ``world_size`` ranks: a checkpoint written by another number of ranks is
    resumable only where elastic_plan says so); raises OSError when ``out_dir`` cannot be read."""
    resolution = protocol.find_resumable(out_dir)
    holder = lock_holder(out_dir) if quarantine and resolution.passed_over else None
    if holder is not None:
        quarantine = False  # never rename what a live training may be writing
    # reasons may quote undecodable file names: escaped, so that printing the message can never fail
    newer = [f"checkpoint-{c.step} {c.status.value} ({printable(c.reason)})" for c in resolution.passed_over]
    in_use = (f"not quarantined: {out_dir} is in use by {holder} (it holds {output_lock.LOCK_NAME}, and may be "
              "writing them)") if holder else ""
    if resolution.checkpoint is None and resolution.checkpoints and not quarantine:
        hint = ("wait for that training to end (or scancel it), then submit again" if holder else
                f"inspect with ckpt-check {out_dir}; --quarantine renames them aside (never deletes) and starts over")
        return GateResult(ok=False, resume_point=None, message=(
            f"ckpt-check gate: no resumable checkpoint in {out_dir}, only {'; '.join(newer)}"
            f"{'; ' + in_use if in_use else ''}. HINT: {hint}"))
    point = str(resolution.checkpoint.path) if resolution.checkpoint else None
    elastic = elastic_plan.plan(point, world_size, check_batch=True) if point and world_size else None
    if elastic is not None and not elastic.resumable:
        return GateResult(ok=False, resume_point=point, message=f"ckpt-check gate: {elastic.reason}", elastic=elastic)
    if elastic is not None and elastic.action == elastic_plan.SAME:
        elastic = None
    moved = protocol.quarantine(resolution) if quarantine and resolution.passed_over else []
    parts = [f"resume from {point}" if point else "fresh start (no resumable checkpoint)"]
    if elastic is not None:
        parts.append(elastic.reason)
    if moved:
        parts.append("quarantined " + ", ".join(f"{src.name} -> {dst.name}" for src, dst in moved))
    elif newer:
        parts.append("passed over " + "; ".join(newer))
    if in_use:
        parts.append(in_use)
    return GateResult(ok=True, resume_point=point, message="ckpt-check gate: " + "; ".join(parts), elastic=elastic)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m slurm_jit.launch.gate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--quarantine", action="store_true")
    parser.add_argument("--world-size", metavar="N", help="the ranks of the run that resumes (default: not checked)")
    args = parser.parse_args(argv)
    try:
        world_size = parse_world_size(args.world_size)  # before anything is read or moved
    except UsageError as exc:
        print(f"ckpt-check gate: {exc}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    try:
        result = check(args.out_dir, args.quarantine, world_size)
    except OSError as exc:
        print(f"ckpt-check gate: cannot read {args.out_dir}: {exc.strerror or exc}. HINT: check the path and its "
              "permissions", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    print(result.message, file=sys.stdout if result.ok else sys.stderr, flush=True)
    sys.exit(EXIT_OK if result.ok else EXIT_REFUSED)


if __name__ == "__main__":
    main()
