"""The verdict on a checkpoint directory (:class:`Status`, :class:`CheckpointInfo`), the answer to "where do I
resume from?" (:class:`Resolution`), and what "newest" means (:func:`newest_written_first`).

:mod:`slurm_jit.checkpoint.protocol` gives the verdicts; this module only holds their shape, so that rotation and
quarantine (:mod:`slurm_jit.checkpoint.housekeeping`) can use them without the reading code.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from slurm_jit.checkpoint.names import SetAside


class Status(str, enum.Enum):
    COMPLETE = "complete"
    INCOMPLETE = "incomplete"
    CORRUPT = "corrupt"
    UNVERIFIED = "unverified"
    MODEL_ONLY = "model-only"  # verified, but holds only what inference needs (save_only_model): never resumed


WHOLE_STATUSES = (Status.COMPLETE, Status.UNVERIFIED, Status.MODEL_ONLY)  # every file there: rotation may delete


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    path: Path  # the checkpoint directory
    step: int  # from the directory name
    status: Status
    reason: str  # why this status ("" for a verified complete checkpoint)
    kind: str | None = None  # jit / periodic / final, from the manifest
    size_bytes: int | None = None  # regular files under the directory (symlinks not followed); None: unknown
    mtime: float = 0.0  # the directory's own mtime (0.0: unknown)
    written_at: float = 0.0  # the verified manifest's ``created``, else ``mtime``: what "newest" means
    run_id: str | None = None  # the writing run's lineage id, from a verified manifest
    world_size: int | None = None  # the number of ranks that wrote it, from a verified manifest
    save_seq: int | None = None  # the order of writes in the output directory, from a verified manifest
    zero_stage: int | None = None  # the DeepSpeed ZeRO stage it was written with, from a verified manifest
    weights: str | None = None  # where the module weights are (manifest.WEIGHTS_LAYOUTS), from a verified manifest

    def resumable(self, strict: bool = False) -> bool:
        return self.status is Status.COMPLETE or (self.status is Status.UNVERIFIED and not strict)


def newest_written_first(checkpoints: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
    """Most recently written first: by time (the higher step first among equal times), then the checkpoints
    with a save sequence number reordered among the places they hold by it, so clocks cannot reorder them."""
    by_time = sorted(checkpoints, key=lambda c: (c.written_at, c.step), reverse=True)
    places = [i for i, c in enumerate(by_time) if c.save_seq is not None]
    by_seq = sorted((by_time[i] for i in places), key=lambda c: (c.save_seq, c.step), reverse=True)
    for place, ckpt in zip(places, by_seq, strict=True):
        by_time[place] = ckpt
    return by_time


@dataclass(frozen=True, kw_only=True)
class Resolution:
    """The answer to "where do I resume from?"."""

    checkpoint: CheckpointInfo | None  # the most recently written resumable checkpoint, or None
    passed_over: list[CheckpointInfo]  # every checkpoint written after it, with its status and reason
    checkpoints: list[CheckpointInfo]  # all checkpoint directories, newest written first
    ignored: list[str] = field(default_factory=list)  # entries named like checkpoints that are not
    set_aside: list[SetAside] = field(default_factory=list)  # superseded or quarantined directories, by name
