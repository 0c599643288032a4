"""The names in an output directory: what a checkpoint directory is called, and what one set aside is called.

- ``checkpoint-<step>``: a checkpoint (ASCII digits only, at most :data:`MAX_STEP_DIGITS`).
- ``checkpoint-<step>.incomplete`` (``.incomplete.N`` when taken): a checkpoint that cannot be resumed (sentinel,
  files missing, corrupt), renamed out of the way by a quarantine; never deleted.
- ``checkpoint-<step>.superseded-<seq>``: a whole checkpoint that a later save of the same step replaced (a run
  resumed from an earlier step saved that step again); ``<seq>`` is 1, 2, ... in the order they were set aside.
  It was complete: it is named for what it is, not as a failed save.
- ``.slurm-jit-deleting-checkpoint-<step>.<ns>``: a checkpoint being deleted (out of every ``checkpoint-<step>``
  pattern first).

A name set aside is never picked for a resume, never rotated and never reported as ``ignored``: ckpt-check lists
it under its own heading (:func:`set_aside`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

SENTINEL_NAME = "checkpoint-is-incomplete.txt"  # transformers' own name (trainer_jit_checkpoint.py)
MAX_STEP_DIGITS = 18  # 10**18 steps is beyond any run; int() refuses over 4300 digits (CPython's str limit)
# transformers.trainer_utils uses ^checkpoint-(\d+)$, whose $ also matches before a final newline and whose \d
# matches any Unicode digit; ours is used with fullmatch and ASCII digits only
CHECKPOINT_RE = re.compile(r"checkpoint-([0-9]+)", re.ASCII)
QUARANTINE_SUFFIX = ".incomplete"
QUARANTINED_RE = re.compile(r"checkpoint-[0-9]+\.incomplete(\.[0-9]+)?", re.ASCII)
SUPERSEDED_SUFFIX = ".superseded-"
SUPERSEDED_RE = re.compile(r"checkpoint-([0-9]+)\.superseded-([0-9]+)", re.ASCII)
DELETING_PREFIX = ".slurm-jit-deleting-"  # a checkpoint being deleted: out of every checkpoint-* pattern first

# Which rank wrote a DeepSpeed/Trainer checkpoint file: ZeRO's per-rank shards and the Trainer's per-rank RNG
# state name it; the rest (model states of ZeRO-1/2, scheduler, trainer state, config) rank 0 writes.
WRITER_RANK_RE = re.compile(r"(?:zero_pp_rank|rng_state)_(\d+)(?:_|\.)")

SUPERSEDED_WHAT = "a complete checkpoint replaced by a later save of step {step}; never resumed"
QUARANTINED_WHAT = "set aside as not resumable (incomplete or corrupt); never resumed"


@dataclass(frozen=True, kw_only=True)
class SetAside:
    """A directory set aside under a name of its own (never a resume point)."""

    name: str  # the directory's name in the output directory
    kind: str  # "superseded" or "incomplete"
    what: str  # in words, for ckpt-check


def is_set_aside(name: str) -> bool:
    """Whether ``name`` is a checkpoint set aside (quarantined or superseded), not a ``checkpoint-<step>``."""
    return QUARANTINED_RE.fullmatch(name) is not None or SUPERSEDED_RE.fullmatch(name) is not None


def quarantine_path(ckpt_dir: Path) -> Path:
    """``checkpoint-<step>.incomplete``, or ``.incomplete.N`` when that name is taken."""
    target = ckpt_dir.with_name(ckpt_dir.name + QUARANTINE_SUFFIX)
    n = 1
    while os.path.lexists(target):
        target = ckpt_dir.with_name(f"{ckpt_dir.name}{QUARANTINE_SUFFIX}.{n}")
        n += 1
    return target


def superseded_path(ckpt_dir: Path) -> Path:
    """``checkpoint-<step>.superseded-<seq>``, ``seq`` one past the highest taken (1 for the first), so that the
    numbers keep the order they were set aside in even after one of them was deleted."""
    prefix = f"{ckpt_dir.name}{SUPERSEDED_SUFFIX}"
    taken = [int(m.group(2)) for name in os.listdir(ckpt_dir.parent)
             if name.startswith(prefix) and (m := SUPERSEDED_RE.fullmatch(name)) is not None
             and len(m.group(2)) <= MAX_STEP_DIGITS]  # int() refuses over 4300 digits
    seq = max(taken, default=0) + 1
    while os.path.lexists(target := ckpt_dir.with_name(f"{prefix}{seq}")):  # one set aside since the listing
        seq += 1
    return target


def _listing_order(name: str) -> tuple[tuple[int, str], int, tuple[int, str]]:
    """Step, superseded before quarantined, then the number in numeric order (``-2`` before ``-10``), compared
    as (length, digits): no int() of a name's digits, however many."""
    superseded = SUPERSEDED_RE.fullmatch(name)
    if superseded is not None:
        step, kind, number = superseded.group(1), 0, superseded.group(2)
    else:
        step, _, number = name.removeprefix("checkpoint-").partition(QUARANTINE_SUFFIX)
        kind, number = 1, number.lstrip(".")
    return (len(step.lstrip("0")), step.lstrip("0")), kind, (len(number.lstrip("0")), number.lstrip("0"))


def set_aside(out_dir: str | os.PathLike[str]) -> list[SetAside]:
    """The directories set aside in ``out_dir``, by name. Raises OSError when it cannot be listed."""
    found = []
    for name in sorted((n for n in os.listdir(out_dir) if is_set_aside(n)), key=_listing_order):
        superseded = SUPERSEDED_RE.fullmatch(name)
        if superseded is not None:
            what = SUPERSEDED_WHAT.format(step=superseded.group(1))
            found.append(SetAside(name=name, kind="superseded", what=what))
        elif QUARANTINED_RE.fullmatch(name):
            found.append(SetAside(name=name, kind="incomplete", what=QUARANTINED_WHAT))
    return found


def writer_rank(rel: str) -> int:
    """The rank that writes (and on a resume, first reads) a checkpoint file, from its name."""
    match = WRITER_RANK_RE.search(rel.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else 0
