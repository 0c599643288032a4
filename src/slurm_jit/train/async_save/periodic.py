"""Asynchronous periodic saves in the JitTrainer (``JitConfig(async_periodic_saves=True)``, issue #23).

Works the async saves of one ``train()`` (:class:`~.in_flight.AsyncSaves`, on ``Run.async_saves``) behind the
calls the save and stop paths make through ``session.saver`` (:mod:`.saver`). A periodic save with the flag on
goes, on the training thread:

1. the sentinel (``save_path``, as every save), then upstream's save with DeepSpeed's checkpoint engine swapped for
   :class:`~.collect.CollectingEngine`: the model states and each rank's optimizer states are collected, not
   written, and so are the consolidated weights (rank 0's ``save_model``: ``safetensors``' ``save_file`` calls
   collected, and accelerate's ``get_state_dict`` without its clone, which staging makes), and the trainer state
   (``trainer_state.json``: a snapshot); the Trainer's other small files (RNG, scheduler, config, ``latest``,
   ``zero_to_fp32.py``) are written as today;
2. the collected states staged in host memory (:class:`~.staging.HostStager`) with their copies deferred (the
   module's weights and buffers, which a callback, a hook or a forward may change, copied at once), the ranks agree
   that all staged (one all-reduce on the side group), and the snapshot handed to the
   :class:`~.writer.BackgroundWriter`; training continues. DeepSpeed's next optimizer step (``engine.step``, what
   changes the optimizer's staged states) first waits for the copies, within a bound (:mod:`.step_gate`): they run
   in the writer's thread beside the next step's forward and backward, DCP's ``async_staging`` contract.

The background thread copies, then writes and fsyncs the files, fsyncs the directory tree (this rank's synchronous
files), and writes this rank's done marker; rank 0's thread then waits for every marker and commits
(:mod:`.commit`): the manifest of the synchronous path (``save_path.seal``), the sentinel removed last, then the
rotation. The commit is rank 0's thread's, not the next step boundary's: no collective in a thread, no delay by a
long step, and training waits for nothing unless the next save comes first.

The callbacks' ``on_save`` (:mod:`slurm_jit.train.save_callbacks`) is told on the training thread once the save is
committed: each rank sends whether its writer is done in the stop round of every step boundary, and at the first
boundary whose agreed round says every rank's is (rank 0's ends with the manifest) every rank takes the save as saved
and tells its callbacks (:mod:`.claim`); else the wait of the next save, of a JIT stop or of the end of training
does it. A save set aside by a JIT stop is never told. A periodic save with a callback that may write into the
checkpoint is synchronous (:func:`collecting`).

Every other save (JIT, final, a synchronous periodic one) and the end of training (``_finalize_training``, before
the best model is loaded) first wait for the save in flight to be committed (:func:`before_save`, :func:`finish`);
a second periodic save due while one is in flight waits too (logged): never a queue. A background write that
fails on any rank leaves that rank's failed marker (rank 0's commit stops at once) and the checkpoint incomplete;
the wait before the next save (or at the end of training) then raises ``CheckpointWriteError`` on every rank
(:func:`_raise_on_every_rank`): training stops as after a failed synchronous save, no rank goes on alone. A JIT
stop never raises it: at the step of an async save it waits for it and writes no second checkpoint (unless that
write failed: the JIT save then writes the step again); at a later step its wait is bounded by the signal lead,
past which (or where a rank's write failed) the save in flight is set aside, never claimed, and the JIT save
written (:mod:`.stop_wait`).
Where host memory cannot hold the staging buffers (:class:`~.memory_guard.HostMemoryError`, one line) every rank
saves this and later checkpoints synchronously.
The timing log records the seconds training was blocked (``save_blocked``: the save's own and the optimizer
step's wait for the copies, phase ``copy_wait``) apart from the background write and commit
(``save_background``); neither is a ``save`` record, so the grace calculator still sizes the JIT save from
synchronous saves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch

from slurm_jit.checkpoint import protocol
from slurm_jit.train import lost_peers, save_callbacks, save_errors, save_path, stop_path
from slurm_jit.train.async_save import claim, collect, fault_points, files, staging, step_gate, stop_wait
from slurm_jit.train.async_save import commit as commit_mod
from slurm_jit.train.async_save import writer as writer_mod
from slurm_jit.train.async_save.collect import CollectingEngine
from slurm_jit.train.async_save.in_flight import AsyncSaves, InFlight, WriteHistory
from slurm_jit.train.async_save.memory_guard import HostMemoryError
from slurm_jit.train.async_save.staging import HostStager, StagedSave
from slurm_jit.train.zip_crc import zip_crc32

if TYPE_CHECKING:
    from slurm_jit.train.session import JitTrainerLike, Session

logger = logging.getLogger(__name__)

ASYNC_KIND = "periodic"  # the only kind saved in the background: a JIT save and the final one stay synchronous
TORCH_ENGINE = "TorchCheckpointEngine"  # DeepSpeed's default engine: save() is one torch.save
FAILED_CLOSE_WAIT_S = 60.0  # after a failed train(): how long the save in flight may still finish


def refusal(trainer: JitTrainerLike) -> str | None:
    """Why ``async_periodic_saves=True`` cannot work with this trainer (one line with a HINT), or None."""
    if not trainer.jit_config.async_periodic_saves:
        return None
    hint = "HINT: set JitConfig(async_periodic_saves=False) (synchronous periodic saves)"
    strategy = getattr(trainer.args, "hub_strategy", None)
    if getattr(trainer.args, "push_to_hub", False) and getattr(strategy, "value", strategy) != "end":
        return ("JitConfig(async_periodic_saves=True) with push_to_hub: upstream uploads each checkpoint's files as "
                "its save returns, before the background write has written them (a stale or missing model on the "
                f"Hub). {hint}, or TrainingArguments(hub_strategy='end')")
    if not trainer.is_deepspeed_enabled:
        return f"JitConfig(async_periodic_saves=True) needs DeepSpeed (its checkpoint engine is what is staged). {hint}"
    ds_config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    if (ds_config.get("zero_optimization") or {}).get("stage") == 3:
        return f"JitConfig(async_periodic_saves=True) supports ZeRO stages 0-2 (ZeRO-3 is not tested yet). {hint}"
    return None


def in_flight_step(session: Session) -> int | None:
    """The step of the async save submitted and not yet seen committed (None: none): the stop path reads a stop
    round right after it, as after a synchronous save, so that a signal that came during the staging is taken at
    this step (its checkpoint the periodic one, once committed), not a step later."""
    saves = _saves(session, create=False)
    return saves.in_flight.step if saves is not None and saves.in_flight is not None else None


def in_flight_contents(session: Session, step: int) -> str | None:
    """What the async save of ``step`` still in flight holds (``full``, ``model_only``: save_only_model), or None
    where none of that step is: the stop path's model-only guard, before that save is taken as saved."""
    saves = _saves(session, create=False)
    job = saves.in_flight if saves is not None else None
    return job.contents if job is not None and job.step == step else None


def _saves(session: Session, create: bool) -> AsyncSaves | None:
    trainer = session.trainer
    run = session.run
    if run is None or not trainer.jit_config.async_periodic_saves:
        return None
    if run.async_saves is None and create:
        run.async_saves = AsyncSaves(HostStager(sharing_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
                                                   copy_threads=staging.copy_threads()),
                                     writer_mod.BackgroundWriter(zip_crc32=trainer.jit_config.zip_crc32),
                                     # rank 0 bounds a JIT stop's wait: the writes of the runs before count too
                                     earlier=stop_wait.earlier_writes(str(trainer.args.output_dir)) if session.is_rank0
                                     else WriteHistory())
    saves: AsyncSaves | None = run.async_saves
    return saves


@contextlib.contextmanager
def collecting(session: Session, kind: str, ckpt: Path) -> Iterator[CollectingEngine | None]:
    """Around upstream's save: DeepSpeed's checkpoint engine and safetensors' ``save_file`` collect instead of
    writing, and accelerate's ``get_state_dict`` does not clone (the staging copies), where this save goes to the
    background (yields the collector, else None: a synchronous save)."""
    trainer = session.trainer
    saves = _saves(session, create=True) if kind == ASYNC_KIND else None
    engine: Any = trainer.model_wrapped if trainer.is_deepspeed_enabled else None
    if saves is None or saves.disabled or saves.closed or engine is None:
        yield None
        return
    original = engine.checkpoint_engine
    if type(original).__name__ != TORCH_ENGINE:  # another engine (decoupled, fast, DataStates) writes its own way
        if not saves.disabled:
            logger.warning("slurm_jit: async periodic saves need DeepSpeed's %s, not %s: saving synchronously",
                           TORCH_ENGINE, type(original).__name__)
        saves.disabled = True
        yield None
        return
    if _callback_may_write(session, saves):
        yield None
        return
    collector = CollectingEngine(original, ckpt, safetensors.torch.save_file)
    engine.checkpoint_engine = collector
    try:
        with collect.safetensors_collected(collector), \
                collect.state_dict_uncloned(trainer, collector, session.jit_class), \
                collect.trainer_state_collected(trainer, collector), collect.deepspeed_lookup_once():
            yield collector
    finally:
        engine.checkpoint_engine = original


def _callback_may_write(session: Session, saves: AsyncSaves) -> bool:
    """Whether a callback's on_save on any rank may write into the checkpoint (the ranks agree: one all-reduce):
    then this save is synchronous, its on_save before the manifest; said once per train()."""
    trainer = session.trainer
    reason = save_callbacks.sync_reason(trainer)
    if session.agreement.all_true(reason is None):
        return False
    if not saves.sync_said:
        saves.sync_said = True
        logger.log(logging.WARNING if session.is_rank0 else logging.DEBUG, "%s", reason or (
            "slurm_jit: periodic checkpoints written synchronously: a callback's on_save on another rank may write "
            "into the checkpoint (that rank's line says which)"))
    return True


def _stage(trainer: JitTrainerLike, saves: AsyncSaves, collector: CollectingEngine) -> StagedSave | Exception:
    """The collected states in host memory, keyed by their paths in the checkpoint (stable across steps: the buffers
    are reused), the copies deferred but for the module's weights and buffers: only DeepSpeed's optimizer step
    changes the optimizer's states (its fp32 master and moments), which the gate holds; a callback, a forward hook
    (``nn.Embedding(max_norm=...)`` renormalises in place) or a forward (running statistics) may change the
    module's before it."""
    module: Any = trainer.model_wrapped.module  # DeepSpeed's engine (accelerate's unwrap_model: ~2 ms of metadata)
    now = frozenset(t.untyped_storage()._cdata for t in (*module.parameters(), *module.buffers())) | frozenset(
        collector.splits)  # a split view that save_file got changed (a view of it): the module's memory all the same
    try:
        return saves.stager.stage({collector.key(path): state for path, state in collector.collected
                                   if not isinstance(state, files.TrainerStateFile)},  # a snapshot already
                                  defer=True, copy_now=now, sources=collector.sources)
    except HostMemoryError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - any failure to stage is this rank's "no": the ranks then agree
        logger.debug("slurm_jit: staging of %s failed", collector.ckpt, exc_info=True)
        return exc  # (a raise here would leave the other ranks in the agreement until the side group's timeout)


def _all_staged(session: Session, ok: bool) -> bool:
    return session.agreement.all_true(ok)


def _fall_back(session: Session, saves: AsyncSaves, staged: StagedSave | Exception,
               collector: CollectingEngine) -> None:
    """Some rank could not stage: every rank writes this save synchronously (the placeholders filled first), and
    every later one."""
    trainer = session.trainer
    if isinstance(staged, HostMemoryError):
        logger.warning("%s", staged)
    elif isinstance(staged, Exception):
        first = (str(staged).strip().splitlines() or [""])[0][:200]
        logger.warning("slurm_jit: the staging of %s in host memory failed on this rank: %s: %s (the traceback at "
                       "DEBUG, logger %s)", collector.ckpt, type(staged).__name__, first, __name__)
    else:
        staged.release()
    saves.stager.free()
    saves.disabled = True
    if session.is_rank0:
        logger.warning("slurm_jit: async periodic saves off for this run: a rank could not stage its save in host "
                       "memory (its line above); every checkpoint is saved synchronously")
    for _, state in collector.collected:
        for tensor in state.tensors.values() if isinstance(state, files.SafetensorsFile) else ():
            source = collector.sources.get(tensor.untyped_storage()._cdata)
            if source is not None:
                tensor.copy_(source)
    with zip_crc32(trainer.jit_config.zip_crc32):
        for path, state in collector.collected:
            files.write(path, state)


def submit(session: Session, collector: CollectingEngine | None, ckpt: Path, step: int, kind: str,
           phases: Any, t0: float, *, fields: dict[str, Any]) -> bool:
    """After upstream's save: stage the collected states and start their background write (True: the save is
    the background's from here, its on_save told once it is committed), or write them now (False: the caller goes
    on with the synchronous save)."""
    trainer = session.trainer
    saves = _saves(session, create=False)
    if collector is None or saves is None:
        return False
    staged = _stage(trainer, saves, collector)
    fault_points.hit("stage", ckpt)  # fault injection: staged in host memory, the ranks not yet agreed
    if not _all_staged(session, isinstance(staged, StagedSave)):
        _fall_back(session, saves, staged, collector)
        return False
    assert isinstance(staged, StagedSave)
    phases.mark("stage")
    rank, world = int(trainer.args.process_index), int(trainer.args.world_size)
    items = [(path, state if isinstance(state, files.TrainerStateFile) else _later(staged, collector.key(path)))
             for path, state in collector.collected]
    job = InFlight(step, ckpt, fields["contents"], kind, time.monotonic(), staged.nbytes, epoch=trainer.state.epoch)
    share = commit_mod.Share(ckpt, rank, [p for p, _ in items])  # its files never removed once its marker is out
    after = _after(session, job, share, world, kind, fields, [str(p.relative_to(ckpt)) for p, _ in items])
    if saves.writer.submit(ckpt, items, wait_if_busy=False, after=after, release=staged.release,
                           on_error=share.failed,
                           prepare=lambda: _copy(ckpt, staged)) is writer_mod.Submitted.REFUSED_BUSY:
        staged.release()  # cannot be: before_save waited; never two writes on one thread
        raise RuntimeError("slurm_jit: the background writer is still busy. HINT: a bug: report it")
    saves.in_flight = job
    phases.mark("submit")
    blocked_s, waited_s = time.monotonic() - t0, saves.waited_s
    saves.waited_s = 0.0
    run = session.run
    job.gate = step_gate.StepGate(
        trainer.model_wrapped, staged, ckpt,
        record=lambda wait_s: _record_blocked(session, job, kind, blocked_s, waited_s, phases, wait_s),
        feed=lambda phase: stop_path.feed(session, phase),
        watchdog_bound_s=lambda: run.watchdog.phase_bound_s("save") if run and run.watchdog else None)
    logger.log(logging.INFO if session.is_rank0 else logging.DEBUG, "slurm_jit: %s checkpoint %s: training "
               "blocked %.2f s (%d bytes staged, copied beside the next step); written in the background", kind,
               ckpt, blocked_s, staged.nbytes)
    return True


def _later(staged: StagedSave, key: str) -> files.Later:
    """The staged state of ``key``, rebuilt around its buffers when the background writer comes to it."""
    return files.Later(lambda: staged.states[key])


def _copy(ckpt: Path, staged: StagedSave) -> None:
    """The background thread's first work: the deferred copies (the optimizer step's gate opens once they end, even
    where the fault injection raised)."""
    try:
        fault_points.hit("copy", ckpt)  # fault injection: staged, the copies not yet made, the next step held
    finally:
        staged.copy_pending()


def _record_blocked(session: Session, job: InFlight, kind: str, blocked_s: float, waited_s: float,
                    phases: Any, copy_wait_s: float) -> None:
    """The timing log's ``save_blocked``: the save's own seconds and the optimizer step's wait for the copies."""
    run = session.run
    if run is not None and run.timing is not None:
        run.timing.save_blocked(job.step, kind, blocked_s + copy_wait_s, job.nbytes,
                                {"wait_previous": round(waited_s, 6), **phases.seconds,
                                 "copy_wait": round(copy_wait_s, 6)})


def _after(session: Session, job: InFlight, share: commit_mod.Share, world: int, kind: str,
           fields: dict[str, Any], rels: list[str]) -> Callable[[], None]:
    """What the background thread does once this rank's files are durable: the rest of its share durable, its
    marker; rank 0: the commit and the rotation. A failure after the marker keeps the files (commit.Share)."""
    trainer = session.trainer
    run_dir = job.ckpt.parent
    abort = run.async_saves.abort if (run := session.run) is not None and run.async_saves is not None else None
    best_before = trainer.state.best_model_checkpoint  # at the submit: an evaluation may name a newer one meanwhile

    def after() -> None:
        t_after = time.monotonic()
        save_path.fault_sleep()  # fault injection: a slow disk under the background write
        protocol.fsync_tree(job.ckpt)  # this rank's synchronous files, written before the submit
        fault_points.hit("marker", job.ckpt)  # fault injection: this rank's share durable, its marker not written
        with share.reported_once_published():
            share.publish(protocol.file_entries(job.ckpt, rels))
            if share.rank == 0:
                own_s = time.monotonic() - job.submitted_at
                timeout_s = max(commit_mod.COMMIT_WAIT_MIN_S, commit_mod.COMMIT_WAIT_FACTOR * own_s)
                nbytes = commit_mod.commit(job.ckpt, world, timeout_s,
                                           lambda files: _seal(session, job, kind, fields, files), abort=abort)
                share.committed = True
                if not job.commit_gate.stop_asked:  # else the stop waits for the manifest only: the JIT save rotates
                    save_path.rotate_checkpoints_safely(session, run_dir, just_written=job.ckpt,
                                                        best_before=best_before)
                    fault_points.hit("rotated", job.ckpt)  # fault injection: a rotation failing in its last step
                logger.info("slurm_jit: %s checkpoint %s complete in the background, %.2f s after its submission "
                            "(%d bytes)", kind, job.ckpt, time.monotonic() - job.submitted_at, nbytes)
        job.after_s = time.monotonic() - t_after

    return after


def _seal(session: Session, job: InFlight, kind: str, fields: dict[str, Any],
          files: dict[str, dict[str, Any]]) -> int:
    fault_points.hit("manifest", job.ckpt)  # fault injection: the markers removed, the manifest not yet written
    if not job.commit_gate.enter_seal():
        raise commit_mod.CommitError(f"slurm_jit: {job.ckpt} not committed: a JIT stop set it aside; it stays "
                                     f"incomplete ({protocol.SENTINEL_NAME} kept). HINT: the JIT checkpoint is the "
                                     "resume point")
    return save_path.seal(session, job.ckpt, job.step, kind, fields, files)


def before_save(session: Session) -> None:
    """Before any save: the async save in flight durable and committed (a wait, logged), and taken as saved; at a
    JIT stop, the wait bounded by the signal lead (:mod:`.stop_wait`), past which the save is set aside."""
    trainer = session.trainer
    saves = _saves(session, create=False)
    if saves is None or saves.in_flight is None:
        return
    job = saves.in_flight
    t0 = time.monotonic()
    if saves.writer.in_flight:
        logger.info("slurm_jit: the save of step %d waits for the async save of step %d (still being written)",
                    trainer.state.global_step, job.step)
    stop_path.feed(session, "save")  # the hang watchdog gives the wait a save's long bound
    saves.in_flight = None
    if job.gate is not None:
        job.gate.open()  # no optimizer step came between (a stop, the end): the copies are waited for here
    run = session.run
    if run is not None and run.save_kind == "jit":
        stop_wait.settle(session, saves, job, t0)
        return
    error = None
    try:
        saves.writer.wait()  # the background write's error (one line), the sentinel kept
    except save_errors.CheckpointWriteError as exc:
        error = exc
    _raise_on_every_rank(session, job, error)
    saves.waited_s = time.monotonic() - t0
    claim.taken_as_saved(session, job, saves.writer)


def _raise_on_every_rank(session: Session, job: InFlight, error: save_errors.CheckpointWriteError | None,
                         ) -> None:
    """The ranks agree on the save's fate: where any rank's background write failed, every rank raises (its own
    error, or the first failed rank's line), so that no rank goes on into the next save's collectives alone."""
    agreement = session.agreement
    if agreement.all_true(error is None):  # the usual case: one all-reduce; the lines only when a rank failed
        return
    parts = agreement.gather(None if error is None else str(error).splitlines()[0])
    failed = [(rank, why) for rank, why in enumerate(parts or []) if why is not None]
    first = agreement.broadcast(failed[0] if failed else None)
    if error is not None:
        raise error
    if first is not None:
        raise save_errors.CheckpointWriteError(
            f"slurm_jit: the async save of {job.ckpt} failed on rank {first[0]}: {first[1]}")


def finish(session: Session) -> None:
    """The end of training (before the best model is loaded): the save in flight committed, the thread ended,
    the staging buffers freed."""
    saves = _saves(session, create=False)
    if saves is None or saves.closed:
        return
    before_save(session)
    saves.closed = True
    if saves.set_aside is None:
        saves.writer.close()
    else:  # its writer stops at its next file; an error of its commit (aborted) is not this train()'s
        try:
            if not saves.writer.close(saves.set_aside_wait_s):
                logger.warning("slurm_jit: the set-aside save %s is still finishing a file; it stays incomplete",
                               saves.set_aside)
        except save_errors.CheckpointWriteError as exc:
            logger.info("slurm_jit: the set-aside save %s: %s", saves.set_aside, exc)
    saves.stager.free()


def close_after_failure(session: Session) -> None:
    """train() raised: the save in flight may finish (bounded), its error only logged; the thread ended. Where a
    peer was lost (the error in flight says so) rank 0's commit gives up at once: that peer's marker never comes."""
    saves = _saves(session, create=False)
    if saves is None or saves.closed:
        return
    saves.closed = True
    error = sys.exc_info()[1]
    if error is not None and lost_peers.how_lost(error) is not None:
        saves.abort.set()
    if saves.in_flight is not None and saves.in_flight.gate is not None:
        saves.in_flight.gate.restore()  # the engine's step is its own again (the copies end with the thread's job)
    stuck = isinstance(error, step_gate.CopyWaitTimeout)  # its copies never end: its line said it stays incomplete
    try:
        if not saves.writer.close(0.0 if stuck else FAILED_CLOSE_WAIT_S) and not stuck:
            logger.error("slurm_jit: the async save of %s still being written after %.0f s; it stays incomplete",
                         saves.in_flight.ckpt if saves.in_flight else "?", FAILED_CLOSE_WAIT_S)
    except Exception as exc:  # noqa: BLE001 - the error that ended train() goes on, this one is logged
        logger.error("%s", exc)
    saves.stager.free()
