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
"""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_jit.checkpoint import formats, structure
from slurm_jit.checkpoint import manifest as manifest_mod
from slurm_jit.checkpoint.manifest import (  # the manifest's names, used by the trainer and the tests through here
    CONTENTS,
    CONTENTS_FULL,
    CONTENTS_MODEL_ONLY,
    FORMAT_VERSION,
    HASH_NAME,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    TRAINER_STATE_NAME,
    WEIGHTS_FROZEN_EXCLUDED,
    WEIGHTS_FULL,
    WEIGHTS_LAYOUTS,
    WEIGHTS_MASTER_ONLY,  # noqa: F401 - re-exported for the trainer and ckpt-check
    hash_file,
)

SENTINEL_NAME = "checkpoint-is-incomplete.txt"  # transformers' own name (trainer_jit_checkpoint.py)
MAX_STEP_DIGITS = 18  # 10**18 steps is beyond any run; int() refuses over 4300 digits (CPython's str limit)
# transformers.trainer_utils uses ^checkpoint-(\d+)$, whose $ also matches before a final newline and whose \d
# matches any Unicode digit; ours is used with fullmatch and ASCII digits only
CHECKPOINT_RE = re.compile(r"checkpoint-([0-9]+)", re.ASCII)
SHOWN_VALUE_CHARS = 40  # of a value from a checkpoint file, in a reason
QUARANTINE_SUFFIX = ".incomplete"
QUARANTINED_RE = re.compile(r"checkpoint-[0-9]+\.incomplete(\.[0-9]+)?", re.ASCII)
SAVE_KINDS = ("jit", "periodic", "final")
DELETING_PREFIX = ".slurm-jit-deleting-"  # a checkpoint being deleted: out of every checkpoint-* pattern first


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


class QuarantineError(OSError):
    """A rename of :func:`quarantine` failed; ``moved`` says what was renamed before it (nothing is deleted)."""

    def __init__(self, src: Path, dst: Path, cause: OSError, moved: list[tuple[Path, Path]]) -> None:
        super().__init__(cause.errno, cause.strerror, str(src))
        self.src, self.dst, self.moved = src, dst, moved


class ProtocolError(RuntimeError):
    """A checkpoint could not be written through the protocol; the message says why."""


# ---------------------------------------------------------------- reading


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
    missing = structure.check(path, recorded_world)
    if missing is None:
        if manifest is None:
            return info(Status.UNVERIFIED, "no manifest (plain Trainer save); structure whole")
        return info(Status.COMPLETE, "", manifest)
    if structure.model_only(path):
        declared = manifest is not None and manifest.get("contents") == CONTENTS_MODEL_ONLY
        why = "save_only_model checkpoint" if declared else f"weights only ({missing})"
        adapters = manifest is not None and manifest_mod.weights_layout(manifest) == WEIGHTS_FROZEN_EXCLUDED
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
            if name.startswith("checkpoint-") and not QUARANTINED_RE.fullmatch(name):
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
    passed_over: list[CheckpointInfo] = []
    for ckpt in checkpoints:
        if ckpt.resumable(strict):
            return Resolution(checkpoint=ckpt, passed_over=passed_over, checkpoints=checkpoints, ignored=ignored)
        passed_over.append(ckpt)
    return Resolution(checkpoint=None, passed_over=passed_over, checkpoints=checkpoints, ignored=ignored)


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


def quarantine_path(ckpt_dir: Path) -> Path:
    """``checkpoint-<step>.incomplete``, or ``.incomplete.N`` when that name is taken."""
    target = ckpt_dir.with_name(ckpt_dir.name + QUARANTINE_SUFFIX)
    n = 1
    while os.path.lexists(target):
        target = ckpt_dir.with_name(f"{ckpt_dir.name}{QUARANTINE_SUFFIX}.{n}")
        n += 1
    return target


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


# ---------------------------------------------------------------- writing


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | os.PathLike[str]) -> None:
    """fsync every regular file and directory under ``directory`` (the files this rank wrote among them)."""
    for root, _dirs, files in formats.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            if stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO would block the open, a symlink leads elsewhere
                with formats.open_regular(path) as handle:
                    os.fsync(handle.fileno())
        fsync_dir(root)


def write_sentinel(ckpt_dir: str | os.PathLike[str], step: int, kind: str) -> None:
    """Step 1: create the directory and the sentinel, durably. Global rank 0 only."""
    path = Path(ckpt_dir)
    path.mkdir(parents=True, exist_ok=True)
    sentinel = path / SENTINEL_NAME
    with open(sentinel, "w", encoding="utf-8") as handle:
        handle.write(f"slurm-jit: {kind} checkpoint of step {step} started at {time.time():.3f}; "
                     "it is not complete until this file is gone and the manifest exists.\n")
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(path)
    fsync_dir(path.parent)


def payload_files(ckpt_dir: str | os.PathLike[str]) -> list[str]:
    """Relative paths of the files a manifest lists: everything but the sentinel and the manifest."""
    root = Path(ckpt_dir)
    rels = []
    for dirpath, _dirs, files in formats.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel not in (SENTINEL_NAME, MANIFEST_NAME) and not name.startswith(f".{MANIFEST_NAME}"):
                rels.append(rel.replace(os.sep, "/"))
    return sorted(rels)


def file_entries(ckpt_dir: str | os.PathLike[str], rels: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Size and checksum of each file: the manifest's ``files`` (ranks may each hash a share)."""
    root = Path(ckpt_dir)
    entries = {}
    for rel in rels:
        path = root / rel
        try:
            entries[rel] = {"size": os.lstat(path).st_size, HASH_NAME: hash_file(path)}
        except formats.UntrustedFile as exc:
            raise ProtocolError(f"{path}: {exc}. HINT: only regular files belong in a checkpoint; remove it (a "
                                "callback's on_save?) and save again") from None
    return entries


def next_save_seq(out_dir: str | os.PathLike[str]) -> int:
    """One more than the highest ``save_seq`` of any readable manifest in a ``checkpoint-*`` directory (quarantined
    ones too) under ``out_dir``; 1 when there is none. Reads only manifests, each bounded."""
    highest = 0
    try:
        names = os.listdir(out_dir)
    except OSError:
        return 1
    for name in names:
        if not name.startswith("checkpoint-") or not structure.real_dir(Path(out_dir) / name):
            continue
        manifest, _ = manifest_mod.read(Path(out_dir) / name)
        seq = manifest_mod.save_seq(manifest) if manifest is not None else None
        highest = max(highest, seq or 0)
    return min(highest + 1, manifest_mod.SAVE_SEQ_MAX)


def write_manifest(
    ckpt_dir: str | os.PathLike[str],
    *,
    step: int,
    kind: str,
    world_size: int,
    zero_stage: int | None,
    deepspeed_tag: str | None,
    files: dict[str, dict[str, Any]],
    contents: str = CONTENTS_FULL,
    run_id: str | None = None,
    weights: str = WEIGHTS_FULL,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Step 3 and 4: write the manifest atomically, then remove the sentinel. Global rank 0 only.

    ``contents``: "full" (everything an exact resume needs) or "model_only" (a save_only_model save: never
    resumed); ``run_id``: the training run's lineage id, shown by ckpt-check; ``weights``: where the module
    weights are ("full"; "fp32-master-only": only in the optimizer shards' fp32 master partitions;
    "frozen-excluded": a PEFT model's, the trainable ones only, the frozen base is the model as built).
    """
    if kind not in SAVE_KINDS:
        raise ProtocolError(f"unknown save kind {kind!r}; expected one of {SAVE_KINDS}")
    if contents not in CONTENTS:
        raise ProtocolError(f"unknown contents {contents!r}; expected one of {CONTENTS}")
    if weights not in WEIGHTS_LAYOUTS:
        raise ProtocolError(f"unknown weights layout {weights!r}; expected one of {WEIGHTS_LAYOUTS}")
    root = Path(ckpt_dir)
    if not (root / SENTINEL_NAME).exists():
        raise ProtocolError(f"{root}: no sentinel; write_sentinel() must run before the checkpoint is written")
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "kind": kind,
        "world_size": world_size,
        "zero_stage": zero_stage,
        "deepspeed_tag": deepspeed_tag,
        "contents": contents,
        "run_id": run_id,
        "weights": weights,
        "hash": HASH_NAME,
        "created": time.time(),
        "save_seq": next_save_seq(root.parent),
        "total_bytes": sum(entry["size"] for entry in files.values()),
        "files": files,
        **(extra or {}),
    }
    tmp = root / f".{MANIFEST_NAME}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(tmp, root / MANIFEST_NAME)
    fsync_dir(root)
    os.remove(root / SENTINEL_NAME)
    fsync_dir(root)
    return manifest
