"""The resume path of ``JitTrainer``: which checkpoint a ``train()`` loads, or why it refuses, before any step.

Owns the pick (rank 0 takes the output_dir's lock, then ``True`` means the newest resumable checkpoint, as
``ckpt-check`` says), the refusals in order (the lock, the checkpoint's status, the ZeRO stage, a PEFT conversion,
model names and shapes, the conversion's own, a slim save's), what a manifest carries into the run (lineage, an
owed evaluation), the elastic resume's universal copy (written by :mod:`.elastic`), the batch (the accumulation
:mod:`.keep_batch` chooses to keep the global batch, set on every rank before upstream's ``train()``, or the user's
own, refused where the sampler orders the epoch by the batch: :mod:`.batch_order`) with the data position the resume
starts at (:mod:`.data_position`), and the same copy for loading the best
model at the end. Every rank learns rank 0's verdict by one broadcast. The exact restore after
the load is :mod:`.exact_resume`'s.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers.trainer import TRAINER_STATE_NAME, Trainer
from transformers.trainer_utils import _is_peft_model, has_length

from slurm_jit.checkpoint import elastic_plan, protocol
from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.train import (
    batch_order,
    data_position,
    elastic,
    elastic_unheld,
    frozen_weights,
    keep_batch,
    model_match,
    output_lock,
    slim_save,
    stop_record,
    writable,
)
from slurm_jit.train.refusals import JitRefusal, resume_refusal
from slurm_jit.train.run_state import LINEAGE_ID_CHARS, Run

if TYPE_CHECKING:
    from slurm_jit.train.session import JitTrainerLike, Session

logger = logging.getLogger(__name__)

CONVERSIONS = (elastic_plan.CONVERT, elastic_plan.CONVERTED)  # a resume through the universal copy
Picked = tuple[str | None, str | None, dict[str, Any]]  # (checkpoint, refusal, what it carries into the run)


def resolve(session: Session, resume_from_checkpoint: str | bool | None) -> str | None:
    """Rank 0 picks the checkpoint (``True``: the newest resumable one, as ckpt-check does), checks that it
    can be resumed exactly by this run, reads what it carries, and tells every rank."""
    trainer = session.trainer
    decision: Picked = (None, None, {})
    not_writable = writable.refusal_on_any_rank(session.agreement, str(trainer.args.output_dir))  # every rank's
    if not_writable:
        raise JitRefusal(f"slurm_jit: {not_writable}")
    if session.is_rank0:  # one training per output_dir, and a writable one (output_lock), before any step
        session.output_lock, locked_out = output_lock.acquire(str(trainer.args.output_dir))
        if not locked_out:  # before any rank's watchdog starts (a collective follows) and any failure is recorded
            stop_record.clear_hang_reports(str(trainer.args.output_dir))
        decision = (None, locked_out, {}) if locked_out else pick(session, resume_from_checkpoint)
    path, refusal, carried = session.agreement.broadcast_after(decision, elastic.HEARTBEAT)
    if refusal:
        raise JitRefusal(f"slurm_jit: {refusal}")
    run = session.run
    if run is not None:
        run.checkpoint = run.resumed_from = path
        run.lineage = carried.get("run_id") or uuid.uuid4().hex[:LINEAGE_ID_CHARS]
        run.owed_eval_step = carried.get("owed_evaluation_step")
        run.load_from, run.conversion = carried.get("load_from"), carried.get("conversion")
        run.frozen_refusal = carried.get("frozen_refusal")
        run.kept_batch, run.user_batch = carried.get("kept_batch"), carried.get("user_batch")
        # the user's batch ends the chain's kept one: its command is theirs
        run.batch_record = None if run.user_batch else run.kept_batch or carried.get("batch_record")
        run.data_position.resumed = data_position.from_record(carried.get("data_position"))
        if run.kept_batch:
            _keep_batch(session, keep_batch.Kept(**run.kept_batch))
        if run.user_batch and session.is_rank0:
            logger.warning("slurm_jit: %s", keep_batch.UserBatch(**run.user_batch).line())
        if run.load_from:
            elastic.install_universal_load()
    return path


def record_timing(session: Session, run: Run) -> None:
    """Rank 0, once the timing log is open: what this start did to resume (a conversion, a kept global batch)."""
    if session.is_rank0 and run.timing is not None:
        if run.conversion:
            run.timing.conversion(**run.conversion)
        if run.kept_batch:
            run.timing.kept_batch(run.kept_batch)


def pick(session: Session, resume_from_checkpoint: str | bool | None) -> Picked:
    """Rank 0: the checkpoint named or found, why it cannot be resumed (or None), and what it carries."""
    trainer = session.trainer
    path = _named_or_newest(trainer, resume_from_checkpoint)
    if path is None:
        return None, None, {}
    refusal = resume_refusal(path, world_size=int(trainer.args.world_size))
    manifest = None
    if not refusal and (Path(path) / protocol.MANIFEST_NAME).is_file():
        manifest, _ = manifest_file.read(Path(path))
    carried: dict[str, Any] = {}
    if manifest is not None:
        if isinstance(manifest.get("run_id"), str):
            carried["run_id"] = manifest["run_id"]
        if manifest.get("owed_evaluation") is True:
            carried["owed_evaluation_step"] = manifest["step"]
        refusal = prepare_load(session, path, manifest, carried)
    return path, refusal, carried


def _named_or_newest(trainer: JitTrainerLike, resume_from_checkpoint: str | bool | None) -> str | None:
    if resume_from_checkpoint is not True:
        return str(resume_from_checkpoint) if resume_from_checkpoint else None
    resolution = protocol.find_resumable(str(trainer.args.output_dir))
    for ckpt in resolution.passed_over:
        logger.warning("slurm_jit: passing over %s: %s (%s)", ckpt.path, ckpt.status.value, ckpt.reason)
    if resolution.checkpoint is None:
        logger.warning("slurm_jit: no resumable checkpoint in %s: starting fresh", trainer.args.output_dir)
        return None
    path = str(resolution.checkpoint.path)
    logger.warning("slurm_jit: resuming from %s (%s)", path, resolution.checkpoint.status.value)
    return path


def prepare_load(session: Session, path: str, manifest: dict[str, Any], carried: dict[str, Any]) -> str | None:
    """Rank 0: why ``path`` cannot be loaded by this run's engine, or None, with what the load needs in
    ``carried`` (an elastic resume's universal copy). The ZeRO stage first, on every world size: a conversion
    keeps the stage's file layout (ZeRO-3 under ZeRO-2 would be converted and then fail in DeepSpeed's load)."""
    trainer = session.trainer
    run = session.run
    refusal, now = frozen_weights.resume_refusal(path, manifest, trainer.model, run.frozen if run else None)
    if refusal and now:  # the frozen weights it left out are this model's, or nothing is loaded (nor converted)
        return refusal
    if refusal:  # other frozen names: the load's model checks say which adapter differs; if not, this after it
        carried["frozen_refusal"] = refusal
    ds_config = session.hooks.ds_config()
    refusal = model_match.stage_refusal(path, manifest, ds_config)
    if refusal:  # a slim save's own words where it has them (its weights are only in the shards)
        return slim_save.resume_refusal(path, manifest, ds_config) or refusal
    decided = elastic_plan.plan(path, int(trainer.args.world_size), manifest)
    batch, refusal = batch_to_keep(trainer, path, manifest, decided)
    if refusal:
        return refusal
    carried["kept_batch"] = batch.record() if isinstance(batch, keep_batch.Kept) else None
    carried["user_batch"] = batch.record() if isinstance(batch, keep_batch.UserBatch) else None
    position = data_position.recorded(manifest)
    decided_at = batch.position() if isinstance(batch, keep_batch.UserBatch) else None
    if decided_at is not None:  # the position the user's batch was decided on (an older manifest: counted)
        position = data_position.Position(step=decided_at[0], epoch=decided_at[1], samples=decided_at[2])
    carried["data_position"] = data_position.as_record(position)
    carried["batch_record"] = manifest.get(keep_batch.MANIFEST_KEY)  # the chain keeps checking, changed now or not
    converting = decided.action in CONVERSIONS
    if converting and manifest.get("weights") in manifest_file.FROZEN_LEFT_OUT:
        return (f"{path}: a PEFT checkpoint (frozen base left out, weights: {manifest['weights']}) on "
                f"another world size ({decided.written_by} -> {trainer.args.world_size} ranks) is not supported: "
                f"its conversion is untested. HINT: resume it on {decided.written_by} ranks")
    refusal = model_match.pick_refusal(path, trainer.model) if converting else None
    if refusal:  # names and shapes, by name, before universal/ is written into the checkpoint
        return refusal
    carried["load_from"], refusal, carried["conversion"] = prepare_elastic(session, path, manifest)
    if not refusal and not carried["load_from"]:  # a universal load rebuilds the weights itself
        refusal = slim_save.resume_refusal(path, manifest, ds_config)
    return refusal


def prepare_elastic(session: Session, path: str, manifest: dict[str, Any]) -> elastic.Prepared:
    """Rank 0: elastic.prepare for loading ``path`` on this run's world size, heartbeating to the others."""
    trainer = session.trainer
    beat = elastic.heartbeat_every(elastic.heartbeat_interval_s(trainer.jit_config.side_group_timeout_s),
                                   lambda s: session.agreement.broadcast((elastic.HEARTBEAT, s)))
    model = trainer.model
    params = model.named_parameters() if model is not None else ()
    frozen = [name for name, p in params if not p.requires_grad]  # ZeRO-3's universal load skips them
    unheld = elastic_unheld.unheld_names(model) if model is not None else []
    held = elastic_unheld.held_names(model) if model is not None else []
    return elastic.prepare(path, trainer.args, manifest, trainer.jit_config.convert_timeout_s, beat,
                           frozen_now=frozen, unheld_now=unheld, strict=not _is_peft_model(model), held_now=held,
                           batch_checked=True)


def batch_to_keep(trainer: JitTrainerLike, path: str, manifest: dict[str, Any],
                  decided: elastic_plan.Plan) -> keep_batch.Decision:
    """Rank 0: the batch this resume trains with (keep_batch.decide): the accumulation that keeps the checkpoint's
    samples per optimizer step where its command runs again (on another number of ranks; on the same number after a
    kept change, 2 -> 1 -> 1, whose command still has the first world size's accumulation), the user's where they
    changed the per-device batch or the accumulation, or why neither can be exact, nor in the sampler's order
    (:func:`_order_refusal`). A manifest of an older version (no samples_per_step) on the same number of ranks is not
    checked, as that version did not: one warning. Under auto_find_batch_size the per-device batch is the one the
    checkpoint's run found (upstream's train() restores it from the trainer state)."""
    same = decided.action == elastic_plan.SAME
    unrecorded = elastic_plan.recorded_samples(manifest) is None and not manifest.get(keep_batch.MANIFEST_KEY)
    if not decided.resumable:
        return None, None
    if same and unrecorded:  # the version that wrote it did not check it either
        logger.warning("slurm_jit: %s: its manifest does not record its batch (an older version's), so the resume "
                       "skips its global_step optimizer steps at this run's %d samples each, as upstream's Trainer "
                       "does: after a change of the batch that is another data position. HINT: resume with the "
                       "checkpoint's per_device_train_batch_size and gradient_accumulation_steps", path,
                       keep_batch.samples_per_step(trainer))
        return None, None
    written_by = int(decided.written_by or manifest.get("world_size") or 0)
    written = elastic.written_global_batch(Path(path), manifest, written_by)
    if written is None:  # logged there: not checked, not refused
        return None, None
    per_device = keep_batch.per_device_batch(trainer)  # x n_gpu under one process's DataParallel, as saved
    found = _found_batch_size(path)  # the trainer state's: the checkpoint's run's per-device batch
    if trainer.args.auto_find_batch_size:
        per_device = found or per_device
    written_per_device = _positive(manifest.get(keep_batch.PER_DEVICE_KEY)) or found  # an older manifest: the state's
    record = manifest.get(keep_batch.MANIFEST_KEY)
    command = _positive(manifest.get(keep_batch.COMMAND_KEY)) or _positive(
        record.get("accumulation_from") if isinstance(record, dict) else None)  # an older manifest: its kept record's
    counted = data_position.counted(manifest, trainer, written, written_by, written_per_device)
    position = None if counted is None else (counted.step, counted.epoch, counted.samples)
    batch, refusal = keep_batch.decide(
        written_batch=written, written_by=written_by, per_device=per_device,
        accumulation=int(trainer.args.gradient_accumulation_steps), world_size=int(trainer.args.world_size),
        keep=trainer.jit_config.keep_global_batch, where=path, written_per_device=written_per_device,
        command_accumulation=command, position=position, ignore_data_skip=bool(trainer.args.ignore_data_skip))
    if refusal is None:
        written_shape = batch_order.written_shape(written, written_by, written_per_device or per_device)
        accumulation = batch.accumulation_to if batch else int(trainer.args.gradient_accumulation_steps)
        now = batch_order.Shape(per_device=per_device, accumulation=accumulation,
                                world_size=int(trainer.args.world_size))
        refusal = _order_refusal(trainer, written_shape, now, position, path)
    return (None, refusal) if refusal else (batch, None)


def _order_refusal(trainer: JitTrainerLike, written: batch_order.Shape, now: batch_order.Shape,
                   position: tuple[int, int, int] | None, path: str) -> str | None:
    """Rank 0: batch_order's refusal where transformers' sampler orders the epoch by the batch (a dataset with a
    length: upstream's sampler ignores the strategy otherwise; ignore_data_skip: nothing is skipped, no order to
    keep); a subclass's own _get_train_sampler: its warning."""
    if trainer.args.ignore_data_skip or not has_length(getattr(trainer, "train_dataset", None)):
        return None
    own = getattr(type(trainer), "_get_train_sampler", Trainer._get_train_sampler)
    if own is not Trainer._get_train_sampler:  # what it builds cannot be told from here
        note = batch_order.own_sampler_warning(type(trainer).__name__, written, now, position)
        if note:
            logger.warning("slurm_jit: %s", note)
        return None
    return batch_order.refusal(str(trainer.args.train_sampling_strategy), written, now, position, path)


def _found_batch_size(path: str) -> int | None:
    """The trainer state's train_batch_size (what auto_find_batch_size settled on), None when unreadable."""
    try:
        state = json.loads((Path(path) / TRAINER_STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return _positive(state.get("train_batch_size") if isinstance(state, dict) else None)


def _positive(value: Any) -> int | None:
    """``value`` when it is a positive whole number (a manifest's or trainer state's), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _keep_batch(session: Session, kept: keep_batch.Kept) -> None:
    """Every rank: train with ``kept``'s accumulation (args and DeepSpeed config), before upstream's train()."""
    trainer = session.trainer
    plugin = trainer.accelerator.state.deepspeed_plugin if trainer.is_deepspeed_enabled else None
    configs = (getattr(plugin, "hf_ds_config", None), getattr(trainer.args, "hf_deepspeed_config", None))
    keep_batch.apply(trainer.args, configs, kept)
    if session.is_rank0:
        logger.warning("slurm_jit: %s", kept.line())
        dataset = trainer.train_dataset
        note = keep_batch.epoch_warning(kept, len(dataset) if has_length(dataset) else None,
                                        bool(trainer.args.dataloader_drop_last))
        if note:
            logger.warning("slurm_jit: %s", note)


def load_best_model(session: Session, upstream: Callable[[], None]) -> None:
    """Upstream's best-model load, through the best checkpoint's universal copy when another number of ranks
    wrote it; a refusal is a warning (the run has ended well: its last save is complete)."""
    trainer = session.trainer
    best = trainer.state.best_model_checkpoint
    if not (best and trainer.is_deepspeed_enabled):  # the same on every rank: all or none broadcast
        upstream()
        return
    load_from, refusal = session.agreement.broadcast_after(_best_model_elastic(session, best), elastic.HEARTBEAT)
    if refusal:
        logger.warning("slurm_jit: not loading the best model: %s", refusal)
        return
    if load_from is None:
        upstream()
        return
    elastic.install_universal_load()  # the best checkpoint's ZeRO shards are another world size's
    trainer.state.best_model_checkpoint = load_from
    try:
        upstream()
    finally:
        trainer.state.best_model_checkpoint = best
        elastic.uninstall_universal_load()


def _not_whole(best: str) -> str | None:
    """Why the best checkpoint cannot be loaded whole (incomplete: an async save a JIT stop set aside, or a save
    killed; corrupt), or None. Upstream names ``checkpoint-<best step>`` whenever the directory exists."""
    found = protocol.CHECKPOINT_RE.fullmatch(Path(best).name)
    if found is None:
        return None  # not a checkpoint-<step> name: upstream's own load decides
    try:
        info = protocol.inspect(best, int(found.group(1)))
    except OSError as exc:
        return f"{best}: {exc}"
    if info.status in protocol.WHOLE_STATUSES:
        return None
    return f"{best} is {info.status.value} ({info.reason}); the final weights stay"


def _best_model_elastic(session: Session, best: str) -> tuple[str | None, str | None]:
    """Rank 0 (None, None elsewhere): the best checkpoint's universal copy when it was written by another
    number of ranks (DeepSpeed refuses its shards here: the run would end in a traceback after its last save,
    and so would every requeue of it), or why it cannot be loaded."""
    trainer = session.trainer
    if not session.is_rank0:
        return None, None
    whole = _not_whole(best)
    if whole is not None:
        return None, whole
    decided = elastic.plan(best, int(trainer.args.world_size))
    if decided.action in (elastic.SAME, elastic.DIRECT) or not decided.resumable:
        return None, None if decided.resumable else decided.reason
    manifest, why = manifest_file.read(Path(best))
    if manifest is None:
        return None, f"{best}: {why}"
    load_from, refusal, _ = prepare_elastic(session, best, manifest)
    return load_from, refusal
