"""The save path of ``JitTrainer``: every checkpoint (JIT, periodic, final) through the crash-safe protocol.

Owns the order of one save (an earlier run's directory set aside, the sentinel first, upstream's save without its
rotation, the ``on_save`` of callbacks that may write into it, fsync, the manifest hashed by all ranks, then
``jit_stop``, rotation, and the ``on_save`` of the other callbacks: :mod:`.save_callbacks`), what
a JIT save leaves out (the consolidated weights unless asked; under ZeRO-1/2 the model-states copy:
:mod:`.slim_save`), the manifest's byte counts, and rotation over resumable checkpoints only. What "complete"
means is :mod:`slurm_jit.checkpoint.protocol`'s.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_jit.checkpoint import names, protocol
from slurm_jit.train import (
    data_position,
    frozen_weights,
    keep_batch,
    logging_window,
    save_callbacks,
    save_errors,
    signals,
    slim_save,
    stop_path,
)
from slurm_jit.train.zip_crc import zip_crc32

if TYPE_CHECKING:
    from slurm_jit.train.session import JitTrainerLike, Session

logger = logging.getLogger(__name__)

FAULT_SAVE_SLEEP_ENV = "SLURM_JIT_FAULT_SAVE_SLEEP_S"  # fault injection: seconds to stall inside every save
# Files that hold the model weights again beside the fp32 master copy in the optimizer shards: what a JIT save
# writes over the minimum a resume needs (the DeepSpeed format requires its model-states file).
DUPLICATE_WEIGHT_RE = re.compile(
    r"^(mp_rank_\d+_model_states\.pt|model(-\d+-of-\d+)?\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin)$"
)
MODEL_STATES_RE = re.compile(r"^mp_rank_\d+_model_states\.pt$")  # without the weights in a slim JIT save

Upstream = Callable[[Any, Any], None]  # the Trainer's own _save_checkpoint(model, trial)
# Where one save's seconds go, in the order they pass, in each rank's timing record (docs/benchmarks.md):
SAVE_PHASES = (
    "begin",      # rank 0: an earlier directory set aside, the sentinel written and fsynced; all ranks meet
    "write",      # upstream's save: torch.save of the DeepSpeed shards, optimizer, scheduler, RNG (page cache)
    "callbacks",  # the on_save of callbacks that may write into the checkpoint (what they write is in the manifest)
    "fsync",      # every file of the checkpoint durable
    "barrier",    # every rank's files durable
    "manifest",   # each rank hashes its share of the files; rank 0 writes the manifest, removes the sentinel
    "rotate",     # the stop record (a JIT save), rank 0's rotation, the last barrier
    "told",       # the on_save of the other callbacks, the checkpoint whole (an upload of it)
)


class _Phases:
    """The seconds since the previous mark, by phase name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._at = time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = round(now - self._at, 6)
        self._at = now


def _duplicate_weights(rel: str, weights: str) -> bool:
    """Whether a checkpoint file holds the model weights again (a slim model-states file holds no such copy)."""
    name = rel.rsplit("/", 1)[-1]
    if weights in protocol.MASTER_ONLY and MODEL_STATES_RE.match(name):
        return False
    return DUPLICATE_WEIGHT_RE.match(name) is not None


def leaves_out_weights(session: Session, output_dir: str | None, internal_call: bool) -> bool:
    """``save_model`` inside a JIT save: True (and only the config written) where the consolidated weights are
    left out; False where upstream's save_model runs."""
    trainer = session.trainer
    run = session.run
    if not (internal_call and run is not None and run.save_kind == "jit"
            and not trainer.jit_config.jit_save_model_weights and trainer.is_deepspeed_enabled):
        return False
    # A resume reads the DeepSpeed shards; the consolidated weights would be a third copy (and a ZeRO-3 gather).
    # Keep the config so that the directory still says what model it holds.
    config = getattr(trainer.model, "config", None)
    if session.is_rank0 and output_dir and config is not None:
        config.save_pretrained(output_dir)
    return True


@signals.worker_deaths_held(replay=True)  # a worker's death raises after the save, not in it
def save_checkpoint(session: Session, model: Any, trial: Any, upstream: Upstream) -> None:
    """One checkpoint of this step, complete by the protocol's definition before anything rotates."""
    trainer = session.trainer
    run = session.run
    step = trainer.state.global_step
    session.saver.before_save()  # an async save in flight is durable and committed before any other save
    if run is not None and run.saved_step == step:
        return  # this step is already saved by this run
    kind = (run.save_kind if run and run.save_kind else None) or (
        "final" if trainer.state.max_steps and step >= trainer.state.max_steps else "periodic")
    run_dir = Path(session.hooks.output_dir(trial=trial))
    ckpt = run_dir / f"checkpoint-{step}"
    t0 = time.monotonic()
    phases = _Phases()
    stop_path.feed(session, "save")  # the hang watchdog gives a save its long bound
    _begin(session, ckpt, step, kind)
    phases.mark("begin")
    with save_errors.disk_full_is_one_line(ckpt):  # one clear line; the sentinel stays, nothing rotates
        with zip_crc32(trainer.jit_config.zip_crc32), session.saver.collecting(kind, ckpt) as collected:
            contents, weights = upstream_save(trainer, model, trial, kind, upstream)
        window = run.capture_window() if run is not None and run.capture_window is not None else None
        if window is not None:  # what the next log after a resume averages
            logging_window.write(ckpt, int(trainer.args.process_index), window)
        phases.mark("write")
        if session.saver.submit(collected, ckpt, step, kind, phases, t0,
                                 fields=manifest_fields(session, contents, weights)):
            return  # written and committed in the background, on_save told then (train/async_save/periodic.py)
        save_callbacks.run_writers(session)
        fault_sleep()
        phases.mark("callbacks")
        protocol.fsync_tree(ckpt)
        phases.mark("fsync")
        session.agreement.barrier()
        phases.mark("barrier")
        nbytes = write_manifest(session, ckpt, step, kind, manifest_fields(session, contents, weights))
        phases.mark("manifest")
    if run is not None:
        run.saved_step, run.saved_contents = step, contents
        run.checkpoint = str(ckpt)
        if kind == "jit":
            stop_path.record_stop(session)
    if session.is_rank0:
        rotate_checkpoints_safely(session, run_dir, just_written=ckpt)
    session.agreement.barrier()
    phases.mark("rotate")
    save_callbacks.tell_readers(session, step, trainer.state.epoch)
    phases.mark("told")
    _done(session, step, kind, ckpt, time.monotonic() - t0, nbytes, phases.seconds)


def fault_sleep() -> None:
    """Fault injection (FAULT_SAVE_SLEEP_ENV): a save that stalls (an async save's background write stalls)."""
    fault_sleep_s = float(os.environ.get(FAULT_SAVE_SLEEP_ENV, "0") or 0)
    if fault_sleep_s > 0:
        time.sleep(fault_sleep_s)


def manifest_fields(session: Session, contents: str, weights: str) -> dict[str, Any]:
    """What this save's manifest records beside its files (the synchronous and the async path alike)."""
    trainer = session.trainer
    run = session.run
    return {
        "contents": contents, "weights": weights, "run_id": run.lineage if run and run.lineage else None,
        "owed_evaluation": bool(run and run.eval_owed),
        keep_batch.SAMPLES_KEY: keep_batch.samples_per_step(trainer),
        keep_batch.PER_DEVICE_KEY: keep_batch.per_device_batch(trainer),
        keep_batch.COMMAND_KEY: keep_batch.accumulation_of_command(trainer.args, run.batch_record if run else None),
        **data_position.manifest_fields(run.data_position if run else None, int(trainer.state.global_step)),
        **({keep_batch.MANIFEST_KEY: run.batch_record} if run and run.batch_record else {}),
    }


def _begin(session: Session, ckpt: Path, step: int, kind: str) -> None:
    """Rank 0 sets an earlier run's directory of this step aside and writes the sentinel; then all ranks meet."""
    if session.is_rank0:
        if os.path.lexists(ckpt):
            with save_errors.set_aside_is_one_line(ckpt):  # a rename: the save's first write here
                aside = protocol.set_aside_replaced(ckpt)  # .superseded-<seq> if whole, else .incomplete
            logger.warning("slurm_jit: %s exists from an earlier run or save attempt (a set-aside async save of "
                           "this step): moved to %s", ckpt, aside)
        with save_errors.disk_full_is_one_line(ckpt):  # the sentinel is the save's first write
            protocol.write_sentinel(ckpt, step, kind)
    session.agreement.barrier()


def _done(session: Session, step: int, kind: str, ckpt: Path, dur_s: float, nbytes: int,
          phases: dict[str, float]) -> None:
    run = session.run
    if run is not None:
        if run.timing is not None:
            run.timing.save(step, kind, dur_s, nbytes, phases)
        run.grace_due.append("first save")
    logger.log(logging.INFO if session.is_rank0 else logging.DEBUG,  # one line per save, not one per rank
               "slurm_jit: %s checkpoint %s complete in %.2f s", kind, ckpt, dur_s)


def upstream_save(trainer: JitTrainerLike, model: Any, trial: Any, kind: str, upstream: Upstream) -> tuple[str, str]:
    """Upstream's save, without its rotation; a JIT save always holds what an exact resume needs
    (optimizer, scheduler, RNG, DeepSpeed shards) whatever save_only_model says, and under ZeRO-1/2 the module
    weights only once (slim_save.py). Returns the contents and the weights layout."""
    args = trainer.args
    limit, only_model = args.save_total_limit, args.save_only_model
    args.save_total_limit = None  # rotation runs after the manifest, protocol-aware
    if kind == "jit":
        args.save_only_model = False
    engine = trainer.model_wrapped if trainer.is_deepspeed_enabled else None
    # A PEFT model's saves leave its frozen base out (upstream's layout); its JIT save, the adapters too (placeholders)
    peft = slim_save.excludes_frozen(trainer.model, engine)
    slim_engine = engine if kind == "jit" and trainer.jit_config.slim_jit_save else None
    try:
        with (slim_save.slim_model_states(slim_engine, placeholders=peft) as slim,
              slim_save.frozen_left_out(engine if peft else None)):
            upstream(model, trial)
        if args.save_only_model:  # model.safetensors (a PEFT model's: its adapters), no DeepSpeed files
            return protocol.CONTENTS_MODEL_ONLY, slim_save.layout(None, False, frozen_excluded=peft)
        return protocol.CONTENTS_FULL, slim_save.layout(engine, slim, frozen_excluded=peft)
    finally:
        args.save_total_limit, args.save_only_model = limit, only_model


def write_manifest(session: Session, ckpt: Path, step: int, kind: str, fields: dict[str, Any]) -> int:
    """Each rank hashes the files it wrote (still in its page cache; on a shared file system, no other node's file
    read over the network); rank 0 writes the manifest. Returns the bytes (rank 0)."""
    agreement = session.agreement
    rels = agreement.broadcast(protocol.payload_files(ckpt) if session.is_rank0 else None)
    parts = agreement.gather(protocol.file_entries(ckpt, hashed_by(rels, agreement.rank, agreement.world_size)))
    if not session.is_rank0 or parts is None:
        return 0
    return seal(session, ckpt, step, kind, fields, {rel: entry for part in parts for rel, entry in part.items()})


def hashed_by(rels: list[str], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` hashes for the manifest: those it wrote (:func:`names.writer_rank`; a name beyond the
    world size, rank 0's)."""
    def writer(rel: str) -> int:
        named = names.writer_rank(rel)
        return named if named < world_size else 0

    return [rel for rel in rels if writer(rel) == rank]


def seal(session: Session, ckpt: Path, step: int, kind: str, fields: dict[str, Any],
         files: dict[str, dict[str, Any]]) -> int:
    """Rank 0: the manifest from every file's entry (gathered from the ranks, or from the async save's done
    markers), then the sentinel removed. Returns the bytes."""
    trainer = session.trainer
    fields = dict(fields)
    weights = fields.pop("weights")
    duplicate = sum(e["size"] for rel, e in files.items() if _duplicate_weights(rel, weights))
    total = sum(e["size"] for e in files.values())
    latest = ckpt / "latest"
    tag = latest.read_text().strip() if latest.is_file() else None
    engine: Any = trainer.model_wrapped
    zero_stage = engine.zero_optimization_stage() if trainer.is_deepspeed_enabled else None
    protocol.write_manifest(
        ckpt, step=step, kind=kind, world_size=int(trainer.args.world_size), zero_stage=zero_stage,
        deepspeed_tag=tag, files=files, contents=fields.pop("contents"), run_id=fields.pop("run_id"),
        weights=weights,
        extra={"bytes_weights_duplicate": duplicate, "bytes_needed_for_resume": total - duplicate, **fields,
               **frozen_weights.manifest_fields(weights, session.run.frozen if session.run else None)},
    )
    logger.info("slurm_jit: %s checkpoint-%d: %d bytes written, %d needed for resume, %d over (model weights "
                "again beside the fp32 master copy in the optimizer shards); weights: %s",
                kind, step, total, total - duplicate, duplicate, weights)
    return total


def rotate_checkpoints_safely(session: Session, run_dir: Path, just_written: Path,
                              best_before: str | None = None) -> None:
    """save_total_limit over resumable checkpoints only, after the new one is complete; never the one just
    written, the best one, or the one resumed from until this run has written a newer one. ``best_before``: the
    best checkpoint when an async save was submitted, kept too (rotation then runs in the background while an
    evaluation may already name a best checkpoint not yet written)."""
    trainer = session.trainer
    limit = trainer.args.save_total_limit
    if not limit or limit <= 0:
        return
    keep = {just_written.resolve()}
    for best in {trainer.state.best_model_checkpoint, best_before} - {None, ""}:
        keep.add(Path(best).resolve())
    run = session.run
    if run is not None and run.resumed_from and run.saved_step < 0:
        keep.add(Path(run.resumed_from).resolve())
    protocol.remove_deletion_leftovers(run_dir)
    checkpoints, _ = protocol.scan(run_dir)
    for ckpt in protocol.rotation_victims(checkpoints, limit, keep):
        logger.info("slurm_jit: deleting %s (save_total_limit=%d)", ckpt.path, limit)
        protocol.delete_checkpoint(ckpt.path)
