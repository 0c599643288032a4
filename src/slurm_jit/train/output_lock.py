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
- A run that took over does not hold the kernel lock (the dead node's lease does), so its record says so
  (``kernel_lock: false``) and a daemon thread keeps trying for the lock every ``TAKEOVER_RETRY_S`` until it has
  it (then the record says ``true``) or the lock is released. Until then a newcomer may find the kernel lock free
  (the lease ended between two tries): it is refused while the record names a live holder that took over: on
  this host a live pid (with the start time recorded, so a recycled pid is not taken for it), on another host a
  Slurm job still running (``scontrol show job``; when Slurm cannot answer, refused too). A retry, not a thread
  blocked in ``lockf(F_LOCK)``: a blocked waiter cannot be woken when the lock is released, and when the lease
  ends later it would be granted a lock of this process (POSIX locks are per process) and, finding its
  descriptor closed, drop it: the lock of a later ``train()`` here. An NFS client polls for a blocked lock
  anyway. Left open: a third job whose ``lockf`` succeeds in the microseconds between a takeover's failed
  ``lockf`` and its write of the record; and a third job whose Slurm does not know the holder's job (another
  cluster on the same file system: "Invalid job id" reads as gone). When the third job's record is the one left
  in the file, the run that took over finds it at its next retry and says so, once, as an error with a HINT.
- Where locking is not supported (Lustre mounted without ``-o flock`` answers ENOSYS; some FUSE file systems
  EOPNOTSUPP/ENOLCK) the content alone decides: an empty file, a holder on this host whose pid is gone, or an
  earlier run of the same job is taken over; anything else is refused with a HINT to remove the file once that
  job is known to be gone. (Lustre's ``-o localflock`` is node-local: it cannot see a holder on another node.)

A POSIX lock is dropped when its process closes ANY descriptor of the file, and it never excludes its own process:
nothing in the trainer opens the lock file but :func:`acquire`, which refuses a second holder in this process (a
second JitTrainer on the same output_dir) before opening the file.

Only global rank 0 takes the lock, so a multi-node job holds one lock; the other ranks learn the verdict from
rank 0 (the trainer broadcasts it). The lock is released when ``train()`` ends: the file is emptied (so that the
content-only fallback sees it free; a takeover still without the kernel lock puts back the record it took over,
for the next requeue) and closed, never deleted (deleting a lock file races: a waiter may hold the
old inode while a third process locks a new file of the same name).

Opening the lock file is also the start-of-training check that ``output_dir`` can be written: a read-only or
permission-denied output directory is refused here, before any step, in one line with a HINT; so is a lock path
that is not a plain file of ours (a directory, a symbolic link, a FIFO, a hard link to another file: release
empties the file).

The record's format and checks, the lock's handle (:class:`OutputLock`) and the retry thread after a takeover are
:mod:`.output_lock_record`'s; which lock files this process holds, :mod:`slurm_jit.held_locks`'; this module decides
when the lock is taken, waited for, taken over or refused.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from slurm_jit import held_locks, safe_read, slurm
from slurm_jit.timing import TIMING_DIR
from slurm_jit.train.output_lock_record import (
    HELD_ERRNOS,
    Holder,
    OutputLock,
    process_alive,
    read_holder,
    retry_kernel_lock,
    this_process,
    try_lock,
    write_holder,
)

logger = logging.getLogger(__name__)

LOCK_NAME = "output.lock"
# lock errors that mean "this file system cannot lock" (HELD_ERRNOS: "someone holds it", output_lock_record.py)
UNSUPPORTED_ERRNOS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
# How long a requeued run waits for an earlier run of its job still holding the lock on this host (a rank 0 still
# in its teardown, outside the job's cgroup): slurm.conf(5) KillWait, the default 30 s between SIGTERM and SIGKILL.
EARLIER_RUN_WAIT_S = 30.0
EARLIER_RUN_POLL_S = 0.2  # a retry of the non-blocking lock; blocking F_SETLKW would have no deadline
# After a takeover, a retry of the kernel lock this often: the lease waited out is NFSv4's 90 s by default, and a
# try is one LOCK call to the NFS server.
TAKEOVER_RETRY_S = 1.0
RELEASE_JOIN_S = 5.0  # release() waits this long for the retry thread to end (it ends at once: woken, no lock)
# Job states in which no process of the job runs (squeue(1) JOB STATE CODES): a holder that took over, of a job in
# one of these, is gone. Any other state (COMPLETING, SUSPENDED, UNKNOWN, ...) counts as running.
JOB_ENDED_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT",
                              "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                              "DEADLINE", "OUT_OF_MEMORY", "REVOKED"})
SLURM_JOB_ID_PATTERN = re.compile(r"[0-9]{1,12}(?:[_+][0-9]{1,12})?")  # 123, an array task 123_4, het 123+0


def lock_path(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / TIMING_DIR / LOCK_NAME


def acquire(output_dir: str | os.PathLike[str]) -> tuple[OutputLock | None, str | None]:
    """(the lock, None), or (None, why not: one line with a HINT). Never raises for an OSError: rank 0's answer
    is broadcast to every rank, which would wait forever for an exception."""
    path = lock_path(output_dir)
    if held_locks.held_here(path):  # checked before opening: closing a second descriptor would drop the held lock
        return None, _refusal(path, None, in_this_process=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        odd = _odd_file(path, None)
        return None, _not_a_lock_file(path, odd) if odd else _not_writable(output_dir, exc)
    try:
        odd = _odd_file(path, fd)
        if odd:
            os.close(fd)
            return None, _not_a_lock_file(path, odd)
        return _lock(path, fd)
    except OSError as exc:
        os.close(fd)
        return None, _not_writable(output_dir, exc)


def _odd_file(path: Path, fd: int | None) -> str | None:
    """What the lock path is when it is not a plain file of ours, else None."""
    try:
        st = os.fstat(fd) if fd is not None else os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return f"a file with {st.st_nlink} hard links" if st.st_nlink > 1 else None


def _not_a_lock_file(path: Path, what: str) -> str:
    return (f"output_dir {path.parent.parent} cannot be locked: {path} is {what}, not the lock file this library "
            f"writes. HINT: remove {path} (no training of this output_dir may be running) and launch again")


def read_json(path: str | os.PathLike[str], max_bytes: int) -> Any:
    """A small JSON record under ``OUT_DIR/slurm-jit/`` (a stop record, a rank's report, a tracker's run id), read
    by :func:`slurm_jit.safe_read.load_json` (a regular file of at most ``max_bytes``, a FIFO never waited on);
    never this process's lock file through a hard link: closing any descriptor of it would drop the lock, and a
    second training could take the directory. Raises :data:`slurm_jit.safe_read.READ_ERRORS` only."""
    if held_locks.held_here(path):
        raise ValueError(f"a link to this training's {LOCK_NAME}")
    return safe_read.load_json(path, max_bytes)


def _not_writable(output_dir: str | os.PathLike[str], exc: OSError) -> str:
    why = exc.strerror or type(exc).__name__
    return (f"output_dir {os.fspath(output_dir)} cannot be written ({why}: {exc.filename or ''}); no checkpoint "
            "could be saved. HINT: point --output-dir/output_dir at a writable directory on shared storage (a "
            "read-only mount, or one owned by another user?)")


def _lock(path: Path, fd: int) -> tuple[OutputLock | None, str | None]:
    me = this_process()
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in HELD_ERRNOS | UNSUPPORTED_ERRNOS:
            raise
        return _busy(path, fd, me, unsupported=exc.errno in UNSUPPORTED_ERRNOS)
    why = _live_takeover(path, read_holder(fd), me)  # the kernel lock is free: is the record's holder gone?
    if why is not None:
        os.close(fd)  # drops the kernel lock just taken: the holder that took over retries it
        return None, why
    return _hold(path, fd, me, locked=True), None


def _busy(path: Path, fd: int, me: Holder, unsupported: bool) -> tuple[OutputLock | None, str | None]:
    """The kernel lock is held (or the file system cannot lock): take over, wait, or refuse."""
    holder = read_holder(fd)
    locked = not unsupported and _earlier_run_ends_here(fd, holder, me)
    if not locked and not _may_take_over(holder, me, unsupported):
        os.close(fd)
        return None, _refusal(path, holder, lock_unsupported=unsupported)
    if holder is None or unsupported or locked:
        return _hold(path, fd, me, locked), None
    logger.warning("slurm_jit: %s is held by an earlier run of this job (%s), which Slurm ended before this "
                   "requeue: taking it over (the kernel lock is retried every %.0f s until that run's lease ends)",
                   path, holder.describe(), TAKEOVER_RETRY_S)
    lock = _hold(path, fd, me, locked=False)
    lock.taken_from = holder
    lock.retry = threading.Thread(target=retry_kernel_lock, args=(lock, me, TAKEOVER_RETRY_S),
                                  name="slurm-jit-output-lock", daemon=True)
    lock.retry.start()
    return lock, None


def _hold(path: Path, fd: int, me: Holder, locked: bool) -> OutputLock:
    write_holder(fd, replace(me, kernel_lock=locked))
    held_locks.hold(fd, LOCK_NAME)
    return OutputLock(path=path, fd=fd, locked=locked)


def _wait_for(done: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + EARLIER_RUN_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(EARLIER_RUN_POLL_S)
        if done():
            return True
    return False


def _earlier_run_ends_here(fd: int, holder: Holder | None, me: Holder) -> bool:
    """A busy lock held on THIS host is held by a live process (the kernel drops a dead one's): an earlier run of
    this job still tearing down. Wait for it to end (then the lock is ours, for real), up to EARLIER_RUN_WAIT_S.
    One that took over holds no kernel lock (an older run's lease does): wait for its process to end (then it is
    taken over, and the lock retried)."""
    if holder is None or holder.host != me.host or not _earlier_run_of_this_job(holder, me):
        return False
    if not holder.kernel_lock:
        if process_alive(holder):
            _wait_for_earlier_run(holder)
        return False
    return _wait_for_earlier_run(holder, lambda: try_lock(fd))


def _wait_for_earlier_run(holder: Holder, done: Callable[[], bool] | None = None) -> bool:
    logger.warning("slurm_jit: the output_dir lock is still held by an earlier run of this job on this host (%s): "
                   "waiting up to %.0f s for it to end", holder.describe(), EARLIER_RUN_WAIT_S)
    return _wait_for(done or (lambda: not process_alive(holder)))


def _may_take_over(holder: Holder | None, me: Holder, unsupported: bool) -> bool:
    """A busy lock: only an earlier run of this job's on another host (a dead node's NFS lease; on this host the
    holder is alive), or on this host one that took over and whose process is gone. No locking at all: also a free
    or dead holder."""
    if not unsupported:
        return (holder is not None and _earlier_run_of_this_job(holder, me)
                and (holder.host != me.host or not holder.kernel_lock and not process_alive(holder)))
    return holder is None or _stale(holder, me)


def _live_takeover(path: Path, holder: Holder | None, me: Holder) -> str | None:
    """The kernel lock was free. Its last holder is gone (the kernel dropped its lock; release() empties the
    record), unless the record names one that took over without the kernel lock: then a refusal while it lives."""
    if holder is None or holder.kernel_lock:
        return None
    if holder.host == me.host:
        alive = process_alive(holder)
        if alive and _earlier_run_of_this_job(holder, me):
            alive = not _wait_for_earlier_run(holder)
        return _refusal(path, holder, took_over=True) if alive else None
    if _earlier_run_of_this_job(holder, me):
        return None  # Slurm requeued this job: every task of that run has ended
    running, state = _job_running(holder.job_id)
    if running is None:
        return _refusal(path, holder, took_over=True, cannot_tell=state)
    return _refusal(path, holder, took_over=True) if running else None


def _job_running(job_id: str | None) -> tuple[bool | None, str]:
    """(whether a process of the Slurm job may still run, its state); (None, why) when Slurm cannot tell."""
    if job_id is None or not SLURM_JOB_ID_PATTERN.fullmatch(job_id):
        return None, f"{job_id!r} is not a Slurm job id"
    try:
        state = slurm.job_state(slurm.show_job(job_id))
    except slurm.SlurmError as exc:
        if "Invalid job id" in str(exc):  # unknown to slurmctld: ended longer than MinJobAge ago
            return False, "unknown to Slurm"
        return None, str(exc).split(" HINT:")[0]
    return state not in JOB_ENDED_STATES, state


def _earlier_run_of_this_job(holder: Holder, me: Holder) -> bool:
    return bool(me.job_id) and holder.job_id == me.job_id and holder.restart_count != me.restart_count


def _stale(holder: Holder, me: Holder) -> bool:
    """Without locking: is the holder known to be gone?"""
    if _earlier_run_of_this_job(holder, me):
        return True
    return holder.host == me.host and not process_alive(holder)


def _refusal(path: Path, holder: Holder | None, lock_unsupported: bool = False,
             in_this_process: bool = False, took_over: bool = False, cannot_tell: str | None = None) -> str:
    who = holder.describe() if holder is not None else "another process (it has not written its name yet)"
    hint = "wait for it to end (or scancel it), or give this run another output_dir"
    if in_this_process:
        who = f"another trainer in this process (pid {os.getpid()}) whose train() has not ended"
        hint = "let the first train() end before the next, or give each trainer its own output_dir"
    if lock_unsupported:
        hint += f"; this file system cannot lock files: if that run is gone, remove {path}"
    if took_over:  # only the record says it holds the directory: a forged or stale one is removed by hand
        who += ", which took the lock over from an earlier run of its job"
        who += f"; whether it still runs is unknown ({cannot_tell})" if cannot_tell is not None else ""
        hint += f"; if that run is gone, remove {path}"
    return f"output_dir {path.parent.parent} is in use by {who}: two trainings would overwrite each other's " \
           f"checkpoints. HINT: {hint}"


def release(lock: OutputLock | None) -> None:
    """Empty the file and close it, which drops the lock; a takeover's retry ends. Without the kernel lock yet, the
    record taken over is put back: the dead node's lease (NFSv3's: until it reboots) still holds the lock, and the
    next requeue must find the run it may take over from, not an empty record under a busy lock (refused)."""
    if lock is None:
        return
    with lock.guard:
        lock.released.set()
        try:
            held_locks.forget(lock.fd)
            if lock.taken_from is not None and not lock.locked:
                write_holder(lock.fd, lock.taken_from)
            else:
                os.ftruncate(lock.fd, 0)
        except OSError as exc:  # releasing must not mask what ended training; closing drops the lock anyway
            logger.warning("slurm_jit: could not empty %s: %s", lock.path, exc)
        finally:
            os.close(lock.fd)
    if lock.retry is not None:
        lock.retry.join(RELEASE_JOIN_S)
