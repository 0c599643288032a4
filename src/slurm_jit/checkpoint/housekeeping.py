"""Keeping an output directory tidy without losing a resume point: which checkpoints a ``save_total_limit`` rotation
may delete, and deleting one so that no instant of it looks resumable. (Quarantine, which renames and never
deletes, stays with the reading in :mod:`slurm_jit.checkpoint.protocol`.)
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Collection, Iterable
from pathlib import Path

from slurm_jit.checkpoint.names import DELETING_PREFIX
from slurm_jit.checkpoint.verdict import WHOLE_STATUSES, CheckpointInfo, newest_written_first
from slurm_jit.checkpoint.writing import fsync_dir


def rotation_victims(checkpoints: Iterable[CheckpointInfo], limit: int,
                     keep: Collection[str | os.PathLike[str]] = ()) -> list[CheckpointInfo]:
    """The checkpoints a ``save_total_limit`` rotation may delete, newest written first.

    Only whole checkpoints (complete, unverified, model-only) are candidates: an incomplete or corrupt one is
    never returned (it is evidence, set aside by quarantine, not deleted). Kept: the ``limit`` most recently
    written whole checkpoints, the most recently written resumable one (so that rotation never removes the last
    resume point), and every path in ``keep`` (the caller's: the one just written, the best model, the one
    resumed from). ``limit < 1`` means no limit, as in transformers.
    """
    if limit < 1:
        return []
    kept_paths = {os.path.realpath(p) for p in keep}
    whole = [c for c in newest_written_first(checkpoints) if c.status in WHOLE_STATUSES]
    newest_resumable = next((c for c in whole if c.resumable()), None)
    return [c for c in whole[limit:]
            if c is not newest_resumable and os.path.realpath(c.path) not in kept_paths]


def delete_checkpoint(ckpt_dir: Path) -> None:
    """Delete a checkpoint so that no instant of it can be taken for a resume point: first an atomic rename out of
    the ``checkpoint-*`` names (durable), then the removal. Deleting in place could leave, after a kill, the files
    without the manifest: a whole-looking ``unverified`` checkpoint whose directory mtime (the removal's) makes it
    the newest."""
    doomed = ckpt_dir.with_name(f"{DELETING_PREFIX}{ckpt_dir.name}.{time.time_ns()}")
    try:
        os.rename(ckpt_dir, doomed)
    except FileNotFoundError:
        return  # already gone
    fsync_dir(ckpt_dir.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_deletion_leftovers(out_dir: Path) -> None:
    """Finish deletions that a kill interrupted (directories renamed by :func:`delete_checkpoint`)."""
    for leftover in out_dir.glob(f"{DELETING_PREFIX}*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
