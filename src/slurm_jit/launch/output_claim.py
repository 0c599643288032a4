"""One live launcher job per output directory, and each job's own script kept beside it.

Every job the launcher submitted into ``OUT_DIR`` has its batch script kept as ``OUT_DIR/slurm-jit/job-<id>.sbatch``
(written once sbatch accepted the job). A new submit asks the Slurm gateway about those jobs and is refused while
one of them may still run (pending, running, requeued, suspended): two jobs would train into the same
checkpoints. Submits into one directory take :func:`submit_lock` around check-and-submit, so two at once cannot
both pass the check.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slurm_jit import slurm
from slurm_jit.timing import TIMING_DIR

JOB_SCRIPT = re.compile(r"job-(\d+)\.sbatch")
SCRIPT_NAME = "submit.sbatch"  # where submit.py wrote every job's script before it ran on JitExecutor
LOCK_NAME = "submit.lock"
# Another submit into the same directory holds the lock for one sbatch call at most: the gateway's timeout, twice.
SUBMIT_LOCK_WAIT_S = 2 * slurm.COMMAND_TIMEOUT_S
SUBMIT_LOCK_POLL_S = 0.2
UNSUPPORTED_ERRNOS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}  # a file system without locks


def job_script_path(output_dir: str | os.PathLike[str], job_id: str) -> Path:
    return Path(output_dir) / TIMING_DIR / f"job-{job_id}.sbatch"


def recorded_jobs(output_dir: str | os.PathLike[str]) -> list[str]:
    """The ids of the jobs submitted into ``output_dir``, oldest first."""
    try:
        names = os.listdir(Path(output_dir) / TIMING_DIR)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((m.group(1) for m in map(JOB_SCRIPT.fullmatch, names) if m), key=int)


def submitted_from(output_dir: str | os.PathLike[str]) -> str:
    """The script path submit.py gave sbatch before it ran on JitExecutor (``scontrol show job``'s Command of
    the jobs it submitted then, which may still be queued)."""
    return str(Path(output_dir) / TIMING_DIR / SCRIPT_NAME)


def submission_name(output_dir: str | os.PathLike[str]) -> str:
    """The file name JitExecutor (and so submit.py) gives sbatch for a job into ``output_dir``: one per directory,
    whatever the log folder or the path the directory is reached by (``scontrol show job``'s Command)."""
    digest = hashlib.sha256(os.path.realpath(output_dir).encode()).hexdigest()[:16]
    return f".submission_file_{digest}.sh"


def _ours(output_dir: str | os.PathLike[str], command: str | None, job_command: str) -> bool:
    """Whether a recorded job's Command is one submitted into ``output_dir`` (by JitExecutor, or by submit.py
    before it ran on JitExecutor: OUT_DIR/slurm-jit/submit.sbatch)."""
    if command is not None:
        return not command or _same_path(job_command, command)
    return (os.path.basename(job_command) == submission_name(output_dir)
            or _same_path(job_command, submitted_from(output_dir)))


def live_job(output_dir: str | os.PathLike[str], command: str | None = None) -> tuple[str, str] | None:
    """(job id, state) of a job submitted into ``output_dir`` that may still run; None when every one ended.
    A job whose Command is not ours (default: :func:`submission_name` or the older :func:`submitted_from`;
    ``command`` that path, "" any) is another job that slurmctld gave a recorded id after its state was reset.
    Raises ValueError (one line with a HINT) when slurmctld cannot say."""
    for job_id in reversed(recorded_jobs(output_dir)):
        try:
            job = slurm.show_job(job_id)
        except slurm.SlurmError as exc:
            if slurm.UNKNOWN_JOB in str(exc):
                continue
            raise ValueError(f"cannot tell whether job {job_id} still uses {output_dir}: {exc}. HINT: once "
                             "slurmctld answers, submit again") from None
        state = slurm.job_state(job)
        if state not in slurm.ENDED_STATES and ("Command" not in job or _ours(output_dir, command, job["Command"])):
            return job_id, state
    return None


def _same_path(a: str, b: str) -> bool:
    """The same file, reached through symbolic links or not (the file itself may be gone)."""
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def check_free(output_dir: str | os.PathLike[str], command: str | None = None, *,
               option: str = "--output-dir") -> None:
    """ValueError (one line) when a job submitted into ``output_dir`` may still run (``command``: as for
    :func:`live_job`; ``option``: how the caller's user names the directory, submit.py's flag or JitExecutor's
    ``output_dir=``)."""
    found = live_job(output_dir, command)
    if found is not None:
        job_id, state = found
        raise ValueError(f"{output_dir} is in use by job {job_id} ({state}): a second job would train into the "
                         f"same checkpoints. HINT: wait for it to end (status: python launch/submit.py status "
                         f"{job_id}), scancel {job_id}, or give this one another {option}")


@contextmanager
def submit_lock(output_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Held around check-and-submit into ``output_dir`` (a file lock in ``OUT_DIR/slurm-jit``; OSError when it
    cannot be created)."""
    state_dir = Path(output_dir) / TIMING_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        _lock(fd, state_dir / LOCK_NAME)
        yield
    finally:
        os.close(fd)


def _lock(fd: int, path: Path) -> None:
    deadline = time.monotonic() + SUBMIT_LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno in UNSUPPORTED_ERRNOS:
                return  # no locking here: the live-job check alone guards the directory
            if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                raise ValueError(f"another submit into {path.parent.parent} holds {path} ({exc.strerror}). "
                                 "HINT: let it finish, then submit again") from None
        time.sleep(SUBMIT_LOCK_POLL_S)
