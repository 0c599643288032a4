"""``ckpt-check --reseal CHECKPOINT``: a new manifest for a checkpoint its owner changed on purpose after it was
written (resharded, converted), so that an explicit ``resume_from_checkpoint=PATH`` takes it again.

The manifest is what makes a checkpoint count; resealing re-measures the files that are there now, so it only
runs on a checkpoint that is structurally whole (:func:`structure.check`: the files its layout needs), that no
live run holds (its output directory's lock is taken for the duration), and that is a real
``checkpoint-<step>`` directory, never a symlink. The old manifest stays beside the new one as
``.slurm-jit-manifest.json.before-reseal-<UTC time>`` (a name the manifest never lists). Every field but the
files, their total, the world size and the DeepSpeed tag is the old manifest's; ``resealed`` says when and from
what. The new manifest must pass :func:`protocol.inspect` or the old one is put back.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.checkpoint import protocol, structure

BACKUP_PREFIX = f".{manifest_file.MANIFEST_NAME}.before-reseal-"  # hidden: payload_files() leaves it out
TIME_FORMAT = "%Y%m%dT%H%M%SZ"
LOCK_HELD_WORDS = " is in use by "  # in the lock's refusal when a run holds the output directory (not an I/O error)


class DirLock(Protocol):
    """The output directory's lock (train/output_lock.py, the one definition of "a live run holds this
    output_dir"), handed in by the ``ckpt-check`` command: checkpoint/ never imports train/."""

    def acquire(self, output_dir: str | os.PathLike[str], /) -> tuple[Any | None, str | None]: ...

    def release(self, lock: Any, /) -> None: ...


class ResealRefusal(Exception):
    """The checkpoint was not resealed (nothing changed on disk); the message is one line with a HINT."""


@dataclass(frozen=True)
class Resealed:
    path: Path
    files: int
    total_bytes: int
    backup: Path | None  # None: the manifest already matched the files, nothing was written


def _refuse(path: Path, why: str, hint: str) -> ResealRefusal:
    return ResealRefusal(f"{path}: {why}: not resealed. HINT: {hint}")


def _step_of(path: Path) -> int:
    """The step of a real ``checkpoint-<step>`` directory, or ResealRefusal."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise _refuse(path, "no such checkpoint directory", "pass a checkpoint-<step> directory") from None
    if stat.S_ISLNK(mode):
        raise _refuse(path, "a symlink", "pass the checkpoint directory itself (realpath), not a link to it")
    if not stat.S_ISDIR(mode):
        raise _refuse(path, "not a directory", "pass a checkpoint-<step> directory")
    if protocol.CHECKPOINT_RE.fullmatch(path.name.partition(protocol.QUARANTINE_SUFFIX)[0]) and \
            protocol.QUARANTINE_SUFFIX in path.name:
        raise _refuse(path, "quarantined (ckpt-check --quarantine found it not resumable)", "resume from the "
                      "checkpoint `ckpt-check OUT_DIR` names; a checkpoint found broken is never resealed")
    superseded = protocol.SUPERSEDED_RE.fullmatch(path.name)
    if superseded is not None:
        raise _refuse(path, f"superseded (a later save of step {superseded.group(1)} replaced it; kept as it was)",
                      "resume from the checkpoint `ckpt-check OUT_DIR` names; a copy set aside is never resealed")
    match = protocol.CHECKPOINT_RE.fullmatch(path.name)
    if match is None or len(match.group(1)) > protocol.MAX_STEP_DIGITS:
        raise _refuse(path, "not named checkpoint-<step>", "rename it checkpoint-<step> (its trainer_state's "
                      "global_step) inside the run's output_dir first")
    return int(match.group(1))


def _old_manifest(path: Path) -> dict[str, Any]:
    if os.path.lexists(path / protocol.SENTINEL_NAME):
        raise _refuse(path, f"{protocol.SENTINEL_NAME} present (a save that did not finish, or one running)",
                      "resume from the checkpoint `ckpt-check OUT_DIR` names; an unfinished save is never sealed")
    if not os.path.lexists(path / protocol.MANIFEST_NAME):
        raise _refuse(path, "no manifest to reseal", "a manifest-less checkpoint is resumed as unverified as it "
                      "is (`ckpt-check OUT_DIR` says so)")
    manifest, why = manifest_file.read(path)
    if manifest is None:
        raise _refuse(path, why or "manifest unusable", "restore the manifest the save wrote (a backup?), or "
                      "resume from another checkpoint")
    return manifest


def _structure(path: Path, step: int) -> tuple[int, str | None]:
    """(world size, DeepSpeed tag) of a checkpoint that holds what a resume needs, or ResealRefusal."""
    missing = structure.check(path) or structure.tag_mismatch(path, step)
    if missing:
        raise _refuse(path, f"not structurally complete ({missing})", "finish the change (every rank's shards, "
                      "RNG states, 'latest'), then reseal; or resume from another checkpoint")
    world, why = structure.world_size(path)
    if world is None:
        raise _refuse(path, f"no world size ({why})", "finish the change, then reseal")
    tag = structure.read_latest(path)[0] if structure.has_deepspeed(path) else None
    return world, tag


def _new_manifest(old: dict[str, Any], files: dict[str, dict[str, Any]], world: int, tag: str | None,
                  backup: Path, now: float) -> dict[str, Any]:
    resealed = {"at": now, "previous_manifest": backup.name,
                "previous_world_size": old.get("world_size"), "previous_total_bytes": old.get("total_bytes")}
    return {**old, "version": manifest_file.FORMAT_VERSION, "world_size": world, "deepspeed_tag": tag,
            "files": files, "total_bytes": sum(entry["size"] for entry in files.values()), "resealed": resealed}


def _write(path: Path, manifest: dict[str, Any]) -> None:
    """Atomically: a reader sees the old manifest or the new one, never a part; no partial file left behind."""
    tmp = path / f".{protocol.MANIFEST_NAME}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(manifest, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(tmp, path / protocol.MANIFEST_NAME)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    protocol.fsync_dir(path)


def _replace_manifest(path: Path, new: dict[str, Any], backup: Path) -> None:
    """The old manifest linked as ``backup``, then the new one in its place; on an OSError before the new one is
    in place (a full disk, a read-only mount, no hard links), the old one alone, as it was, and ResealRefusal."""
    try:
        os.link(path / protocol.MANIFEST_NAME, backup)  # kept: the new manifest replaces the name only
        _write(path, new)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(backup)  # the old manifest is still under its own name
        raise _refuse(path, f"the new manifest could not be written ({exc.strerror or exc}); the old one is "
                      "unchanged", "free space on its file system, or make the checkpoint directory writable "
                      "(a read-only mount?), then reseal") from None


def _seal(path: Path, step: int, now: float) -> Resealed:
    old = _old_manifest(path)
    world, tag = _structure(path, step)
    files = protocol.file_entries(path, protocol.payload_files(path))  # every byte read once, here
    if (files, world, tag) == (old["files"], old.get("world_size"), old.get("deepspeed_tag")):
        return Resealed(path, len(files), sum(entry["size"] for entry in files.values()), backup=None)
    backup = path / f"{BACKUP_PREFIX}{time.strftime(TIME_FORMAT, time.gmtime(now))}"
    if os.path.lexists(backup):
        raise _refuse(path, f"{backup.name} exists", "wait a second and reseal again")
    new = _new_manifest(old, files, world, tag, backup, now)
    _replace_manifest(path, new, backup)
    after = protocol.inspect(path, step)  # the checksums were just taken: the rest of what "complete" means
    if after.status is not protocol.Status.COMPLETE:
        os.replace(backup, path / protocol.MANIFEST_NAME)  # the old manifest back, as it was
        protocol.fsync_dir(path)
        raise _refuse(path, f"the new manifest does not verify ({after.reason})", "fix what it names, then reseal")
    return Resealed(path, len(files), new["total_bytes"], backup=backup)


def changed_after_manifest(path: Path, manifest: dict[str, Any] | None) -> bool:
    """True when a finished ``checkpoint-<step>``'s files are not the ones its (readable) manifest lists (one
    listed is missing or resized, or one is there that it does not list): a refusal's HINT names
    ``ckpt-check --reseal`` then, for an owner who changed it on purpose."""
    match = protocol.CHECKPOINT_RE.fullmatch(path.name)
    if manifest is None or match is None or os.path.lexists(path / protocol.SENTINEL_NAME):
        return False
    if manifest_file.verify(path, int(match.group(1)), manifest, False, None) is not None:
        return True
    return not set(protocol.payload_files(path)) <= set(manifest["files"])


def reseal(ckpt_dir: str | os.PathLike[str], *, dir_lock: DirLock, now: float | None = None) -> Resealed:
    """Reseal one checkpoint (see the module docstring) while holding ``dir_lock`` on its output directory; raises
    ResealRefusal (one line) and leaves everything as it was when it cannot. OSError propagates (permission
    denied, a full disk) before the manifest is replaced."""
    path = Path(os.path.abspath(ckpt_dir))
    step = _step_of(path)
    lock, why = dir_lock.acquire(path.parent)
    if lock is None:
        reason = (why or "").split(". HINT:")[0]  # the lock's HINT is for a new training, not for a reseal
        if LOCK_HELD_WORDS not in reason:  # not a holder: the lock file cannot be written
            raise _refuse(path, reason, "reseal writes in the output directory (its lock, then the manifest): "
                          "make it writable (a read-only mount?) and free space there, then reseal")
        raise _refuse(path, reason, "reseal once that run has ended (or scancel it); a running training may "
                      "rewrite or delete this checkpoint")
    try:
        return _seal(path, step, time.time() if now is None else now)
    finally:
        dir_lock.release(lock)
