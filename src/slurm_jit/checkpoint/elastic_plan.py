"""What resuming a checkpoint on N ranks takes: directly, after a conversion to DeepSpeed's universal format, or
not at all (with the reason). Pure reads of the manifest; ``ckpt-check --world-size`` and the JitTrainer
(``train/elastic.py``, which converts) both ask it.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.checkpoint import protocol, structure

UNIVERSAL_DIR_NAME = structure.UNIVERSAL_DIR_NAME  # inside checkpoint-S: rotation deletes it with its checkpoint
UNIVERSAL_OF_KEY = "universal_of_world_size"  # in the universal copy's manifest: the ranks that wrote the shards
# ... and the DeepSpeed version that converted them: the universal layout is that converter's, so a copy made by
# another version (a DeepSpeed upgrade between requeues) is converted again rather than loaded.
CONVERTER_VERSION_KEY = "deepspeed_version"
# ... and what it was converted from: a digest of the parent manifest's content fields (every file's size and
# checksum, step, world size, ZeRO stage, tag, weights layout). Another run's checkpoint of the same step copied
# over the directory (an rsync of checkpoint-S) changes it even where trainer_state.json is byte-identical (runs
# that differ only in learning rate, logging every 500 steps), so a copy converted from the old one is redone.
CONVERTED_FROM_KEY = "converted_from_xxh3_128"
PARENT_CONTENT_KEYS = ("files", "step", "world_size", "zero_stage", "deepspeed_tag", "weights")
# ZeRO stages whose optimizer state is partitioned over the ranks: ds_to_universal handles 1 and 2 through
# DeepSpeedCheckpoint and 3 through its own path; the JitTrainer verifies all three element for element
# (tests: test_elastic.py).
CONVERTIBLE_STAGES = (1, 2, 3)
UNCONVERTED_STAGES: dict[int, str] = {}
DIRECT, CONVERT, CONVERTED, SAME, REFUSED = "direct", "convert", "converted", "same", "refused"
# The samples per optimizer step of the run that wrote a checkpoint (per-device batch x gradient accumulation x
# world size), in its manifest (train/keep_batch.py): on another world size the JitTrainer keeps them by setting
# the accumulation, possible only on a world size that divides them
SAMPLES_KEY = "samples_per_step"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What resuming one checkpoint on ``world_size`` ranks takes."""

    action: str  # SAME, DIRECT (no partitioned state), CONVERT, CONVERTED (universal copy complete), REFUSED
    written_by: int | None  # the world size in the manifest (None: no manifest, or it does not say)
    world_size: int  # the ranks of the run that resumes
    zero_stage: int | None  # from the manifest
    reason: str  # one line: what will be done, or why not (with a HINT)

    @property
    def resumable(self) -> bool:
        return self.action != REFUSED


def universal_dir(ckpt_dir: str | os.PathLike[str]) -> Path:
    return Path(ckpt_dir) / UNIVERSAL_DIR_NAME


def plan(ckpt_dir: str | os.PathLike[str], world_size: int, manifest: dict[str, Any] | None = None,
         check_batch: bool = False) -> Plan:
    """What a resume of ``ckpt_dir`` on ``world_size`` ranks takes (the manifest is read when not given).
    ``check_batch`` (ckpt-check, the launcher's gate): also refused where the recorded samples per optimizer step
    do not divide by ``world_size`` (the JitTrainer checks them itself, naming the per-device batches)."""
    path = Path(ckpt_dir)
    if manifest is None and (path / protocol.MANIFEST_NAME).is_file():
        manifest, _ = manifest_file.read(path)
    written_by = _written_by(path, manifest)
    stage = manifest.get("zero_stage") if manifest is not None else None
    stage = stage if manifest_file.plain_int(stage) else None

    def made(action: str, reason: str) -> Plan:
        return Plan(action=action, written_by=written_by, world_size=world_size, zero_stage=stage, reason=reason)

    if written_by is None or written_by == world_size:
        return made(SAME, "same world size: resumes directly")
    change = f"written by {written_by} ranks, resumed on {world_size}"
    samples = recorded_samples(manifest) if manifest is not None and check_batch else None
    if samples is not None and samples % world_size:
        return made(REFUSED, f"{path}: {change}: {samples} samples per optimizer step when written, which no "
                    f"per-device batch and gradient accumulation keep on {world_size} ranks (the JitTrainer would "
                    f"refuse it). HINT: {no_batch_hint(samples, world_size)}")
    deepspeed = manifest.get("deepspeed_tag") is not None if manifest is not None else structure.has_deepspeed(path)
    if not deepspeed or stage == 0:
        return made(DIRECT, f"{change}: no ZeRO-partitioned state, loads directly (per-rank RNG "
                    "streams are not carried over)")
    if stage is None:
        return made(REFUSED, f"{path}: {change}: a DeepSpeed checkpoint whose ZeRO stage no manifest records "
                    f"(its shards may be partitioned over {written_by} ranks). HINT: resume with {written_by} ranks")
    if stage in UNCONVERTED_STAGES:
        return made(REFUSED, f"{path}: {change}: {UNCONVERTED_STAGES[stage]} cannot be resumed on "
                    f"another world size. HINT: resume with {written_by} ranks")
    if stage not in CONVERTIBLE_STAGES:
        return made(REFUSED, f"{path}: {change}: unknown ZeRO stage {stage!r}. HINT: resume with "
                    f"{written_by} ranks")
    step = int(manifest["step"]) if manifest is not None else 0
    if universal_complete(path, step):
        return made(CONVERTED, f"{change}: ZeRO-{stage} shards already converted to DeepSpeed's "
                    f"universal format in {universal_dir(path)}: loads from there")
    return made(CONVERT, f"{change}: ZeRO-{stage} shards will be converted once to DeepSpeed's "
                f"universal format ({universal_dir(path)}) and loaded from there")


def recorded_samples(manifest: dict[str, Any]) -> int | None:
    """The samples per optimizer step a manifest records (SAMPLES_KEY); None in a manifest without them (an older
    version's) or with a value that is not a positive whole number."""
    value = manifest.get(SAMPLES_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def no_batch_hint(samples: int, world_size: int) -> str:
    """The HINT for ``samples`` per optimizer step on ``world_size`` ranks that do not divide them."""
    sizes = ", ".join(str(n) for n in divisors(samples))
    return (f"no per-device batch does on {world_size} ranks: resume on a number of ranks that divides {samples} "
            f"({sizes})")


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending (up to its square root and their pairs: a manifest's number may be big)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _written_by(path: Path, manifest: dict[str, Any] | None) -> int | None:
    """The manifest's world size; without one (no manifest, or a manifest that does not say) the files'."""
    recorded = manifest.get("world_size") if manifest is not None else None
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        return recorded
    try:
        return structure.world_size(path)[0]
    except OSError:
        return None


def universal_complete(ckpt_dir: Path, step: int) -> bool:
    """The protocol's verdict on ``checkpoint-S/universal``: no sentinel, and its manifest verifies."""
    target = universal_dir(ckpt_dir)
    if target.is_symlink() or not target.is_dir() or os.path.lexists(target / protocol.SENTINEL_NAME):
        return False
    manifest, _ = manifest_file.read(target)
    if manifest is None or manifest.get(UNIVERSAL_OF_KEY) is None:
        return False
    installed = converter_version()
    if installed is not None and manifest.get(CONVERTER_VERSION_KEY) != installed:
        return False
    if not _converted_from(ckpt_dir, manifest):
        return False
    return manifest_file.verify(target, step, manifest, deep=False, progress=None) is None


def _converted_from(ckpt_dir: Path, universal_manifest: dict[str, Any]) -> bool:
    """The copy was converted from this very checkpoint: the digest it records is that of ``ckpt_dir``'s manifest
    now (:func:`parent_digest`). A missing or garbage record, or no readable parent manifest, is not a match."""
    parent, _ = manifest_file.read(ckpt_dir)
    if parent is None:
        return False
    recorded = universal_manifest.get(CONVERTED_FROM_KEY)
    return isinstance(recorded, str) and recorded == parent_digest(parent)


def parent_digest(parent_manifest: dict[str, Any]) -> str:
    """xxh3-128 of the parent manifest's content fields (PARENT_CONTENT_KEYS) as canonical JSON: what a universal
    copy records at conversion and is compared with before it is reused."""
    content = {key: parent_manifest.get(key) for key in PARENT_CONTENT_KEYS}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=repr)
    return xxhash.xxh3_128_hexdigest(text.encode("ascii"))


def converter_version() -> str | None:
    """The installed DeepSpeed's version (its converter's), None where it is not installed (a login node's
    ckpt-check: a complete copy is then taken as it is)."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None
