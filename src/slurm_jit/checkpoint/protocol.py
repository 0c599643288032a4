"""The checkpoint completeness protocol: the one definition of "a complete checkpoint".

A checkpoint is a ``checkpoint-<step>`` directory laid out as the HF Trainer lays it out (with the DeepSpeed
tag directory, e.g. ``global_step10/``, inside when DeepSpeed is on). Writing one:

1. Global rank 0 creates the sentinel ``checkpoint-is-incomplete.txt`` (the name transformers uses), fsyncs it
   and the directory, before any rank writes a byte of the checkpoint.
2. Every rank writes its files and fsyncs them; then all ranks meet at a barrier.
3. Rank 0 writes the manifest ``slurm-jit-manifest.json`` last: every file with its size and xxh3-128 checksum,
   plus step, world size, ZeRO stage, DeepSpeed tag, kind (jit / periodic / final) and format version; through
   a temporary file, fsync, atomic rename and an fsync of the directory.
4. Rank 0 removes the sentinel and fsyncs the directory.

Reading one gives a :class:`Status` (only ``complete`` and ``unverified`` are resumable):

- ``complete``: no sentinel, manifest verified (sizes; checksums too with ``deep``; see
  :mod:`slurm_jit.checkpoint.manifest`) and structurally whole (:mod:`slurm_jit.checkpoint.structure`).
- ``unverified``: no manifest (written by a plain ``Trainer``) but structurally whole.
- ``model-only``: whole weights and no optimizer/RNG state at all (``save_only_model``): never resumed.
- ``incomplete``: sentinel present, or files a resume needs missing (with or without a manifest).
- ``corrupt``: a listed file missing, resized, not a regular file, (deep) with the wrong checksum, or escaping the
  directory; manifest, ``trainer_state.json`` and the DeepSpeed tag disagreeing on the step.

"Newest" is the checkpoint written last, not the highest step: resume and rotation (:func:`rotation_victims`)
both go by it. Among checkpoints whose verified manifests carry a ``save_seq`` (one more than the highest in the
output directory when each was written) the sequence decides, so that a node whose clock is ahead or behind, or a
clock stepped back, cannot reorder them; the others are placed by :attr:`CheckpointInfo.written_at` (the
manifest's ``created``, else the directory's mtime).

Nothing is ever unpickled to check it: checkpoint files are untrusted input (see :mod:`slurm_jit.checkpoint.formats`).

This module reads (:func:`inspect`, :func:`scan`, :func:`find_resumable`) and is the one place the trainer,
ckpt-check, the launchers and the tests import the protocol from: its parts live in :mod:`~.names` (directory
names, the set-aside ones), :mod:`~.verdict` (the verdict types, "newest"), :mod:`~.writing` (the four steps) and
:mod:`~.housekeeping` (rotation, deletion), and are re-exported here. Quarantine stays here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurm_jit.checkpoint import formats, structure
from slurm_jit.checkpoint import manifest as manifest_mod

# Re-exported: the protocol's names, used by the trainer, ckpt-check, the launchers and the tests through here.
from slurm_jit.checkpoint.housekeeping import (  # noqa: F401
    delete_checkpoint,
    remove_deletion_leftovers,
    rotation_victims,
)
from slurm_jit.checkpoint.manifest import (  # noqa: F401
    CONTENTS,
    CONTENTS_FULL,
    CONTENTS_MODEL_ONLY,
    FORMAT_VERSION,
    FROZEN_LEFT_OUT,
    HASH_NAME,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MASTER_ONLY,
    TRAINER_STATE_NAME,
    WEIGHTS_FROZEN_EXCLUDED,
    WEIGHTS_FROZEN_EXCLUDED_MASTER_ONLY,
    WEIGHTS_FULL,
    WEIGHTS_LAYOUTS,
    WEIGHTS_MASTER_ONLY,
    hash_file,
)
from slurm_jit.checkpoint.names import (  # noqa: F401
    CHECKPOINT_RE,
    DELETING_PREFIX,
    MAX_STEP_DIGITS,
    QUARANTINE_SUFFIX,
    QUARANTINED_RE,
    SENTINEL_NAME,
    SUPERSEDED_RE,
    SUPERSEDED_SUFFIX,
    SetAside,
    is_set_aside,
    quarantine_path,
    set_aside,
    superseded_path,
)
from slurm_jit.checkpoint.verdict import (  # noqa: F401
    WHOLE_STATUSES,
    CheckpointInfo,
    Resolution,
    Status,
    newest_written_first,
)
from slurm_jit.checkpoint.writing import (  # noqa: F401
    SAVE_KINDS,
    ProtocolError,
    file_entries,
    fsync_dir,
    fsync_tree,
    next_save_seq,
    payload_files,
    write_manifest,
    write_sentinel,
)

SHOWN_VALUE_CHARS = 40  # of a value from a checkpoint file, in a reason


class QuarantineError(OSError):
    """A rename of :func:`quarantine` failed; ``moved`` says what was renamed before it (nothing is deleted)."""

    def __init__(self, src: Path, dst: Path, cause: OSError, moved: list[tuple[Path, Path]]) -> None:
        super().__init__(cause.errno, cause.strerror, str(src))
        self.src, self.dst, self.moved = src, dst, moved


def _raise(exc: OSError) -> None:
    raise exc


def _present(path: Path) -> bool:
    """Whether ``path`` exists (a link is not followed); raises OSError when that cannot be told (EACCES)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def _tree_size(directory: Path) -> int:
    """Bytes of the regular files under ``directory``, each inode once (the universal/ copy of an elastic resume
    hard-links the Trainer's files: they take their space once)."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for root, _dirs, files in formats.walk(directory, onerror=_raise):  # symlinked dirs are not followed
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _check_trainer_state(ckpt_dir: Path, step: int) -> str | None:
    path = ckpt_dir / TRAINER_STATE_NAME
    try:
        if os.lstat(path).st_size > formats.JSON_MAX_BYTES:  # a long run's log history: scanned, not built
            found = formats.top_level_value(path, "global_step", formats.TRAINER_STATE_MAX_BYTES)
        else:
            state = formats.load_json(path)
            found = state.get("global_step") if isinstance(state, dict) else None
    except (OSError, ValueError, RecursionError) as exc:
        return f"{TRAINER_STATE_NAME} unreadable: {type(exc).__name__}: {exc}"
    if not manifest_mod.plain_int(found) or found != step:
        return f"{TRAINER_STATE_NAME} global_step {_short(found)} != directory step {step}"
    return None


def _short(value: object) -> str:
    """A value read from an untrusted file, as shown in a reason (a 400-digit number is cut)."""
    text = repr(value)
    return text if len(text) <= SHOWN_VALUE_CHARS else f"{text[:SHOWN_VALUE_CHARS]}... ({len(text)} chars)"


def inspect(
    ckpt_dir: str | os.PathLike[str],
    step: int,
    deep: bool = False,
    progress: Callable[[int], None] | None = None,
) -> CheckpointInfo:
    """The status of one ``checkpoint-<step>`` directory; a check that fails in an unforeseen way is ``corrupt``.

    Raises OSError only for I/O errors (permission denied, a vanished directory); a file that must not be read
    (FIFO, socket, device, symlink, over a size cap) gives a status and a reason.
    """
    path = Path(ckpt_dir)
    try:
        return _inspect(path, step, deep, progress)
    except formats.UntrustedFile as exc:
        mtime = _dir_mtime(path)
        return CheckpointInfo(path=path, step=step, status=Status.CORRUPT, reason=f"untrusted file: {exc}",
                              size_bytes=_tree_size_or_none(path), mtime=mtime, written_at=mtime)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - untrusted input must give a verdict, never crash the gate
        mtime = _dir_mtime(path)
        return CheckpointInfo(path=path, step=step, status=Status.CORRUPT,
                              reason=f"could not be checked: {type(exc).__name__}: {exc}",
                              size_bytes=_tree_size_or_none(path), mtime=mtime, written_at=mtime)


def _dir_mtime(path: Path) -> float:
    """The directory's own mtime (not followed), 0.0 when it cannot be read."""
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _tree_size_or_none(path: Path) -> int | None:
    try:
        return _tree_size(path)
    except Exception:  # noqa: BLE001 - the size is for display only
        return None


def _inspect(path: Path, step: int, deep: bool, progress: Callable[[int], None] | None) -> CheckpointInfo:
    mtime = _dir_mtime(path)

    def info(status: Status, reason: str, manifest: dict[str, Any] | None = None) -> CheckpointInfo:
        kind = run_id = world = seq = stage = weights = None
        written_at = mtime
        if manifest is not None:
            kind = manifest.get("kind") if isinstance(manifest.get("kind"), str) else None
        if manifest is not None and status in WHOLE_STATUSES:  # only a verified manifest is believed
            run_id = manifest.get("run_id") if isinstance(manifest.get("run_id"), str) else None
            world = manifest.get("world_size")
            written_at = manifest_mod.created(manifest) or mtime
            seq = manifest_mod.save_seq(manifest)
            stage = manifest.get("zero_stage") if manifest_mod.plain_int(manifest.get("zero_stage")) else None
            weights = manifest_mod.weights_layout(manifest)
        return CheckpointInfo(path=path, step=step, status=status, reason=reason, kind=kind,
                              size_bytes=_tree_size_or_none(path), mtime=mtime, written_at=written_at,
                              run_id=run_id, world_size=world, save_seq=seq, zero_stage=stage, weights=weights)

    if not stat.S_ISDIR(os.lstat(path).st_mode):
        return info(Status.CORRUPT, "the checkpoint directory is a symlink: not trusted")
    if _present(path / SENTINEL_NAME):
        return info(Status.INCOMPLETE, f"{SENTINEL_NAME} present: the save did not finish")
    if _present(path / MANIFEST_NAME):
        manifest, why = manifest_mod.read(path)
        if manifest is None:
            return info(Status.CORRUPT, why or "manifest unusable")
        why = (manifest_mod.verify(path, step, manifest, deep, progress) or _check_trainer_state(path, step)
               or structure.tag_mismatch(path, step))
        if why:
            return info(Status.CORRUPT, why, manifest)
        return _structural(path, step, manifest, info)
    if not _present(path / TRAINER_STATE_NAME):
        return info(Status.INCOMPLETE, f"no manifest and no {TRAINER_STATE_NAME}")
    why = _check_trainer_state(path, step) or structure.tag_mismatch(path, step)
    if why:
        return info(Status.CORRUPT, why)
    return _structural(path, step, None, info)


def _structural(path: Path, step: int, manifest: dict[str, Any] | None,
                info: Callable[..., CheckpointInfo]) -> CheckpointInfo:
    """The verdict on a checkpoint whose manifest (if any) and trainer state are fine: can it be resumed?"""
    recorded_world = manifest.get("world_size") if manifest is not None else None
    recorded_stage = manifest.get("zero_stage") if manifest is not None else None
    missing = structure.check(path, recorded_world, recorded_stage if manifest_mod.plain_int(recorded_stage) else None)
    if missing is None:
        if manifest is None:
            return info(Status.UNVERIFIED, "no manifest (plain Trainer save); structure whole")
        return info(Status.COMPLETE, "", manifest)
    if structure.model_only(path):
        declared = manifest is not None and manifest.get("contents") == CONTENTS_MODEL_ONLY
        why = "save_only_model checkpoint" if declared else f"weights only ({missing})"
        adapters = manifest is not None and manifest_mod.weights_layout(manifest) in FROZEN_LEFT_OUT
        what = "adapter weights (PEFT)" if adapters else "model weights whole"
        return info(Status.MODEL_ONLY, f"{why}: {what}, no optimizer/RNG state to resume", manifest)
    if manifest is None:
        return info(Status.INCOMPLETE, f"no manifest; {missing}")
    return info(Status.INCOMPLETE, f"manifest verified but {missing}: cannot be resumed", manifest)


def scan(out_dir: str | os.PathLike[str], deep: bool = False,
         progress: Callable[[int], None] | None = None) -> tuple[list[CheckpointInfo], list[str]]:
    """(checkpoint directories newest written first, names ignored). Raises OSError when out_dir is unreadable."""
    root = Path(out_dir)
    found: list[CheckpointInfo] = []
    ignored: list[str] = []
    for name in sorted(os.listdir(root)):
        match = CHECKPOINT_RE.fullmatch(name)
        if match is not None and len(match.group(1)) > MAX_STEP_DIGITS:
            ignored.append(f"checkpoint-<{len(match.group(1))} digits>: step out of range")
            continue
        if match is None:
            if name.startswith("checkpoint-") and not is_set_aside(name):
                ignored.append(f"{name}: not checkpoint-<step>")
            continue
        entry = root / name
        if not entry.is_symlink() and not entry.is_dir():
            ignored.append(f"{name}: not a directory")
            continue
        try:
            found.append(inspect(entry, int(match.group(1)), deep=deep, progress=progress))
        except (FileNotFoundError, NotADirectoryError):
            if os.path.lexists(entry):
                raise
            ignored.append(f"{name}: vanished while being checked (deleted or renamed by another process)")
    return newest_written_first(found), ignored


def find_resumable(out_dir: str | os.PathLike[str], strict: bool = False, deep: bool = False,
                   progress: Callable[[int], None] | None = None) -> Resolution:
    """The most recently written resumable checkpoint under ``out_dir``, and why every checkpoint written after
    it was passed over. The step number does not decide: after a rollback, or in a directory shared by several
    runs, the checkpoint written last is the one to continue from.

    Raises OSError when ``out_dir`` cannot be listed; a missing ``out_dir`` means a fresh start.
    """
    if not _present(Path(out_dir)):  # EACCES on the way is an error, not a fresh start
        return Resolution(checkpoint=None, passed_over=[], checkpoints=[])
    checkpoints, ignored = scan(out_dir, deep=deep, progress=progress)
    aside = set_aside(out_dir)
    passed_over: list[CheckpointInfo] = []
    for ckpt in checkpoints:
        if ckpt.resumable(strict):
            return Resolution(checkpoint=ckpt, passed_over=passed_over, checkpoints=checkpoints, ignored=ignored,
                              set_aside=aside)
        passed_over.append(ckpt)
    return Resolution(checkpoint=None, passed_over=passed_over, checkpoints=checkpoints, ignored=ignored,
                      set_aside=aside)


def set_aside_replaced(ckpt_dir: Path) -> Path:
    """Rename ``checkpoint-<step>`` out of the way of a new save of the same step, durably, and return where it
    went: ``checkpoint-<step>.superseded-<seq>`` when it is whole (a complete checkpoint the new save replaces),
    else ``checkpoint-<step>.incomplete`` (a save that never finished). Never deletes anything."""
    step_match = CHECKPOINT_RE.fullmatch(ckpt_dir.name)
    try:
        whole = step_match is not None and inspect(ckpt_dir, int(step_match.group(1))).status in WHOLE_STATUSES
    except OSError:
        whole = False  # cannot be read: not known to be whole
    target = superseded_path(ckpt_dir) if whole else quarantine_path(ckpt_dir)
    os.rename(ckpt_dir, target)
    fsync_dir(ckpt_dir.parent)
    return target


def quarantine(resolution: Resolution) -> list[tuple[Path, Path]]:
    """Rename every non-resumable directory newer than the resume point; never deletes anything. A model-only
    checkpoint is whole (just not a resume point): it stays where it is."""
    moved: list[tuple[Path, Path]] = []
    for ckpt in resolution.passed_over:
        if ckpt.status is Status.MODEL_ONLY:
            continue
        target = quarantine_path(ckpt.path)
        try:
            os.rename(ckpt.path, target)
        except OSError as exc:
            raise QuarantineError(ckpt.path, target, exc, moved) from None
        moved.append((ckpt.path, target))
    for parent in {src.parent for src, _ in moved}:
        fsync_dir(parent)
    return moved
