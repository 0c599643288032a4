"""``OUT_DIR/slurm-jit/launch.json``: what the launcher decided at each stop of a job (read by ``status``).

Written only by :mod:`slurm_jit.launch.after_step`, once per job run, after every rank exited.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from slurm_jit import safe_read
from slurm_jit.timing import TIMING_DIR
from slurm_jit.train import output_lock

PROGRESS_NAME = "launch-progress.json"
# One history entry (~200 bytes) per job run and a few counters: 16 MiB is ~80 000 requeues, beyond any job's
# --max-requeues; a larger file is no record of ours and is not loaded.
PROGRESS_MAX_BYTES = 16 * 1024 * 1024
PROBLEM_MAX_CHARS = 200  # of the parser's error in the one warning line


def path(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / TIMING_DIR / PROGRESS_NAME


def read(output_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The progress record; an empty one when there is none or it is unreadable."""
    try:
        record = _load(output_dir)
    except safe_read.READ_ERRORS:
        return {}
    return record if isinstance(record, dict) else {}


def problem(output_dir: str | os.PathLike[str]) -> str | None:
    """Why an existing progress record cannot be used (not JSON, not an object, not a regular file, too large);
    None when fine or absent."""
    try:
        record = _load(output_dir)
    except FileNotFoundError:
        return None
    except safe_read.READ_ERRORS as exc:
        return f"{path(output_dir)} is unreadable ({' '.join(str(exc).split())[:PROBLEM_MAX_CHARS]})"
    return None if isinstance(record, dict) else f"{path(output_dir)} holds no JSON object"


def _load(output_dir: str | os.PathLike[str]) -> object:
    """The record as the stop record is read (:func:`slurm_jit.train.output_lock.read_json`): a FIFO is never
    waited on, nothing over PROGRESS_MAX_BYTES is loaded, every JSON error is a ValueError."""
    return output_lock.read_json(path(output_dir), PROGRESS_MAX_BYTES)


def keep_copy(output_dir: str | os.PathLike[str]) -> Path:
    """Move an unusable progress record aside (``launch-progress.json.unreadable``) before it is replaced: renamed,
    never read (a FIFO would block, a huge file fill memory)."""
    source = path(output_dir)
    target = source.with_name(source.name + ".unreadable")
    os.replace(source, target)
    return target


def history(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The decisions recorded so far, skipping entries that are not objects."""
    listed = record.get("history")
    return [entry for entry in listed if isinstance(entry, dict)] if isinstance(listed, list) else []


def write(output_dir: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Atomically replace the progress record (temporary file, fsync, rename); OSError when it cannot, with the
    previous record untouched."""
    target = path(output_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)  # a half-written temporary file; the record before it is untouched
        raise


def failure_retries(record: dict[str, Any], job_id: str, key: str = "failure_retries") -> int:
    """Requeues already spent on failures by this job id (``key="hang_retries"``: on hangs and lost peers); 0 for
    a value that is no count (a hand edit: a string, ``true``, a negative number would widen the budget)."""
    value = record.get(key, {}).get(job_id, 0) if isinstance(record.get(key), dict) else 0
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def hang_retries(record: dict[str, Any], job_id: str) -> int:
    """Requeues already spent on hangs and lost peers by this job id."""
    return failure_retries(record, job_id, key="hang_retries")


def requeued_restarts(record: dict[str, Any], job_id: str) -> frozenset[int]:
    """The restarts of this job after which the launcher requeued it (its history)."""
    return frozenset(entry["restart"] for entry in history(record)
                     if str(entry.get("job_id")) == job_id and entry.get("outcome") == "requeued"
                     and isinstance(entry.get("restart"), int))


def previous_step(record: dict[str, Any], job_id: str) -> int | None:
    """The global step at this job's previous JIT stop; None on its first (a new job into the same directory,
    e.g. one that starts over, is not held to an older job's step)."""
    value = record.get("last_step")
    return value if isinstance(value, int) and str(record.get("job_id")) == job_id else None
