"""The floor rows of issue #34, each measured in the same run as what it judges: JIT saves into tmpfs beside the
raw write floor there, a resume and ``ckpt-check --deep`` from tmpfs beside the raw read floor, and the disk's save
beside the raw floor written to the disk. Every tmpfs directory is removed after its use; a run that would not
fit in tmpfs (or in the memory behind it) is skipped with the reason."""

from __future__ import annotations

import logging
from pathlib import Path

from slurm_jit.bench import ckpt_check_speed, floors, resume, runs, save
from slurm_jit.bench.rows import Row, skipped

logger = logging.getLogger(__name__)

ZERO2_SAVE_ROW = "save_over_write_floor_zero2"
ZERO3_SAVE_ROW = "save_over_write_floor_zero3"
DISK_SAVE_ROW = "save_over_write_floor_disk"
RESUME_ROW = "resume_over_read_floor"
DEEP_ROW = "ckpt_check_deep_over_read_floor"


def _no_room(model: runs.Model, names: list[str]) -> list[Row] | None:
    """Skipped rows when tmpfs cannot take this model's runs now, else None."""
    missing = floors.tmpfs_room_missing(floors.TMPFS_COPIES * floors.state_bytes(model.params()))
    if missing is None:
        return None
    logger.warning("bench: %s skipped: %s", ", ".join(names), missing)
    return [skipped(name, "ratio", floors.FLOOR_TARGET, "on tmpfs", missing) for name in names]


def zero2_rows(model: runs.Model, *, save_row: bool, resume_rows: bool) -> list[Row]:
    """One ZeRO-2 JIT stop into tmpfs; its save over the write floor, then ``ckpt-check --deep`` and a resume over
    the read floor of its files."""
    names = [ZERO2_SAVE_ROW] * save_row + [DEEP_ROW, RESUME_ROW] * resume_rows
    if (no_room := _no_room(model, names)) is not None:
        return no_room
    out: list[Row] = []
    with floors.scratch(floors.TMPFS, "zero2") as base:
        ours = save.run_ours(base / "zero2", model, 2)
        hash_s = floors.hash_trials(ours.sizes_by_rank(), floors.TMPFS_TRIALS)
        if save_row:
            out.append(save.write_floor_row(ZERO2_SAVE_ROW, ours, _write_floor(base, ours), "ZeRO-2", hash_s))
        if resume_rows:
            read_s = floors.read_trials(ours.paths_by_rank(), floors.TMPFS_TRIALS)
            # before the resume, which adds its own final checkpoint to the directory --deep would check
            out.append(ckpt_check_speed.deep_floor_row(ours.outcome.out, ours.ckpt, read_s, ours.world_size,
                                                       hash_s))
            out.append(resume.read_floor_row(ours, resume.resume(ours, model), read_s))
    return out


def zero3_rows(model: runs.Model) -> list[Row]:
    """One ZeRO-3 JIT stop into tmpfs (no 16-bit gather, the default) and its save over the write floor."""
    if (no_room := _no_room(model, [ZERO3_SAVE_ROW])) is not None:
        return no_room
    with floors.scratch(floors.TMPFS, "zero3") as base:
        ours = save.run_ours(base / "zero3", model, 3)
        return [save.write_floor_row(ZERO3_SAVE_ROW, ours, _write_floor(base, ours), "ZeRO-3 (no 16-bit gather)",
                                     floors.hash_trials(ours.sizes_by_rank(), floors.TMPFS_TRIALS))]


def disk_row(ours: save.JitSave, work: Path) -> Row:
    """The raw write floor on the disk the save ``ours`` wrote to, DISK_TRIALS times, beside that save."""
    with floors.scratch(work, "write-floor") as directory:
        trials_s = floors.write_trials(directory, ours.sizes_by_rank(), floors.DISK_TRIALS)
    return save.disk_floor_row(ours, trials_s, work)


def _write_floor(base: Path, ours: save.JitSave) -> list[float]:
    with floors.scratch(base, "write-floor") as directory:
        return floors.write_trials(directory, ours.sizes_by_rank(), floors.TMPFS_TRIALS)
