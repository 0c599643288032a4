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
- :func:`install_universal_load` sets the engine's ``load_universal_checkpoint`` for the Trainer's one resume load,
  and after it restores what that load leaves out (``train/elastic_unheld.py``: frozen parameters, buffers).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.checkpoint import protocol
from slurm_jit.checkpoint.elastic_plan import (
    CONVERTED_FROM_KEY,
    CONVERTER_VERSION_KEY,
    DIRECT,
    REFUSED,
    SAME,
    UNIVERSAL_OF_KEY,
    converter_version,
    parent_digest,
    plan,
    recorded_samples,
    universal_complete,
    universal_dir,
)
from slurm_jit.train import elastic_unheld, keep_batch, output_lock

logger = logging.getLogger(__name__)

LATEST_UNIVERSAL_NAME = "latest_universal"  # engine.load_checkpoint reads the tag here when load_universal is set
# A conversion reads every shard and writes each parameter's states once: seconds for the demo model, minutes for
# billions of parameters. It is bounded by JitConfig.convert_timeout_s (past that it is taken as hung and the resume
# is refused; the original stays). The other ranks wait in side-group broadcasts: rank 0 sends one at least every
# HEARTBEAT_SHARE_OF_TIMEOUT x side_group_timeout_s while the converter runs (and at most every HEARTBEAT_MAX_S), so
# that no single wait comes near the side group's timeout however long the conversion takes, and a dead rank 0
# still ends the others' wait within that timeout.
CONVERT_TIMEOUT_S = 3600.0  # the default JitConfig.convert_timeout_s: a hung converter, not a slow one
HEARTBEAT_SHARE_OF_TIMEOUT = 0.25
HEARTBEAT_MAX_S = 10.0
HEARTBEAT = "slurm_jit: converting"  # the first item of a heartbeat broadcast (the verdict is a 3-tuple of others)
# The converter runs ``python -c`` this: it asks the kernel for SIGKILL when its parent (the rank) dies, checks that
# the parent did not die before that, and runs DeepSpeed's converter as its __main__.
CONVERTER_BOOTSTRAP = (
    "import ctypes, os, runpy, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (linux/prctl.h)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('slurm_jit: the rank that started this conversion is gone')\n"
    "sys.argv = [sys.argv[2], *sys.argv[3:]]\n"
    "runpy.run_module('deepspeed.checkpoint.ds_to_universal', run_name='__main__')\n"
)
# Where the engine saves its config (ds_config): the model states (engine._common_checkpoint_state; ZeRO-3 writes
# one per rank), and rank 0's ZeRO shard, named bf16_... under bf16 (engine._get_zero_ckpt_prefix).
DS_CONFIG_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt",
                   "zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
CONVERT_LOCK_NAME = "universal.lock"  # in checkpoint-S, beside universal/ (which a conversion removes and remakes)
CONVERT_POLL_S = 0.1  # how often the rank looks at its converter (and may send a heartbeat)
CONVERT_OUTPUT_TAIL_CHARS = 400  # of the converter's output, in the refusal when it fails
# ZeRO-3 offload (this run's DeepSpeed config): the universal load into offloaded partitions is not verified here
# (test_elastic.py runs ZeRO-3 without offload); stage3_gather_16bit_weights_on_model_save is verified (the 16-bit
# weights file is a Trainer file beside the shards, linked into universal/ and not read by the resume).
ZERO3_OFFLOAD_KEYS = ("offload_optimizer", "offload_param")
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # param_shapes, frozen_param_shapes (ZeRO-3)


class ElasticError(RuntimeError):
    """A conversion that failed; the message is one line with a HINT. The original checkpoint is untouched."""


def ensure_universal(ckpt_dir: str | os.PathLike[str], manifest: dict[str, Any], timeout_s: float,
                     written_by: int, heartbeat: Callable[[float], None] = lambda _s: None) -> tuple[Path, float, int]:
    """The complete universal copy of ``ckpt_dir`` (converted now unless one exists), the seconds spent and the
    bytes the converter wrote (0, 0 when it existed); ``written_by``: the ranks that wrote the shards (the plan's);
    ``heartbeat(elapsed_s)`` is called while the converter runs. Raises ElasticError (one line, HINT) when the
    conversion fails; the original's files are never written (``universal.lock`` is created beside them)."""
    path = Path(ckpt_dir)
    step = int(manifest["step"])
    target = universal_dir(path)
    if universal_complete(path, step):
        return target, 0.0, 0
    with _conversion_lock(path, timeout_s, heartbeat):
        if universal_complete(path, step):  # converted meanwhile by the run that held the lock
            return target, 0.0, 0
        return _convert_locked(path, manifest, timeout_s, written_by, heartbeat)


@contextlib.contextmanager
def _conversion_lock(ckpt_dir: Path, timeout_s: float, heartbeat: Callable[[float], None]) -> Iterator[None]:
    """Held while converting ``ckpt_dir``: another run resuming the same checkpoint (with another output_dir, so
    not excluded by its output lock) waits for it, up to ``timeout_s``, instead of taking its conversion in
    progress for a killed one and removing it. A POSIX lock (output_lock.py says why not flock): the kernel drops it
    with its process. Where the file system cannot lock, the conversion goes on unlocked."""
    lock = ckpt_dir / CONVERT_LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        started = time.monotonic()
        while not _try_lock(fd):
            if time.monotonic() - started > timeout_s:
                raise ElasticError(f"{ckpt_dir}: another process has been converting it to DeepSpeed's universal "
                                   f"format for over {timeout_s:.0f} s (it holds {lock}). HINT: start again once "
                                   "it is done (its copy is then loaded), or resume with the original number of "
                                   "ranks")
            heartbeat(time.monotonic() - started)
            time.sleep(CONVERT_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def _try_lock(fd: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in output_lock.HELD_ERRNOS:
            return False
        if exc.errno not in output_lock.UNSUPPORTED_ERRNOS:
            raise
        logger.warning("slurm_jit: the file system cannot lock (%s): converting without the conversion lock", exc)
    return True


def _convert_locked(path: Path, manifest: dict[str, Any], timeout_s: float, written_by: int,
                    heartbeat: Callable[[float], None]) -> tuple[Path, float, int]:
    step = int(manifest["step"])
    target = universal_dir(path)
    started = time.monotonic()
    if os.path.lexists(target):  # killed half-way (its sentinel is still there), or stale: another DeepSpeed's,
        # or converted from another checkpoint of this step copied over this one (its parent record differs)
        logger.warning("slurm_jit: removing the unfinished conversion %s (or one by another DeepSpeed "
                       "version, or of another checkpoint copied over this one) and converting again", target)
        _remove(target)
    tag = str(manifest.get("deepspeed_tag") or f"global_step{step}")
    protocol.write_sentinel(target, step, str(manifest.get("kind") or "jit"))
    _convert(path / tag, target / tag, timeout_s, heartbeat)
    converted_bytes = sum(f.stat().st_size for f in (target / tag).rglob("*") if f.is_file())
    _link_trainer_files(path, target)
    _check_unchanged(path, manifest)
    (target / LATEST_UNIVERSAL_NAME).write_text(tag, encoding="utf-8")
    protocol.fsync_tree(target)
    files = protocol.file_entries(target, protocol.payload_files(target))
    elapsed_s = time.monotonic() - started
    protocol.write_manifest(
        target, step=step, kind=str(manifest.get("kind") or "jit"), world_size=written_by,
        zero_stage=manifest.get("zero_stage"), deepspeed_tag=tag, files=files,
        run_id=manifest.get("run_id") if isinstance(manifest.get("run_id"), str) else None,
        extra={UNIVERSAL_OF_KEY: written_by, CONVERTER_VERSION_KEY: converter_version(),
               CONVERTED_FROM_KEY: parent_digest(manifest), "convert_s": round(elapsed_s, 3)})
    return target, elapsed_s, converted_bytes


def _check_unchanged(path: Path, manifest: dict[str, Any]) -> None:
    """The checkpoint is still the one whose manifest was read before converting: another copied over it meanwhile
    would leave a conversion of neither (its sentinel stays: it is converted again at the next start)."""
    now, _ = manifest_file.read(path)
    if now is None or parent_digest(now) != parent_digest(manifest):
        raise ElasticError(f"{path}: its manifest changed while it was being converted to DeepSpeed's universal format "
                           "(another checkpoint copied over it?). HINT: start again once the copy is done")


def _remove(target: Path) -> None:
    if target.is_symlink() or not target.is_dir():
        target.unlink()
    else:
        shutil.rmtree(target)


def _convert(source: Path, dest: Path, timeout_s: float, heartbeat: Callable[[float], None]) -> None:
    """Run DeepSpeed's converter in a child process (its process pools and prints stay out of the rank) that the
    kernel kills when the rank dies; ``heartbeat(elapsed_s)`` while it runs."""
    argv = [sys.executable, "-c", CONVERTER_BOOTSTRAP, str(os.getpid()), "ds_to_universal", "--input_folder",
            str(source), "--output_folder", str(dest), "--num_extract_workers", "1", "--num_merge_workers", "1",
            "--inject_missing_state"]  # HF models carry no universal-checkpoint info; DeepSpeed's default is fine
    started = time.monotonic()
    with tempfile.TemporaryFile() as output:  # a file, not a pipe: a chatty converter never blocks on it
        child = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            returncode = _wait(child, started + timeout_s, heartbeat)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        output.seek(0)
        text = output.read().decode("utf-8", "replace")
    if returncode is None:
        raise ElasticError(f"{source}: the conversion to DeepSpeed's universal format took over {timeout_s:.0f} s "
                           "(JitConfig.convert_timeout_s). HINT: raise convert_timeout_s, or resume with the "
                           "original number of ranks")
    if returncode != 0:
        tail = " | ".join(text.strip().splitlines()[-3:])[-CONVERT_OUTPUT_TAIL_CHARS:]
        raise ElasticError(f"{source}: the conversion to DeepSpeed's universal format failed (exit "
                           f"{returncode}): {tail}. HINT: resume with the original number of ranks")


def _wait(child: subprocess.Popen[bytes], deadline: float, heartbeat: Callable[[float], None]) -> int | None:
    """The child's exit code, None past ``deadline``; ``heartbeat`` between polls."""
    started = time.monotonic()
    while True:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            return None
        try:
            return child.wait(timeout=min(left_s, CONVERT_POLL_S))
        except subprocess.TimeoutExpired:
            heartbeat(time.monotonic() - started)


def _link_trainer_files(source: Path, dest: Path) -> None:
    """The Trainer's own files (trainer state, scheduler, RNG, config) beside the universal shards: hard links
    where the file system allows (files of a complete checkpoint are never rewritten), copies elsewhere."""
    skip = {protocol.MANIFEST_NAME, protocol.SENTINEL_NAME, "latest", CONVERT_LOCK_NAME}
    for entry in sorted(source.iterdir()):
        if entry.name in skip or entry.is_symlink() or not entry.is_file():
            continue
        try:
            os.link(entry, dest / entry.name)
        except OSError:
            shutil.copy2(entry, dest / entry.name)


Prepared = tuple[str | None, str | None, dict[str, Any] | None]  # (load from, refusal, the conversion's record)


def prepare(ckpt_dir: str, args: Any, manifest: dict[str, Any], convert_timeout_s: float,
            heartbeat: Callable[[float], None] = lambda _s: None, frozen_now: Sequence[str] = (),
            unheld_now: Sequence[elastic_unheld.Held] = (), strict: bool = True,
            held_now: Sequence[elastic_unheld.Held] = (), batch_checked: bool = False) -> Prepared:
    """Rank 0, before the resume with ``args`` (TrainingArguments): the directory the Trainer loads from when it
    is not ``ckpt_dir``, the refusal, and what a conversion done now took (for the timing log: step, dur_s, bytes,
    from_world_size). Logs one line when the world size changed; converts when it must, within
    ``convert_timeout_s``, calling ``heartbeat(elapsed_s)`` meanwhile. This run's samples per optimizer step
    (per-device batch x accumulation x world size) must be the checkpoint's. ``frozen_now``: the names of this
    run's parameters that do not require gradients; ``unheld_now``: the names, grouped per tensor, and shapes of
    what this run's optimizer will not hold (elastic_unheld.unheld_names), ``held_now`` of what it will
    (held_names);
    ``strict``: the Trainer's load_module_strict (False for PEFT models: what the checkpoint lacks keeps the built
    value, as in upstream's load); ``batch_checked``: the caller has checked the samples per optimizer step (the
    JitTrainer, with keep_batch.decide: it may change this run's accumulation to keep them)."""
    world_size = int(args.world_size)
    decided = plan(ckpt_dir, world_size, manifest)
    if decided.action == SAME:
        return None, None, None
    logger.warning("slurm_jit: world size %s -> %d: %s", decided.written_by, world_size, decided.reason)
    if decided.action in (DIRECT, REFUSED):
        return None, None if decided.resumable else decided.reason, None
    written_by = int(decided.written_by or 0)  # not SAME: the plan knows who wrote it
    refusal = None if batch_checked else _batch_refusal(Path(ckpt_dir), args, manifest, written_by)
    zero3 = decided.zero_stage == 3
    if refusal is None and zero3:
        refusal = _zero3_refusal(Path(ckpt_dir), args, manifest, written_by, frozen_now)
    refusal = refusal or _held_refusal(Path(ckpt_dir), manifest, held_now, zero3)
    if refusal is None and not zero3:
        refusal = _unheld_refusal(Path(ckpt_dir), manifest, unheld_now, strict)
    if refusal:
        return None, refusal, None
    try:
        target, elapsed_s, nbytes = ensure_universal(ckpt_dir, manifest, convert_timeout_s, written_by, heartbeat)
    except (ElasticError, OSError, protocol.ProtocolError) as exc:
        return None, f"{exc}" if isinstance(exc, ElasticError) else (
            f"{ckpt_dir}: converting to DeepSpeed's universal format failed: {exc}. HINT: resume with "
            f"{decided.written_by} ranks; the checkpoint itself is untouched"), None
    if not elapsed_s:
        return str(target), None, None
    logger.warning("slurm_jit: converted %s to %s in %.1f s (%d bytes written)", ckpt_dir, target, elapsed_s,
                   nbytes)
    return str(target), None, {"step": int(manifest["step"]), "dur_s": elapsed_s, "bytes": nbytes,
                               "from_world_size": written_by}


def _batch_refusal(ckpt_dir: Path, args: Any, manifest: dict[str, Any], written_by: int) -> str | None:
    global_batch = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps) * int(
        args.world_size)
    written_batch = written_global_batch(ckpt_dir, manifest, written_by)
    if written_batch is None or written_batch == global_batch:
        return None
    return keep_batch.refusal(str(ckpt_dir), written_batch, global_batch, int(args.world_size))


def heartbeat_every(interval_s: float, send: Callable[[float], None]) -> Callable[[float], None]:
    """A heartbeat that calls ``send(elapsed_s)`` at most once per ``interval_s``."""
    last = [time.monotonic()]

    def beat(elapsed_s: float) -> None:
        if time.monotonic() - last[0] >= interval_s:
            last[0] = time.monotonic()
            send(elapsed_s)

    return beat


def heartbeat_interval_s(side_group_timeout_s: float) -> float:
    return min(HEARTBEAT_MAX_S, HEARTBEAT_SHARE_OF_TIMEOUT * side_group_timeout_s)


def _zero3_refusal(ckpt_dir: Path, args: Any, manifest: dict[str, Any], written_by: int,
                   frozen_now: Sequence[str]) -> str | None:
    """One line when a ZeRO-3 checkpoint uses what the conversion or the universal load does not carry: offload
    in this run, frozen parameters in the checkpoint or in this run (ds_to_universal converts the trainable ones'
    states only, and the universal load fills this run's trainable ones only: a frozen one would keep the value the
    model was built with)."""
    hint = f"HINT: resume with {written_by} ranks"
    if frozen_now:
        return (f"{ckpt_dir}: ZeRO-3 on another world size with {len(frozen_now)} parameters frozen in this run "
                f"(e.g. {frozen_now[0]}): DeepSpeed's universal load restores the trainable parameters only, so "
                f"the frozen ones would keep the values the model was built with, not the checkpoint's. {hint}, or "
                "freeze them after this resume has saved a checkpoint")
    hf_config = getattr(args, "hf_deepspeed_config", None)
    config = getattr(hf_config, "config", None) if hf_config is not None else None
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    for key in ZERO3_OFFLOAD_KEYS:
        section = zero.get(key) if isinstance(zero, dict) else None
        device = section.get("device") if isinstance(section, dict) else None
        if device not in (None, "none"):
            return (f"{ckpt_dir}: ZeRO-3 with {key} (device {device}) on another world size: the universal load "
                    f"into offloaded partitions is not verified. {hint}, or without {key} for this resume")
    states = ckpt_dir / str(manifest.get("deepspeed_tag") or "") / ZERO3_MODEL_STATES
    frozen = _saved_entry(states, "frozen_param_shapes")
    if isinstance(frozen, dict) and frozen:
        return (f"{ckpt_dir}: ZeRO-3 with {len(frozen)} frozen parameters (e.g. {next(iter(frozen))}) on another "
                "world size: DeepSpeed's universal format carries the trainable parameters only, so the frozen "
                f"ones would not be restored from the checkpoint. {hint}")
    return None


def _held_refusal(ckpt_dir: Path, manifest: dict[str, Any], held_now: Sequence[elastic_unheld.Held],
                  zero3: bool) -> str | None:
    """One line when a parameter this run's ZeRO optimizer will hold has no optimizer state in the checkpoint,
    another shape there, or is one tensor now but two then (elastic_unheld.held_refusal). Before any conversion."""
    states = ckpt_dir / str(manifest.get("deepspeed_tag") or "") / elastic_unheld.MODEL_STATES_NAMES[int(zero3)]
    why = elastic_unheld.held_refusal(states, held_now)
    if why is None:
        return None
    return (f"{ckpt_dir}: {why}; DeepSpeed's universal load cannot resume it on another world size. HINT: resume "
            "with the model the checkpoint was written with (its parameter shapes, and which are trained, frozen "
            "and tied); to change them, start a new run from its weights")


def _unheld_refusal(ckpt_dir: Path, manifest: dict[str, Any], unheld_now: Sequence[elastic_unheld.Held],
                    strict: bool) -> str | None:
    """One line when a tensor this run's ZeRO-1/2 optimizer will not hold (frozen now, a buffer) was saved with
    another shape, or (``strict``) has no value in the checkpoint: neither in its module nor held by its optimizer
    (a save with exclude_frozen_parameters); the universal load would leave it at the value the model was built
    with. Before any conversion."""
    states = ckpt_dir / str(manifest.get("deepspeed_tag") or "") / elastic_unheld.MODEL_STATES_NAMES[0]
    saved = elastic_unheld.saved_shapes(states)
    if saved is None:
        return None  # no readable model states: the conversion refuses it with DeepSpeed's own words
    why = elastic_unheld.reshaped(unheld_now, saved)
    if why:
        return f"{ckpt_dir}: {why}. HINT: resume with the model the checkpoint was written with"
    missing = elastic_unheld.missing_from(unheld_now, saved) if strict else []
    if not missing:
        return None
    return (f"{ckpt_dir}: {len(missing)} tensors this run does not train (e.g. {missing[0]}) are neither held by "
            "the checkpoint's optimizer nor saved in its module: DeepSpeed's universal load would leave them at the "
            "values the model was built with. HINT: resume with the model and the frozen parameters the "
            "checkpoint was written with")


def written_global_batch(ckpt_dir: Path, manifest: dict[str, Any], written_by: int) -> int | None:
    """Samples per optimizer step of the run that wrote the checkpoint: its manifest's record, else (a checkpoint
    of an older version) the DeepSpeed config the engine saves in its model states file and in each ZeRO shard
    (memory-mapped: no tensor is read); None when it cannot be told (then logged: not checked, not refused)."""
    recorded = recorded_samples(manifest)
    if recorded is not None:
        return recorded
    tag_dir = ckpt_dir / str(manifest.get("deepspeed_tag") or "")
    for name in DS_CONFIG_FILES:
        config = _saved_ds_config(tag_dir / name)
        micro = config.get("train_micro_batch_size_per_gpu")
        accum = config.get("gradient_accumulation_steps")
        if isinstance(micro, int) and isinstance(accum, int):
            return micro * accum * written_by
    logger.warning("slurm_jit: %s: neither its manifest (written before it recorded them) nor a DeepSpeed config "
                   "says its samples per optimizer step: not checked, the gradient accumulation is not changed on "
                   "another world size", ckpt_dir)
    return None


def _saved_ds_config(path: Path) -> dict[str, Any]:
    config = _saved_entry(path, "ds_config")
    return config if isinstance(config, dict) else {}


def _saved_entry(path: Path, key: str) -> Any:
    """``key`` of a DeepSpeed state file (memory-mapped: no tensor is read); None when missing or unreadable."""
    saved = elastic_unheld.load_states(path)  # None: missing, another layout or a newer DeepSpeed
    return None if saved is None else saved.get(key)


def install_universal_load() -> None:
    """Until the Trainer's next DeepSpeed resume load (or :func:`uninstall_universal_load`), that load reads a
    universal checkpoint: the engine's ``load_universal_checkpoint`` is set for that one load and put back right
    after, so later loads are the engine's own kind (the best model at the end installs it again when that
    checkpoint, too, was written by another number of ranks: JitTrainer._load_best_model)."""
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
        tag = (Path(checkpoint_path) / LATEST_UNIVERSAL_NAME).read_text(encoding="utf-8").strip()
        elastic_unheld.restore(engine, checkpoint_path, tag, strict=load_module_strict)

    load.slurm_jit_original = original  # type: ignore[attr-defined]
    hf_trainer.deepspeed_load_checkpoint = load


def uninstall_universal_load() -> None:
    import transformers.trainer as hf_trainer

    hf_trainer.deepspeed_load_checkpoint = getattr(hf_trainer.deepspeed_load_checkpoint, "slurm_jit_original",
                                                   hf_trainer.deepspeed_load_checkpoint)
