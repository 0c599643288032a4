"""A checkpoint write that fails because the disk is full: one clear line, nothing already saved touched.

The save stops where it failed: the sentinel stays (the checkpoint is ``incomplete``), no manifest is written and
rotation does not run (it runs only after a manifest), so every earlier checkpoint is untouched and the newest
resumable one is still picked by ``ckpt-check`` and ``resume_from_checkpoint=True``. Nothing is deleted to make
room: the partial checkpoint is evidence, and deleting is a human's call.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from slurm_jit.checkpoint import protocol

DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# torch.save reports a failed write as a RuntimeError without the errno ("PytorchStreamWriter failed writing file",
# "unexpected pos 7296 vs 7190"); with less free space than this left (a save writes files of megabytes), a write
# failure is the disk being full.
LOW_FREE_BYTES = 1024 * 1024


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, quota); the message is one line with a HINT."""


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (None: cannot tell)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def disk_full_reason(ckpt_dir: Path, exc: BaseException) -> str | None:
    """Why this exception means the disk (or the quota) is full, or None when it does not."""
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    if not isinstance(exc, OSError | RuntimeError):
        return None
    free = free_bytes(ckpt_dir.parent)
    if free is not None and free < LOW_FREE_BYTES:
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"no space left on the device ({free} bytes free; {type(exc).__name__}: {first_line})"
    return None


@contextlib.contextmanager
def disk_full_is_one_line(ckpt_dir: Path) -> Iterator[None]:
    """Turn a full disk inside a checkpoint write into :class:`CheckpointWriteError`, whose message is the one
    line to show (``str(exc)``; no chained traceback); any other failure passes through unchanged."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        why = disk_full_reason(ckpt_dir, exc)
        if why is None:
            raise
        message = (f"slurm_jit: {ckpt_dir} could not be written: {why}. It stays incomplete "
                   f"({protocol.SENTINEL_NAME} kept); earlier checkpoints are untouched. HINT: free space on "
                   f"{ckpt_dir.parent} (df -h) or use a larger output_dir, then resume: ckpt-check "
                   f"{ckpt_dir.parent} names the checkpoint it resumes from")
        raise CheckpointWriteError(message) from None
