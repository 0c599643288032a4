"""The output_dir lock's record (who holds it, in ``output.lock``'s JSON), its handle, and the retry thread after a
takeover.

Owns the record's one format: :class:`Holder`, its bounded read that rejects anything this library does not write
(:func:`read_holder`), its write that never leaves an empty file in between (:func:`write_holder`), whether the
process it names still runs (:func:`process_alive`: pid and start time), and, after a takeover of an earlier run's
record on another host, the daemon thread that retries the kernel lock until that run's lease ends
(:func:`retry_kernel_lock`), on the lock's handle it shares with :mod:`.output_lock` (:class:`OutputLock`). When to
take the lock, wait, take over or refuse is :mod:`.output_lock`'s.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypeGuard

logger = logging.getLogger(__name__)

HOLDER_MAX_BYTES = 4096  # the holder's JSON is ~200 bytes; a bounded read of a file others can write
HOLDER_TEXT_MAX_CHARS = 255  # a job id, restart count or host name in the record (HOST_NAME_MAX is 64)
PID_LIMIT = 2**22  # Linux's PID_MAX_LIMIT: a larger pid in the record is not one we wrote
SINCE_LIMIT_S = 2**33  # seconds since the epoch (year 2242): a later "since" is not one we wrote
# lock errors that mean "someone holds it" (fcntl(2): EACCES or EAGAIN)
HELD_ERRNOS = {errno.EACCES, errno.EAGAIN}


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


@dataclass
class OutputLock:
    """A lock taken by :func:`slurm_jit.train.output_lock.acquire`; ``release`` it there when training ends."""

    path: Path
    fd: int
    locked: bool  # False: taken over (retried until True), or the file system cannot lock: the content decides
    # The retry thread touches ``fd`` only under ``guard`` and before ``released``: release() closes it, and the
    # descriptor's number may then be another file's.
    guard: threading.Lock = field(default_factory=threading.Lock, repr=False)
    released: threading.Event = field(default_factory=threading.Event, repr=False)
    retry: threading.Thread | None = field(default=None, repr=False)
    taken_from: Holder | None = None  # the earlier run whose record a takeover replaced (its lease holds the lock)


def this_process() -> Holder:
    return Holder(job_id=os.environ.get("SLURM_JOB_ID") or None,
                  restart_count=os.environ.get("SLURM_RESTART_COUNT") or None,
                  host=socket.gethostname(), pid=os.getpid(), since=time.time(), pid_start=_start_ticks(os.getpid()))


def retry_kernel_lock(lock: OutputLock, me: Holder, retry_s: float) -> None:
    """After a takeover: the kernel lock, once the earlier run's lease ends (the record then says so). Ends when
    the lock is released. A non-blocking try under ``guard``: release() never waits for more than one try."""
    said: set[str] = set()  # what was said once: a failing try, another holder in the record
    while not lock.released.wait(retry_s):
        with lock.guard:
            if lock.released.is_set() or not _retry_once(lock, me, said):
                continue
        logger.info("slurm_jit: %s: the earlier run's lease ended, this run holds the lock", lock.path)
        return


def _retry_once(lock: OutputLock, me: Holder, said: set[str]) -> bool:
    try:
        if try_lock(lock.fd):
            lock.locked = True
            write_holder(lock.fd, replace(me, kernel_lock=True))
            return True
        holder = read_holder(lock.fd)
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


def try_lock(fd: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in HELD_ERRNOS:
            raise
        return False
    return True


def process_alive(holder: Holder) -> bool:
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


def read_holder(fd: int) -> Holder | None:
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


def write_holder(fd: int, holder: Holder) -> None:
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
