"""Elastic resume: a checkpoint written by another number of ranks is resumed through DeepSpeed's universal format.

ZeRO stages 1 and 2 partition the fp32 master weights and the optimizer moments over the data-parallel ranks, and
DeepSpeed refuses to load them on another world size. DeepSpeed 0.19.8 ships the pieces: ``ds_to_universal``
(``deepspeed/checkpoint/ds_to_universal.py``) turns the shards into one file per parameter and state, and the
engine loads that on any world size when its ``load_universal_checkpoint`` is set. Here they are put together:

- ``checkpoint/elastic_plan.py`` says what a resume on N ranks takes (directly, after a conversion, or not);
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
from pathlib import Path
from typing import Any

from slurm_jit.checkpoint import protocol
from slurm_jit.checkpoint.elastic_plan import (
    CONVERTER_VERSION_KEY,
    DIRECT,
    REFUSED,
    SAME,
    UNIVERSAL_OF_KEY,
    converter_version,
    plan,
    universal_complete,
    universal_dir,
)

logger = logging.getLogger(__name__)

LATEST_UNIVERSAL_NAME = "latest_universal"  # engine.load_checkpoint reads the tag here when load_universal is set
# A conversion reads every shard and writes each parameter's states once: seconds for the demo model, minutes for
# billions of parameters. The other ranks wait for it in a side-group broadcast bounded by the side group's
# timeout; the conversion gets this share of it (the rest: the broadcast of the verdict), and past that it is taken
# as hung and the resume is refused (the original stays).
CONVERT_SHARE_OF_WAIT = 0.9
# Where the engine saves its config (ds_config): the model states (engine._common_checkpoint_state), and rank 0's
# ZeRO shard, named bf16_... under bf16 (engine._get_zero_ckpt_prefix).
DS_CONFIG_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                   "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
CONVERT_OUTPUT_TAIL_CHARS = 400  # of the converter's output, in the refusal when it fails


class ElasticError(RuntimeError):
    """A conversion that failed; the message is one line with a HINT. The original checkpoint is untouched."""


def ensure_universal(ckpt_dir: str | os.PathLike[str], manifest: dict[str, Any], timeout_s: float,
                     written_by: int) -> tuple[Path, float]:
    """The complete universal copy of ``ckpt_dir`` (converted now unless one exists) and the seconds spent;
    ``written_by``: the ranks that wrote the shards (the plan's). Raises ElasticError (one line, HINT) when the
    conversion fails; the original is never written."""
    path = Path(ckpt_dir)
    step = int(manifest["step"])
    target = universal_dir(path)
    if universal_complete(path, step):
        return target, 0.0
    started = time.monotonic()
    if os.path.lexists(target):  # a conversion killed half-way: its sentinel is still there
        logger.warning("slurm_jit: removing the unfinished conversion %s (or one by another DeepSpeed "
                       "version) and converting again", target)
        _remove(target)
    tag = str(manifest.get("deepspeed_tag") or f"global_step{step}")
    protocol.write_sentinel(target, step, str(manifest.get("kind") or "jit"))
    _convert(path / tag, target / tag, timeout_s)
    _link_trainer_files(path, target)
    (target / LATEST_UNIVERSAL_NAME).write_text(tag, encoding="utf-8")
    protocol.fsync_tree(target)
    files = protocol.file_entries(target, protocol.payload_files(target))
    elapsed_s = time.monotonic() - started
    protocol.write_manifest(
        target, step=step, kind=str(manifest.get("kind") or "jit"), world_size=written_by,
        zero_stage=manifest.get("zero_stage"), deepspeed_tag=tag, files=files,
        run_id=manifest.get("run_id") if isinstance(manifest.get("run_id"), str) else None,
        extra={UNIVERSAL_OF_KEY: written_by, CONVERTER_VERSION_KEY: converter_version(),
               "convert_s": round(elapsed_s, 3)})
    return target, elapsed_s


def _remove(target: Path) -> None:
    if target.is_symlink() or not target.is_dir():
        target.unlink()
    else:
        shutil.rmtree(target)


def _convert(source: Path, dest: Path, timeout_s: float) -> None:
    """Run DeepSpeed's converter in a child process (its process pools and prints stay out of the rank)."""
    argv = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
            "--output_folder", str(dest), "--num_extract_workers", "1", "--num_merge_workers", "1",
            "--inject_missing_state"]  # HF models carry no universal-checkpoint info; DeepSpeed's default is fine
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ElasticError(f"{source}: the conversion to DeepSpeed's universal format took over {timeout_s:.0f} s "
                           "(a share of JitConfig.side_group_timeout_s, the other ranks' wait). HINT: raise "
                           "side_group_timeout_s, or resume with the original number of ranks") from None
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


def prepare(ckpt_dir: str, args: Any, manifest: dict[str, Any], wait_s: float) -> tuple[str | None, str | None]:
    """Rank 0, before the resume with ``args`` (TrainingArguments): (the directory the Trainer loads from when it
    is not ``ckpt_dir``, refusal). Logs one line when the world size changed; converts when it must. This run's
    samples per optimizer step (per-device batch x accumulation x world size) must be the checkpoint's. ``wait_s``:
    how long the other ranks wait for the verdict."""
    world_size = int(args.world_size)
    global_batch = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps) * world_size
    decided = plan(ckpt_dir, world_size, manifest)
    if decided.action == SAME:
        return None, None
    logger.warning("slurm_jit: world size %s -> %d: %s", decided.written_by, world_size, decided.reason)
    if decided.action in (DIRECT, REFUSED):
        return None, None if decided.resumable else decided.reason
    written_by = int(decided.written_by or 0)  # not SAME: the plan knows who wrote it
    written_batch = _global_batch(Path(ckpt_dir), manifest, written_by)
    if written_batch is not None and written_batch != global_batch:
        return None, (f"{ckpt_dir}: {written_batch} samples per optimizer step when written, {global_batch} in "
                      "this run: the Trainer skips global_step batches on resume, so the data position (samples "
                      "consumed) and the learning-rate schedule would not carry over. HINT: keep "
                      "per_device_train_batch_size x gradient_accumulation_steps x world size at "
                      f"{written_batch}")
    try:
        target, elapsed_s = ensure_universal(ckpt_dir, manifest, CONVERT_SHARE_OF_WAIT * wait_s, written_by)
    except (ElasticError, OSError, protocol.ProtocolError) as exc:
        return None, f"{exc}" if isinstance(exc, ElasticError) else (
            f"{ckpt_dir}: converting to DeepSpeed's universal format failed: {exc}. HINT: resume with "
            f"{decided.written_by} ranks; the checkpoint itself is untouched")
    if elapsed_s:
        logger.warning("slurm_jit: converted %s to %s in %.1f s", ckpt_dir, target, elapsed_s)
    return str(target), None


def _global_batch(ckpt_dir: Path, manifest: dict[str, Any], written_by: int) -> int | None:
    """Samples per optimizer step of the run that wrote the checkpoint, from the DeepSpeed config the engine saves
    in its model states file and in each ZeRO shard (memory-mapped: no tensor is read); None when it cannot be
    told (then logged: not checked, not refused)."""
    tag_dir = ckpt_dir / str(manifest.get("deepspeed_tag") or "")
    for name in DS_CONFIG_FILES:
        config = _saved_ds_config(tag_dir / name)
        micro = config.get("train_micro_batch_size_per_gpu")
        accum = config.get("gradient_accumulation_steps")
        if isinstance(micro, int) and isinstance(accum, int):
            return micro * accum * written_by
    logger.warning("slurm_jit: %s: the DeepSpeed config it was written with cannot be read: the samples per "
                   "optimizer step are not checked", tag_dir)
    return None


def _saved_ds_config(path: Path) -> dict[str, Any]:
    import torch

    if not path.is_file():
        return {}
    try:
        config = torch.load(path, map_location="cpu", weights_only=False, mmap=True).get("ds_config")
    except Exception:  # noqa: BLE001 - another layout or a newer DeepSpeed: the next file is asked
        return {}
    return config if isinstance(config, dict) else {}


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
