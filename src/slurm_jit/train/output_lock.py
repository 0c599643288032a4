"""One training per output directory: a lock file ``OUT_DIR/slurm-jit/output.lock`` held by global rank 0.

Two trainings writing the same ``checkpoint-<step>`` directories would overwrite each other's shards under a
manifest that lists the other's sizes. The second launch is refused before any training step, with the holder
named (Slurm job id and restart count, host, pid, since when).

How "held" is decided:

- A POSIX record lock (``fcntl.lockf``: ``F_SETLK`` on the whole file) on the open lock file, held by rank 0 for
  the whole ``train()``. The kernel drops it when the process dies (SIGKILL, OOM), so a lock left by a killed run
  is free, never stale. Not ``flock``: a flock belongs to the open file, which every forked child (a DataLoader
  worker) shares, so a worker outliving a SIGKILLed rank 0 by seconds would keep the directory locked; a POSIX
  lock belongs to the process and is not inherited. On NFS (v4, or v3 with lockd) the server arbitrates POSIX
  locks across clients; a client that died keeps its lock until the server's lease expires (NFSv4: 90 s by
  default).
- The file's content names the holder (JSON). When the lock is busy and the holder is an earlier run of the
  SAME Slurm job (same ``SLURM_JOB_ID``, another ``SLURM_RESTART_COUNT``: a requeue) on ANOTHER host, that run
  is gone (Slurm requeues only after every task of it has ended): its lock is left over from a dead node's NFS
  lease and is taken over. On THIS host a busy lock has a live holder (the kernel drops a dead one's): a rank 0
  still in its teardown, waited for up to ``EARLIER_RUN_WAIT_S``, then refused; never two writers.
- Where locking is not supported (Lustre mounted without ``-o flock`` answers ENOSYS; some FUSE file systems
  EOPNOTSUPP/ENOLCK) the content alone decides: an empty file, a holder on this host whose pid is gone, or an
  earlier run of the same job is taken over; anything else is refused with a HINT to remove the file once that
  job is known to be gone. (Lustre's ``-o localflock`` is node-local: it cannot see a holder on another node.)

A POSIX lock is dropped when its process closes ANY descriptor of the file, and it never excludes its own process:
nothing in the trainer opens the lock file but :func:`acquire`, which refuses a second holder in this process (a
second JitTrainer on the same output_dir) before opening the file.

Only global rank 0 takes the lock, so a multi-node job holds one lock; the other ranks learn the verdict from
rank 0 (the trainer broadcasts it). The lock is released when ``train()`` ends: the file is emptied (so that the
content-only fallback sees it free) and closed, never deleted (deleting a lock file races: a waiter may hold the
old inode while a third process locks a new file of the same name).

Opening the lock file is also the start-of-training check that ``output_dir`` can be written: a read-only or
permission-denied output directory is refused here, before any step, in one line with a HINT.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from slurm_jit.timing import TIMING_DIR

logger = logging.getLogger(__name__)

LOCK_NAME = "output.lock"
HOLDER_MAX_BYTES = 4096  # the holder's JSON is ~150 bytes; a bounded read of a file others can write
# lock errors that mean "someone holds it" (fcntl(2): EACCES or EAGAIN), and "this file system cannot lock"
HELD_ERRNOS = {errno.EACCES, errno.EAGAIN}
UNSUPPORTED_ERRNOS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
# Lock files held by THIS process, by (st_dev, st_ino): a POSIX lock does not exclude its own process (a second
# JitTrainer here would lock the file again), and closing any descriptor of the file drops it.
_HELD_HERE: set[tuple[int, int]] = set()
# How long a requeued run waits for an earlier run of its job still holding the lock on this host (a rank 0 still
# in its teardown, outside the job's cgroup): slurm.conf(5) KillWait, the default 30 s between SIGTERM and SIGKILL.
EARLIER_RUN_WAIT_S = 30.0
EARLIER_RUN_POLL_S = 0.2  # a retry of the non-blocking lock; blocking F_SETLKW would have no deadline


@dataclass(frozen=True, kw_only=True)
class Holder:
    """Who holds (or last held) the lock."""

    job_id: str | None  # SLURM_JOB_ID (None outside Slurm)
    restart_count: str | None  # SLURM_RESTART_COUNT: a requeued job's run number (None: the first run)
    host: str  # socket.gethostname()
    pid: int  # rank 0's process id on that host
    since: float  # when it took the lock (seconds since the epoch)

    def describe(self) -> str:
        job = f"Slurm job {self.job_id} (restart {self.restart_count or 0})" if self.job_id else "a process"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{job} on host {self.host}, pid {self.pid}, since {when}"


def this_process() -> Holder:
    return Holder(job_id=os.environ.get("SLURM_JOB_ID") or None,
                  restart_count=os.environ.get("SLURM_RESTART_COUNT") or None,
                  host=socket.gethostname(), pid=os.getpid(), since=time.time())


@dataclass
class OutputLock:
    """A lock taken by :func:`acquire`; :func:`release` it when training ends."""

    path: Path
    fd: int
    locked: bool  # False: taken over, or the file system cannot lock: the content alone says who holds it


def lock_path(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / TIMING_DIR / LOCK_NAME


def acquire(output_dir: str | os.PathLike[str]) -> tuple[OutputLock | None, str | None]:
    """(the lock, None), or (None, why not: one line with a HINT). Never raises for an OSError: rank 0's answer
    is broadcast to every rank, which would wait forever for an exception."""
    path = lock_path(output_dir)
    if _held_here(path):  # checked before opening: closing a second descriptor would drop the held lock
        return None, _refusal(path, None, in_this_process=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        return None, _not_writable(output_dir, exc)
    try:
        return _lock(path, fd)
    except OSError as exc:
        os.close(fd)
        return None, _not_writable(output_dir, exc)


def _held_here(path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) in _HELD_HERE


def _file_key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _not_writable(output_dir: str | os.PathLike[str], exc: OSError) -> str:
    why = exc.strerror or type(exc).__name__
    return (f"output_dir {os.fspath(output_dir)} cannot be written ({why}: {exc.filename or ''}); no checkpoint "
            "could be saved. HINT: point --output-dir/output_dir at a writable directory on shared storage (a "
            "read-only mount, or one owned by another user?)")


def _lock(path: Path, fd: int) -> tuple[OutputLock | None, str | None]:
    me = this_process()
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked = True
    except OSError as exc:
        if exc.errno not in HELD_ERRNOS | UNSUPPORTED_ERRNOS:
            raise
        unsupported = exc.errno in UNSUPPORTED_ERRNOS
        holder = _read_holder(fd)
        locked = not unsupported and _earlier_run_ends_here(fd, holder, me)
        if not locked and not _may_take_over(holder, me, unsupported):
            os.close(fd)
            return None, _refusal(path, holder, lock_unsupported=unsupported)
        if holder is not None and not unsupported and not locked:
            logger.warning("slurm_jit: %s is held by an earlier run of this job (%s) on another host, which "
                           "Slurm ended before this requeue: taking it over", path, holder.describe())
    _write_holder(fd, me)
    _HELD_HERE.add(_file_key(fd))
    return OutputLock(path=path, fd=fd, locked=locked), None


def _earlier_run_ends_here(fd: int, holder: Holder | None, me: Holder) -> bool:
    """A busy lock held on THIS host is held by a live process (the kernel drops a dead one's): an earlier run of
    this job still tearing down. Wait for it to end (then the lock is ours, for real), up to EARLIER_RUN_WAIT_S."""
    if holder is None or holder.host != me.host or not _earlier_run_of_this_job(holder, me):
        return False
    logger.warning("slurm_jit: the output_dir lock is still held by an earlier run of this job on this host (%s): "
                   "waiting up to %.0f s for it to end", holder.describe(), EARLIER_RUN_WAIT_S)
    deadline = time.monotonic() + EARLIER_RUN_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(EARLIER_RUN_POLL_S)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in HELD_ERRNOS:
                raise
    return False


def _may_take_over(holder: Holder | None, me: Holder, unsupported: bool) -> bool:
    """A busy lock: only an earlier run of this job's on another host (a dead node's NFS lease; on this host the
    holder is alive). No locking at all: also a free or dead holder."""
    if not unsupported:
        return holder is not None and holder.host != me.host and _earlier_run_of_this_job(holder, me)
    return holder is None or _stale(holder, me)


def _earlier_run_of_this_job(holder: Holder, me: Holder) -> bool:
    return bool(me.job_id) and holder.job_id == me.job_id and holder.restart_count != me.restart_count


def _stale(holder: Holder, me: Holder) -> bool:
    """Without locking: is the holder known to be gone?"""
    if _earlier_run_of_this_job(holder, me):
        return True
    return holder.host == me.host and not _pid_alive(holder.pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _refusal(path: Path, holder: Holder | None, lock_unsupported: bool = False,
             in_this_process: bool = False) -> str:
    who = holder.describe() if holder is not None else "another process (it has not written its name yet)"
    hint = "wait for it to end (or scancel it), or give this run another output_dir"
    if in_this_process:
        who = f"another trainer in this process (pid {os.getpid()}) whose train() has not ended"
        hint = "let the first train() end before the next, or give each trainer its own output_dir"
    if lock_unsupported:
        hint += f"; this file system cannot lock files: if that run is gone, remove {path}"
    return f"output_dir {path.parent.parent} is in use by {who}: two trainings would overwrite each other's " \
           f"checkpoints. HINT: {hint}"


def _read_holder(fd: int) -> Holder | None:
    """The holder named in the file, or None when it is empty or unreadable (a released lock, a torn write)."""
    try:
        raw = os.pread(fd, HOLDER_MAX_BYTES, 0)
        data = json.loads(raw.decode("utf-8")) if raw.strip() else None
        if not isinstance(data, dict):
            return None
        return Holder(job_id=_opt_str(data.get("job_id")), restart_count=_opt_str(data.get("restart_count")),
                      host=str(data["host"]), pid=int(data["pid"]), since=float(data["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def _write_holder(fd: int, holder: Holder) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(asdict(holder)).encode("utf-8"), 0)
    os.fsync(fd)


def release(lock: OutputLock | None) -> None:
    """Empty the file (free for the content-only fallback) and close it, which drops the lock."""
    if lock is None:
        return
    try:
        _HELD_HERE.discard(_file_key(lock.fd))
        os.ftruncate(lock.fd, 0)
    except OSError as exc:  # releasing must not mask what ended training; closing drops the lock anyway
        logger.warning("slurm_jit: could not empty %s: %s", lock.path, exc)
    finally:
        os.close(lock.fd)
