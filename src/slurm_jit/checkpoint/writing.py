"""Writing a checkpoint through the protocol (see :mod:`slurm_jit.checkpoint.protocol` for the four steps): the
sentinel first, the files' sizes and checksums, the manifest last (atomically), then the sentinel's removal; and
the fsyncs that make each step durable before the next one.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slurm_jit.checkpoint import formats, structure
from slurm_jit.checkpoint import manifest as manifest_mod
from slurm_jit.checkpoint.manifest import (
    CONTENTS,
    CONTENTS_FULL,
    FORMAT_VERSION,
    HASH_NAME,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    WEIGHTS_FULL,
    WEIGHTS_LAYOUTS,
    hash_file,
)
from slurm_jit.checkpoint.names import SENTINEL_NAME

SAVE_KINDS = ("jit", "periodic", "final")


class ProtocolError(RuntimeError):
    """A checkpoint could not be written through the protocol; the message says why."""



def fsync_dir(directory: str | os.PathLike[str]) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | os.PathLike[str]) -> None:
    """fsync every regular file and directory under ``directory`` (the files this rank wrote among them).

    A file gone between the listing and its open needs no fsync: another rank's short-lived file (an async save's
    done marker renamed into place, a failed write's test file) is not this rank's to make durable."""
    for root, _dirs, files in formats.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO would block the open, a symlink leads elsewhere
                    with formats.open_regular(path) as handle:
                        os.fsync(handle.fileno())
            except FileNotFoundError:
                continue
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
    "frozen-excluded": a PEFT model's, the trainable ones only, the frozen base is the model as built;
    "frozen-excluded-master-only": both, a PEFT model's JIT save under ZeRO-1/2).
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
