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
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypeGuard

from slurm_jit import slurm
from slurm_jit.timing import TIMING_DIR

logger = logging.getLogger(__name__)

LOCK_NAME = "output.lock"
HOLDER_MAX_BYTES = 4096  # the holder's JSON is ~200 bytes; a bounded read of a file others can write
HOLDER_TEXT_MAX_CHARS = 255  # a job id, restart count or host name in the record (HOST_NAME_MAX is 64)
PID_LIMIT = 2**22  # Linux's PID_MAX_LIMIT: a larger pid in the record is not one we wrote
SINCE_LIMIT_S = 2**33  # seconds since the epoch (year 2242): a later "since" is not one we wrote
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


@dataclass(frozen=True, kw_only=True)
class Holder:
    """Who holds (or last held) the lock."""

    job_id: str | None  # SLURM_JOB_ID (None outside Slurm)
    restart_count: str | None  # SLURM_RESTART_COUNT: a requeued job's run number (None: the first run)
    host: str  # socket.gethostname()
    pid: int  # rank 0's process id on that host
    since: float  # when it took the lock (seconds since the epoch)
    pid_start: int | None = None  # the pid's start (/proc/<pid>/stat, clock ticks since boot): not a recycled pid
    kernel_lock: bool = True  # False: taken over, the kernel lock still held by an earlier run's lease (or none)

    def describe(self) -> str:
        job = f"Slurm job {self.job_id} (restart {self.restart_count or 0})" if self.job_id else "a process"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{job} on host {self.host}, pid {self.pid}, since {when}"


def this_process() -> Holder:
    return Holder(job_id=os.environ.get("SLURM_JOB_ID") or None,
                  restart_count=os.environ.get("SLURM_RESTART_COUNT") or None,
                  host=socket.gethostname(), pid=os.getpid(), since=time.time(), pid_start=_start_ticks(os.getpid()))


@dataclass
class OutputLock:
    """A lock taken by :func:`acquire`; :func:`release` it when training ends."""

    path: Path
    fd: int
    locked: bool  # False: taken over (retried until True), or the file system cannot lock: the content decides
    # The retry thread touches ``fd`` only under ``guard`` and before ``released``: release() closes it, and the
    # descriptor's number may then be another file's.
    guard: threading.Lock = field(default_factory=threading.Lock, repr=False)
    released: threading.Event = field(default_factory=threading.Event, repr=False)
    retry: threading.Thread | None = field(default=None, repr=False)
    taken_from: Holder | None = None  # the earlier run whose record a takeover replaced (its lease holds the lock)


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


def held_here(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` itself (not what a symbolic link names) is a lock file this process holds: opening and
    closing it would drop the lock."""
    return _held_here(Path(path))


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
    except OSError as exc:
        if exc.errno not in HELD_ERRNOS | UNSUPPORTED_ERRNOS:
            raise
        return _busy(path, fd, me, unsupported=exc.errno in UNSUPPORTED_ERRNOS)
    why = _live_takeover(path, _read_holder(fd), me)  # the kernel lock is free: is the record's holder gone?
    if why is not None:
        os.close(fd)  # drops the kernel lock just taken: the holder that took over retries it
        return None, why
    return _hold(path, fd, me, locked=True), None


def _busy(path: Path, fd: int, me: Holder, unsupported: bool) -> tuple[OutputLock | None, str | None]:
    """The kernel lock is held (or the file system cannot lock): take over, wait, or refuse."""
    holder = _read_holder(fd)
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
    lock.retry = threading.Thread(target=_retry_kernel_lock, args=(lock, me), name="slurm-jit-output-lock",
                                  daemon=True)
    lock.retry.start()
    return lock, None


def _hold(path: Path, fd: int, me: Holder, locked: bool) -> OutputLock:
    _write_holder(fd, replace(me, kernel_lock=locked))
    _HELD_HERE.add(_file_key(fd))
    return OutputLock(path=path, fd=fd, locked=locked)


def _retry_kernel_lock(lock: OutputLock, me: Holder) -> None:
    """After a takeover: the kernel lock, once the earlier run's lease ends (the record then says so). Ends when
    the lock is released. A non-blocking try under ``guard``: release() never waits for more than one try."""
    said: set[str] = set()  # what was said once: a failing try, another holder in the record
    while not lock.released.wait(TAKEOVER_RETRY_S):
        with lock.guard:
            if lock.released.is_set() or not _retry_once(lock, me, said):
                continue
        logger.info("slurm_jit: %s: the earlier run's lease ended, this run holds the lock", lock.path)
        return


def _retry_once(lock: OutputLock, me: Holder, said: set[str]) -> bool:
    try:
        if _try_lock(lock.fd):
            lock.locked = True
            _write_holder(lock.fd, replace(me, kernel_lock=True))
            return True
        holder = _read_holder(lock.fd)
    except OSError as exc:  # an NFS server's lockd away for a while: keep trying, say it once
        if "failed" not in said:
            logger.warning("slurm_jit: retrying the lock of %s failed (%s); still retrying. HINT: the file "
                           "system's locking (NFS lockd) must answer", lock.path, exc)
        said.add("failed")
        return False
    if holder is not None and (holder.host, holder.pid, holder.since) != (me.host, me.pid, me.since) \
            and "taken" not in said:  # a newcomer judged this run gone (Slurm of another cluster?)
        said.add("taken")
        logger.error("slurm_jit: %s now names %s, which took this output_dir while this run trains: two trainings "
                     "write there. HINT: scancel one of them, then check the newest checkpoints with ckpt-check",
                     lock.path, holder.describe())
    return False


def _try_lock(fd: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in HELD_ERRNOS:
            raise
        return False
    return True


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
        if _process_alive(holder):
            _wait_for_earlier_run(holder)
        return False
    return _wait_for_earlier_run(holder, lambda: _try_lock(fd))


def _wait_for_earlier_run(holder: Holder, done: Callable[[], bool] | None = None) -> bool:
    logger.warning("slurm_jit: the output_dir lock is still held by an earlier run of this job on this host (%s): "
                   "waiting up to %.0f s for it to end", holder.describe(), EARLIER_RUN_WAIT_S)
    return _wait_for(done or (lambda: not _process_alive(holder)))


def _may_take_over(holder: Holder | None, me: Holder, unsupported: bool) -> bool:
    """A busy lock: only an earlier run of this job's on another host (a dead node's NFS lease; on this host the
    holder is alive), or on this host one that took over and whose process is gone. No locking at all: also a free
    or dead holder."""
    if not unsupported:
        return (holder is not None and _earlier_run_of_this_job(holder, me)
                and (holder.host != me.host or not holder.kernel_lock and not _process_alive(holder)))
    return holder is None or _stale(holder, me)


def _live_takeover(path: Path, holder: Holder | None, me: Holder) -> str | None:
    """The kernel lock was free. Its last holder is gone (the kernel dropped its lock; release() empties the
    record), unless the record names one that took over without the kernel lock: then a refusal while it lives."""
    if holder is None or holder.kernel_lock:
        return None
    if holder.host == me.host:
        alive = _process_alive(holder)
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
    return holder.host == me.host and not _process_alive(holder)


def _process_alive(holder: Holder) -> bool:
    """The holder's process, on this host, still runs: its pid is alive and, when the record has it, started when
    the holder's did (a pid recycled since is another process). This process is not a holder."""
    if holder.pid == os.getpid():
        return False
    if not _pid_alive(holder.pid):
        return False
    started = _start_ticks(holder.pid)
    return holder.pid_start is None or started is None or started == holder.pid_start


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _start_ticks(pid: int) -> int | None:
    """proc(5) /proc/<pid>/stat field 22, starttime; None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return int(file.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


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


def _read_holder(fd: int) -> Holder | None:
    """The holder named in the file, or None when it is empty or unusable (a released lock, a torn write, a file
    not written by us: deep nesting, a negative or huge pid, a name with a control character)."""
    try:
        raw = os.pread(fd, HOLDER_MAX_BYTES, 0)
        data = json.loads(raw.decode("utf-8")) if raw.strip() else None
        return _holder_of(data) if isinstance(data, dict) else None
    except (OSError, ValueError, RecursionError):  # RecursionError: [[[[... nested past the recursion limit
        return None


def _holder_of(data: dict[str, object]) -> Holder:
    """A record's holder; ValueError when a field is not one we write."""
    pid, since, pid_start = data.get("pid"), data.get("since"), data.get("pid_start")
    kernel_lock = data.get("kernel_lock", True)  # records written before the field: held the kernel lock
    if not _is_int(pid) or not 0 < pid <= PID_LIMIT:
        raise ValueError(f"pid {pid!r}")
    if not isinstance(since, (int, float)) or isinstance(since, bool):
        raise ValueError(f"since {since!r}")
    if not 0 <= since < SINCE_LIMIT_S:  # NaN fails the comparison too
        raise ValueError(f"since {since!r}")
    if (pid_start is not None and not _is_int(pid_start)) or not isinstance(kernel_lock, bool):
        raise ValueError(f"pid_start {pid_start!r}, kernel_lock {kernel_lock!r}")
    host = _text(data.get("host"))
    if host is None:
        raise ValueError("no host")
    return Holder(job_id=_text(data.get("job_id")), restart_count=_text(data.get("restart_count")), host=host,
                  pid=pid, since=float(since), pid_start=pid_start, kernel_lock=kernel_lock)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value: object) -> str | None:
    """A name from the record (None stays None): printable, one line, bounded; else ValueError."""
    if value is None:
        return None
    text = str(value) if _is_int(value) else value
    if not isinstance(text, str) or not text.isprintable() or not 0 < len(text) <= HOLDER_TEXT_MAX_CHARS:
        raise ValueError(f"not a name: {str(value)[:40]!r}")
    return text


def _write_holder(fd: int, holder: Holder) -> None:
    """The new record over the old, padded to its length, then cut to size: never an empty file in between (a
    reader finding the kernel lock free and the file empty would take the directory)."""
    data = json.dumps(asdict(holder)).encode("utf-8")
    size = os.fstat(fd).st_size
    if size > HOLDER_MAX_BYTES:  # not a record of ours: no need to keep it readable
        os.ftruncate(fd, 0)
        size = 0
    os.pwrite(fd, data.ljust(size), 0)
    os.ftruncate(fd, len(data))
    os.fsync(fd)


def release(lock: OutputLock | None) -> None:
    """Empty the file and close it, which drops the lock; a takeover's retry ends. Without the kernel lock yet, the
    record taken over is put back: the dead node's lease (NFSv3's: until it reboots) still holds the lock, and the
    next requeue must find the run it may take over from, not an empty record under a busy lock (refused)."""
    if lock is None:
        return
    with lock.guard:
        lock.released.set()
        try:
            _HELD_HERE.discard(_file_key(lock.fd))
            if lock.taken_from is not None and not lock.locked:
                _write_holder(lock.fd, lock.taken_from)
            else:
                os.ftruncate(lock.fd, 0)
        except OSError as exc:  # releasing must not mask what ended training; closing drops the lock anyway
            logger.warning("slurm_jit: could not empty %s: %s", lock.path, exc)
        finally:
            os.close(lock.fd)
    if lock.retry is not None:
        lock.retry.join(RELEASE_JOIN_S)
