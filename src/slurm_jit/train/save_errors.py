"""A checkpoint write that the file system refuses (disk full, quota used up, read-only): one clear line, nothing
already saved touched.

The save stops where it failed: the sentinel stays (the checkpoint is ``incomplete``), no manifest is written and
rotation does not run (it runs only after a manifest), so every earlier checkpoint is untouched and the newest
resumable one is still picked by ``ckpt-check`` and ``resume_from_checkpoint=True``. Nothing is deleted to make
room: the partial checkpoint is evidence, and deleting is a human's call.

``torch.save`` reports a failed write as a RuntimeError without the errno; when the disk is not nearly full (a
quota, a read-only remount) a small test write in the same directory tells which refusal it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from slurm_jit.checkpoint import protocol

# What to do about each refusal, after "HINT: " ({where}: the output directory).
REFUSAL_HINTS = {
    errno.ENOSPC: "free space on {where} (df -h) or use a larger output_dir",
    errno.EDQUOT: "your disk quota on {where} is used up: free some of it (quota -s; lfs quota on Lustre) or ask for "
                  "more, or use an output_dir under another quota",
    errno.EROFS: "the file system of {where} is read-only (remounted after an I/O error?): have it made writable "
                 "again, or use another output_dir",
}
REFUSED_ERRNOS = set(REFUSAL_HINTS)
# torch.save reports a failed write as a RuntimeError without the errno ("PytorchStreamWriter failed writing file",
# "unexpected pos 7296 vs 7190"); with less free space than this left (a save writes files of megabytes), a write
# failure is the disk being full.
LOW_FREE_BYTES = 1024 * 1024
# A write failure without an errno is probed with a write of this size (a quota with a little room left still
# refuses it, as it refused the save's megabytes); the probe file is removed at once.
PROBE_BYTES = 1024 * 1024
PROBE_NAME = ".slurm-jit-write-probe"
TIMED_OUT = "imed out"  # gloo's words for a peer that did not answer within the group's timeout ("Timed out")
# What torch.distributed says (gloo: a RuntimeError) when a peer ended or stopped answering inside a collective
PEER_GONE_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", TIMED_OUT)
_GLOO_PREFIX = re.compile(r"^\[[^\]]*\]\s*")  # "[/__w/pytorch/.../gloo/transport/tcp/pair.cc:537] "
_GLOO_TAIL = ". This is typically caused"  # gloo's advice that follows the error itself


def gloo_words(line: str) -> str:
    """A gloo error line without its source path and its advice: ``Read error [addr]: Connection reset by peer``."""
    return _GLOO_PREFIX.sub("", line.strip()).split(_GLOO_TAIL)[0].strip()


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, read-only); the message is one line with a HINT."""


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (None: cannot tell)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _errno_words(exc: OSError) -> str:
    return f"{exc.strerror} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"


def probe_write(directory: Path) -> OSError | None:
    """The refusal (ENOSPC, EDQUOT, EROFS) a small write in ``directory`` gets, or None (it succeeds, or fails
    otherwise). The probe file is removed."""
    probe = directory / PROBE_NAME
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return exc if exc.errno in REFUSED_ERRNOS else None
    try:
        os.write(fd, b"\0" * PROBE_BYTES)
        os.fsync(fd)
    except OSError as exc:
        return exc if exc.errno in REFUSED_ERRNOS else None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return None


def refusal(ckpt_dir: Path, exc: BaseException) -> tuple[str, int] | None:
    """(why, errno) when this exception means the file system refuses the write, or None when it does not."""
    if isinstance(exc, OSError) and exc.errno in REFUSED_ERRNOS:
        return _errno_words(exc), exc.errno or 0
    if not isinstance(exc, OSError | RuntimeError):
        return None
    first_line = (str(exc).strip().splitlines() or [""])[0][:200]
    free = free_bytes(ckpt_dir.parent)
    if free is not None and free < LOW_FREE_BYTES:
        return f"no space left on the device ({free} bytes free; {type(exc).__name__}: {first_line})", errno.ENOSPC
    probed = probe_write(ckpt_dir if ckpt_dir.is_dir() else ckpt_dir.parent)
    if probed is None:
        return None
    return f"{type(exc).__name__}: {first_line}; a test write there: {_errno_words(probed)}", probed.errno or 0


def one_line(ckpt_dir: Path, why: str, code: int) -> str:
    """The line shown for a refused checkpoint write, with the HINT for that refusal."""
    where = ckpt_dir.parent
    hint = REFUSAL_HINTS.get(code, REFUSAL_HINTS[errno.ENOSPC]).format(where=where)
    return (f"slurm_jit: {ckpt_dir} could not be written: {why}. It stays incomplete ({protocol.SENTINEL_NAME} "
            f"kept); earlier checkpoints are untouched. HINT: {hint}, then resume: ckpt-check {where} names the "
            "checkpoint it resumes from")


@contextlib.contextmanager
def disk_full_is_one_line(ckpt_dir: Path) -> Iterator[None]:
    """Turn a refused write inside a checkpoint write (disk full, quota, read-only file system) into
    :class:`CheckpointWriteError`, whose message is the one line to show (``str(exc)``; no chained traceback);
    any other failure passes through unchanged."""
    try:
        yield
    except CheckpointWriteError:
        raise  # already the one line (an inner save's, an async commit's): no test write, no second wrapping
    except (OSError, RuntimeError) as exc:
        found = refusal(ckpt_dir, exc)
        if found is not None:
            raise CheckpointWriteError(one_line(ckpt_dir, *found)) from None
        gone = peer_gone_line(ckpt_dir, exc)
        if gone is None:
            raise
        raise CheckpointWriteError(gone) from None


def peer_gone_line(ckpt_dir: Path, exc: BaseException) -> str | None:
    """The line for a save that a collective failed because another rank ended (its own write refused on its own
    node, which that rank says in its own line) or stopped answering; None for any other failure."""
    first_line = gloo_words((str(exc).strip().splitlines() or [""])[0])[:200]
    dist = sys.modules.get("torch.distributed")  # its errors exist only where it is loaded: the launcher's
    distributed_error = getattr(dist, "DistError", None)  # processes (after_step, the runner) never import torch
    if not ((distributed_error is not None and isinstance(exc, distributed_error))
            or (isinstance(exc, RuntimeError) and any(w in first_line for w in PEER_GONE_WORDS))):
        return None
    return (f"slurm_jit: {ckpt_dir} could not be completed: another rank ended or stopped answering during the save "
            f"({type(exc).__name__}: {first_line}). It stays incomplete ({protocol.SENTINEL_NAME} kept); earlier "
            f"checkpoints are untouched. HINT: the other rank's own line in the job log says why (a full or "
            f"read-only file system on its node?); then resume: ckpt-check {ckpt_dir.parent} names the checkpoint "
            "it resumes from")


@contextlib.contextmanager
def set_aside_is_one_line(ckpt_dir: Path) -> Iterator[None]:
    """Setting an earlier run's ``checkpoint-<step>`` aside for a new save of that step (a rename, the save's first
    write) refused by the file system: :class:`CheckpointWriteError`, one line; nothing of the new save exists
    yet, and the earlier directory is where it was."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in REFUSED_ERRNOS:
            raise
        where = ckpt_dir.parent
        hint = REFUSAL_HINTS[exc.errno or 0].format(where=where)
        raise CheckpointWriteError(
            f"slurm_jit: {ckpt_dir}, from an earlier run, could not be set aside for a new save of its step: "
            f"{_errno_words(exc)}. Nothing of the new save was written; {ckpt_dir.name} and every other checkpoint "
            f"are untouched. HINT: {hint}, then resume: ckpt-check {where} names the checkpoint it resumes from"
        ) from None
