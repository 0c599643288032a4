"""Elastic resume: a checkpoint written by another number of ranks is resumed through DeepSpeed's universal format.

ZeRO stages 1 and 2 partition the fp32 master weights and the optimizer moments over the data-parallel ranks, and
DeepSpeed refuses to load them on another world size. DeepSpeed 0.19.8 ships the pieces: ``ds_to_universal``
(``deepspeed/checkpoint/ds_to_universal.py``) turns the shards into one file per parameter and state, and the
engine loads that on any world size when its ``load_universal_checkpoint`` is set. Here they are put together:

- :func:`plan` says what a resume of a checkpoint on N ranks takes (directly, after a conversion, or not at all);
  ``ckpt-check --world-size`` and the JitTrainer both ask it.
- :func:`ensure_universal` converts once, crash-safely, into ``checkpoint-S/universal/``, written through the
  checkpoint protocol (sentinel first, manifest last): a conversion killed half-way leaves the original as it was
  and is redone at the next start. The universal directory is a whole Trainer checkpoint (trainer state,
  scheduler, RNG files linked from the original, ``latest_universal``), so the Trainer resumes from it as usual.
- :func:`install_universal_load` sets the engine's ``load_universal_checkpoint`` for the Trainer's one resume load.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.checkpoint import protocol

logger = logging.getLogger(__name__)

UNIVERSAL_DIR_NAME = "universal"  # inside checkpoint-S: rotation deletes it with its checkpoint
LATEST_UNIVERSAL_NAME = "latest_universal"  # engine.load_checkpoint reads the tag here when load_universal is set
# A conversion reads every shard and writes each parameter's states once: seconds for the demo model, minutes for
# billions of parameters. Past this it is taken as hung and the resume is refused (the original stays).
CONVERT_TIMEOUT_S = 3600
CONVERT_OUTPUT_TAIL_CHARS = 400  # of the converter's output, in the refusal when it fails
# ZeRO stages whose optimizer state is partitioned over the ranks: ds_to_universal handles 1 and 2 through
# DeepSpeedCheckpoint and 3 through its own path; the JitTrainer verifies 1 and 2 (tests: test_elastic.py).
CONVERTIBLE_STAGES = (1, 2)
UNCONVERTED_STAGES = {3: "ZeRO-3 (ds_to_universal converts it, but its universal load through the Trainer is not "
                         "verified here)"}
UNIVERSAL_OF_KEY = "universal_of_world_size"  # in the universal copy's manifest: the ranks that wrote the shards
DIRECT, CONVERT, CONVERTED, SAME, REFUSED = "direct", "convert", "converted", "same", "refused"


class ElasticError(RuntimeError):
    """A conversion that failed; the message is one line with a HINT. The original checkpoint is untouched."""


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


def plan(ckpt_dir: str | os.PathLike[str], world_size: int, manifest: dict[str, Any] | None = None) -> Plan:
    """What a resume of ``ckpt_dir`` on ``world_size`` ranks takes (the manifest is read when not given)."""
    path = Path(ckpt_dir)
    if manifest is None and (path / protocol.MANIFEST_NAME).is_file():
        manifest, _ = manifest_file.read(path)
    written_by = manifest.get("world_size") if manifest is not None else None
    stage = manifest.get("zero_stage") if manifest is not None else None
    stage = stage if isinstance(stage, int) else None

    def made(action: str, reason: str) -> Plan:
        return Plan(action=action, written_by=written_by if isinstance(written_by, int) else None,
                    world_size=world_size, zero_stage=stage, reason=reason)

    if not isinstance(written_by, int) or written_by == world_size:
        return made(SAME, "same world size: resumes directly")
    change = f"written by {written_by} ranks, resumed on {world_size}"
    if (manifest is not None and manifest.get("deepspeed_tag") is None) or stage in (None, 0):
        return made(DIRECT, f"{change}: no ZeRO-partitioned state, loads directly (per-rank RNG "
                    "streams are not carried over)")
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


def universal_complete(ckpt_dir: Path, step: int) -> bool:
    """The protocol's verdict on ``checkpoint-S/universal``: no sentinel, and its manifest verifies."""
    target = universal_dir(ckpt_dir)
    if target.is_symlink() or not target.is_dir() or os.path.lexists(target / protocol.SENTINEL_NAME):
        return False
    manifest, _ = manifest_file.read(target)
    if manifest is None or manifest.get(UNIVERSAL_OF_KEY) is None:
        return False
    return manifest_file.verify(target, step, manifest, deep=False, progress=None) is None



def ensure_universal(ckpt_dir: str | os.PathLike[str], manifest: dict[str, Any]) -> tuple[Path, float]:
    """The complete universal copy of ``ckpt_dir`` (converted now unless one exists) and the seconds spent.
    Raises ElasticError (one line, HINT) when the conversion fails; the original is never written."""
    path = Path(ckpt_dir)
    step = int(manifest["step"])
    target = universal_dir(path)
    if universal_complete(path, step):
        return target, 0.0
    started = time.monotonic()
    if os.path.lexists(target):  # a conversion killed half-way: its sentinel is still there
        logger.warning("slurm_jit: removing the unfinished conversion %s and converting again", target)
        _remove(target)
    tag = str(manifest.get("deepspeed_tag") or f"global_step{step}")
    protocol.write_sentinel(target, step, str(manifest.get("kind") or "jit"))
    _convert(path / tag, target / tag)
    _link_trainer_files(path, target)
    (target / LATEST_UNIVERSAL_NAME).write_text(tag, encoding="utf-8")
    protocol.fsync_tree(target)
    files = protocol.file_entries(target, protocol.payload_files(target))
    elapsed_s = time.monotonic() - started
    protocol.write_manifest(
        target, step=step, kind=str(manifest.get("kind") or "jit"), world_size=int(manifest["world_size"]),
        zero_stage=manifest.get("zero_stage"), deepspeed_tag=tag, files=files,
        run_id=manifest.get("run_id") if isinstance(manifest.get("run_id"), str) else None,
        extra={UNIVERSAL_OF_KEY: manifest["world_size"], "convert_s": round(elapsed_s, 3)})
    return target, elapsed_s


def _remove(target: Path) -> None:
    if target.is_symlink() or not target.is_dir():
        target.unlink()
    else:
        shutil.rmtree(target)


def _convert(source: Path, dest: Path) -> None:
    """Run DeepSpeed's converter in a child process (its process pools and prints stay out of the rank)."""
    argv = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
            "--output_folder", str(dest), "--num_extract_workers", "1", "--num_merge_workers", "1",
            "--inject_missing_state"]  # HF models carry no universal-checkpoint info; DeepSpeed's default is fine
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ElasticError(f"{source}: the conversion to DeepSpeed's universal format took over "
                           f"{CONVERT_TIMEOUT_S} s. HINT: resume with the original number of ranks") from None
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])[-CONVERT_OUTPUT_TAIL_CHARS:]
        raise ElasticError(f"{source}: the conversion to DeepSpeed's universal format failed (exit "
                           f"{done.returncode}): {tail}. HINT: resume with the original number of ranks")


def _link_trainer_files(source: Path, dest: Path) -> None:
    """The Trainer's own files (trainer state, scheduler, RNG, config) beside the universal shards: hard links
    where the file system allows (files of a complete checkpoint are never rewritten), copies elsewhere."""
    skip = {protocol.MANIFEST_NAME, protocol.SENTINEL_NAME, "latest"}
    for entry in sorted(source.iterdir()):
        if entry.name in skip or entry.is_symlink() or not entry.is_file():
            continue
        try:
            os.link(entry, dest / entry.name)
        except OSError:
            shutil.copy2(entry, dest / entry.name)


def prepare(ckpt_dir: str, world_size: int, manifest: dict[str, Any]) -> tuple[str | None, str | None]:
    """Rank 0, before the resume: (the directory the Trainer loads from when it is not ``ckpt_dir``, refusal).
    Logs one line when the world size changed; converts when it must."""
    decided = plan(ckpt_dir, world_size, manifest)
    if decided.action == SAME:
        return None, None
    logger.warning("slurm_jit: world size %s -> %d: %s", decided.written_by, world_size, decided.reason)
    if decided.action in (DIRECT, REFUSED):
        return None, None if decided.resumable else decided.reason
    try:
        target, elapsed_s = ensure_universal(ckpt_dir, manifest)
    except (ElasticError, OSError, protocol.ProtocolError) as exc:
        return None, f"{exc}" if isinstance(exc, ElasticError) else (
            f"{ckpt_dir}: converting to DeepSpeed's universal format failed: {exc}. HINT: resume with "
            f"{decided.written_by} ranks; the checkpoint itself is untouched")
    if elapsed_s:
        logger.warning("slurm_jit: converted %s to %s in %.1f s", ckpt_dir, target, elapsed_s)
    return str(target), None


def install_universal_load() -> None:
    """Until the Trainer's next DeepSpeed resume load (or :func:`uninstall_universal_load`), that load reads a
    universal checkpoint: the engine's ``load_universal_checkpoint`` is set for that one load and put back right
    after, so later loads (the best model at the end) are the engine's own kind."""
    import transformers.trainer as hf_trainer

    original = getattr(hf_trainer.deepspeed_load_checkpoint, "slurm_jit_original", hf_trainer.deepspeed_load_checkpoint)

    def load(engine: Any, checkpoint_path: str, load_module_strict: bool = True) -> None:
        hf_trainer.deepspeed_load_checkpoint = original  # once
        config = engine._config
        before = config.load_universal_checkpoint
        config.load_universal_checkpoint = True
        try:
            original(engine, checkpoint_path, load_module_strict=load_module_strict)
        finally:
            config.load_universal_checkpoint = before

    load.slurm_jit_original = original  # type: ignore[attr-defined]
    hf_trainer.deepspeed_load_checkpoint = load


def uninstall_universal_load() -> None:
    import transformers.trainer as hf_trainer

    hf_trainer.deepspeed_load_checkpoint = getattr(hf_trainer.deepspeed_load_checkpoint, "slurm_jit_original",
                                                   hf_trainer.deepspeed_load_checkpoint)
