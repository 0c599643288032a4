"""The stop path of ``JitTrainer``: where a stop lands, and what records it.

Owns the boundary decision (a stop wish sent ahead by the step time, the agreed round of each optimizer-step
boundary, the agreement mode fixed after warm-up), the stop itself at ``_maybe_log_save_evaluate`` (periodic
evaluation and save skipped, the JIT save, ``should_training_stop``), the stop record's ``jit_stop``/``failed``
lines written by the trainer, the stop's timing fields, and the runtime grace checks run at calm boundaries.
The rank agreement itself is :mod:`slurm_jit.train.agreement`; the record's format :mod:`.stop_record`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_jit.timing import WARMUP_STEPS
from slurm_jit.train import lost_peers, runtime_grace, signals, stop_record, subclassing, trackers, watchdog
from slurm_jit.train.agreement import Decision
from slurm_jit.train.run_state import Run, StopBeforeFirstStep, signal_name
from slurm_jit.train.trackers import log_stop_to_trackers

if TYPE_CHECKING:
    from slurm_jit.train.session import JitTrainerLike, Session

logger = logging.getLogger(__name__)


def wish(session: Session, steps_ahead: int = 1) -> tuple[bool, float | None]:
    """(stop, remaining kill_wait): this rank wants to stop once kill_wait since its first signal passes
    within ``steps_ahead`` steps: the steps until the next chance to stop (1 where this round is read now, 2
    where it is read one step on). The save then waits out the rest, never longer than by waiting."""
    trainer = session.trainer
    run = session.run
    if run is None or run.latch.first_at is None:
        return False, None
    remaining_s = run.latch.first_at + trainer.jit_config.kill_wait_s - time.monotonic()
    return steps_ahead * run.est_step_s >= remaining_s, remaining_s


def at_boundary(session: Session) -> Decision:
    """The stop round of this optimizer-step boundary; fixes the agreement mode after warm-up."""
    trainer = session.trainer
    run = session.run
    assert run is not None
    agreement = session.agreement
    if run.signal_step is None and run.latch.seen:
        run.signal_step = trainer.state.global_step
    choose = run.steps_done == WARMUP_STEPS + 1  # the first timed step, the same on every rank
    decision = agreement.at_boundary(*wish(session, agreement.latency_steps), step_s=run.est_step_s,
                                     choose_mode=choose, done_step=session.saver.done_step())
    run.agreement_mode = agreement.mode
    if choose and agreement.choice is not None:
        choice = agreement.choice
        logger.info("slurm_jit: steps of %.3f s, a stop round costs %.4f s: rounds read %s (blocking from "
                    "%.2f s steps)", choice.step_s, choice.allreduce_s, choice.mode, choice.threshold_s)
        if run.timing is not None:
            run.timing.agreement(trainer.state.global_step, mode=choice.mode, allreduce_s=choice.allreduce_s,
                                 step_s=choice.step_s, threshold_s=choice.threshold_s,
                                 kill_wait_s=trainer.jit_config.kill_wait_s)
        run.grace_due.append("warm-up")  # run at the next calm boundary, never on the stop path
    return decision


def take(session: Session, decision: Decision) -> bool:
    """Record an agreed stop and when kill_wait (since the earliest signal on any rank) will have passed."""
    run = session.run
    if decision.stop and run is not None and not run.stop_now:
        run.stop_now = True
        run.kill_wait_until = time.monotonic() + decision.wait_s
    return decision.stop


def agree_now(session: Session) -> bool:
    """A stop round read at once (after a save or an evaluation), taken when agreed."""
    return take(session, session.agreement.agree_now(*wish(session)))


def on_train_begin(session: Session) -> None:
    run = session.run
    if run is None:
        return
    if session.agreement.agree_now(run.latch.seen).stop:
        run.stopped = True
        logger.warning("slurm_jit: stop signal before the first step: exiting without a new checkpoint")
        raise StopBeforeFirstStep
    run.in_loop = True
    run.step_t0 = time.monotonic()
    start_watchdog(session, run)


def on_step_end(session: Session) -> None:
    trainer = session.trainer
    run = session.run
    if run is None:
        return
    run.est_step_s = time.monotonic() - run.step_t0
    run.steps_done += 1
    if run.watchdog is not None:
        run.watchdog.step_done(run.est_step_s, trainer.state.global_step)
    if run.timing is not None:
        run.timing.step(trainer.state.global_step, run.est_step_s)


def at_last_step(trainer: JitTrainerLike) -> bool:
    return bool(trainer.state.max_steps) and trainer.state.global_step >= trainer.state.max_steps


def log_save_evaluate(session: Session, run: Run, upstream: Callable[[], None], model: Any,
                      trial: Any) -> None:
    """``_maybe_log_save_evaluate`` inside the loop: this boundary's stop round, upstream's evaluation and save
    (skipped once a stop is agreed), then the JIT save and the stop, or a calm boundary's grace checks."""
    trainer = session.trainer
    step = trainer.state.global_step
    last_step = at_last_step(trainer)  # training ends here anyway: nothing to stop
    done_step = None
    if step != run.polled_step:  # once per optimizer step; epoch ends call this again at the same step
        run.polled_step = step
        decision = at_boundary(session)
        take(session, decision)
        done_step = decision.done_step
    if run.stopped:  # an epoch's end after the stop, at its step: the uninterrupted run logs no partial window here
        trainer.control.should_log = False
    if run.stop_now and not last_step:
        run.eval_owed = run.eval_owed or trainer.control.should_evaluate
        trainer.control.should_evaluate = False
        trainer.control.should_save = False
    upstream()
    if done_step is not None:  # an async save every rank has written: on_save now, where upstream calls it
        session.saver.tell_committed(done_step)
    if not run.stop_now and step in (run.saved_step, session.saver.in_flight_step()):
        agree_now(session)  # a periodic save just ended: a stop that came during it is taken here, not a step later
    if _stopping(run, step, last_step, session.saver.in_flight_contents(step)):
        if run.saved_step != step:
            save_jit(session, model, trial)
        run.checkpoint = str(Path(session.hooks.output_dir(trial=None)) / f"checkpoint-{step}")
        first = not run.stopped  # an epoch end calls this again at the same step: one line per stop
        run.stopped = True
        record_stop(session)
        if first:
            announce_stop(session, run)
        trainer.control.should_training_stop = True
        feed(session, "end of training")
    else:
        if not run.stop_now:
            run_due_grace_checks(session)  # never between a stop decision and the exit: it may query Slurm
        run.step_t0 = time.monotonic()
        feed(session, "end of training" if last_step else "step")


def save_jit(session: Session, model: Any, trial: Any) -> None:
    """The stop's checkpoint: once the engine and the Trainer agree on the step and kill_wait has passed, the
    trainer's ``_save_checkpoint`` (train/save_path.py) with the kind ``jit``."""
    trainer = session.trainer
    run = session.run
    assert run is not None
    engine_step = getattr(trainer.model_wrapped, "global_steps", None) if trainer.is_deepspeed_enabled else None
    if engine_step is not None and engine_step != trainer.state.global_step:
        raise RuntimeError(
            f"slurm_jit: DeepSpeed engine at step {engine_step} but Trainer at {trainer.state.global_step}; "
            "refusing a checkpoint whose name and contents would disagree"
        )
    remaining_s = run.kill_wait_until - time.monotonic()  # the wish may come before kill_wait is over
    if remaining_s > 0:
        time.sleep(remaining_s)
    run.save_kind = "jit"
    run.save_started_at = time.monotonic()
    try:
        session.hooks.save_checkpoint(model, trial)
    finally:
        run.save_kind = None
    subclassing.refuse_unsaved_jit(trainer, run.saved_step, session.jit_class)  # an override skipped super() here
    run.save_ended_at = time.monotonic()


def _stopping(run: Run, step: int, last_step: bool, in_flight_contents: str | None = None) -> bool:
    stopping = (run.stop_now or run.eval_aborted) and not last_step
    contents = run.saved_contents if run.saved_step == step else in_flight_contents  # an async save not yet counted
    if stopping and contents not in (None, "full"):
        # The stop came during a model-only periodic save (save_only_model): it cannot be resumed from, and
        # its directory must not be replaced. Train one more step and write a full JIT checkpoint there.
        logger.warning("slurm_jit: stop during a model-only save of step %d: a full JIT checkpoint follows "
                       "after the next step", step)
        return False
    return stopping


def start_watchdog(session: Session, run: Run) -> None:
    """This rank's hang watchdog (train/watchdog.py), from the first step on; its old hang report removed."""
    trainer = session.trainer
    timeout = trainer.jit_config.hang_timeout_s
    if timeout is None or run.watchdog is not None:
        return
    rank = int(trainer.args.process_index)
    stop_record.hang_report_path(str(trainer.args.output_dir), rank).unlink(missing_ok=True)
    run.watchdog = watchdog.Watchdog(timeout, rank, on_hang=lambda hang: record_hang(session, run, hang))
    run.watchdog.start(trainer.state.global_step)


def feed(session: Session, phase: str) -> None:
    """A boundary: the watchdog's clock starts again, for ``phase``."""
    trainer = session.trainer
    run = session.run
    if run is not None and run.watchdog is not None:
        run.watchdog.feed(phase, trainer.state.global_step)


def stop_watchdog(run: Run) -> None:
    if run.watchdog is not None:
        run.watchdog.stop()
        run.watchdog = None


def record_hang(session: Session, run: Run, hang: watchdog.Hang) -> None:
    """The watchdog's thread, before the exit: this rank's hang report; rank 0 (the output_dir's lock holder) also
    the stop record ``hung``, with the reports the other ranks wrote meanwhile."""
    trainer = session.trainer
    run.hung = True
    out_dir = str(trainer.args.output_dir)
    stop_record.write_hang_report(out_dir, hang.rank, dataclasses.asdict(hang))
    if not session.is_rank0 or session.output_lock is None:
        return
    dog = run.watchdog  # None once the main thread's train() ended meanwhile
    wait_s = dog.report_wait_s() if dog is not None else watchdog.PEER_REPORT_WAIT_S
    ranks = stop_record.wait_for_reports(out_dir, stop_record.HANG_REPORT_GLOB, int(trainer.args.world_size), wait_s)
    unreported = _unreported(session, ranks)
    with stop_record.WRITE_LOCK:  # the main thread's jit_stop is written whole, and then said, before this reads
        if run.finish_recorded:  # training reached its end, every save complete: nothing to requeue for
            _keep_finished(trainer, hang)
            return
        if run.stop_recorded:  # the stop checkpoint is complete: still a JIT stop (requeue), the hang after it
            stop_record.write(out_dir, "jit_stop", step=trainer.state.global_step, checkpoint=run.checkpoint,
                              signal=signal_name(run.latch.first_signum), ranks=ranks,
                              error_after_stop=f"hung in '{hang.phase}' at {hang.frame} (exit "
                                               f"{watchdog.HUNG_EXIT_CODE})")
        else:
            stop_record.write(out_dir, "hung", step=hang.step, ranks=ranks, unreported=unreported, checkpoint=None,
                              resumed_from=run.resumed_from)
    if not run.stop_recorded:  # the trackers say which rank hung (a JIT stop's summary was already logged)
        trackers.log_hang_to_trackers(trainer, {"state": "hung", "step": hang.step, "ranks": ranks,
                                                "unreported": unreported})


def _keep_finished(trainer: JitTrainerLike, hang: watchdog.Hang) -> None:
    """A hang after rank 0 wrote ``finished`` (the side group's closing barrier, waiting for a peer still ending):
    the record stays ``finished``, as after a lost peer (lost_peers.KEPT_STATES); this line says why exit 87."""
    logger.error("slurm_jit: hang on rank %d after training reached its end (%.0f s in '%s', waiting in %s): the "
                 "stop record stays finished, no requeue. HINT: the other ranks' logs say which one was still "
                 "ending; its checkpoints are complete (`ckpt-check %s`)", hang.rank, hang.since_s, hang.phase,
                 hang.frame, trainer.args.output_dir)


def _unreported(session: Session, reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks without a hang report when rank 0 writes ``hung``, with their nodes (the side group gathered
    them): a rank whose process or node is gone never reports, and it is the one the others wait for."""
    trainer = session.trainer
    world = int(trainer.args.world_size)
    agreement = session.open_agreement
    nodes = list(agreement.nodes) if agreement is not None and len(agreement.nodes) == world else [None] * world
    seen = {report.get("rank") for report in reports}
    return [{"rank": rank, "node": nodes[rank]} for rank in range(world) if rank not in seen]


@signals.worker_deaths_held()  # a DataLoader worker's death must not cut the record short
def record_stop(session: Session) -> None:
    """Rank 0 records ``jit_stop`` as soon as the stop checkpoint is complete (nothing slow in between)."""
    trainer = session.trainer
    run = session.run
    if run is None or run.stop_recorded or not session.is_rank0:
        return
    with stop_record.WRITE_LOCK:  # the watchdog's thread reads stop_recorded under it (record_hang)
        stop_record.write(str(trainer.args.output_dir), "jit_stop", step=trainer.state.global_step,
                          checkpoint=run.checkpoint, signal=signal_name(run.latch.first_signum))
        run.stop_recorded = True


def announce_stop(session: Session, run: Run) -> None:
    """The JIT stop's one line in the job log, rank 0 only, at warning level so that it shows without any logging
    set up: the signal and the step it came at, the step of the stop (later by the steps run during the kill wait),
    the checkpoint and the seconds (the save's, and since the signal)."""
    trainer = session.trainer
    if not session.is_rank0:
        return
    now = time.monotonic()
    save = ""
    if run.save_started_at is not None and run.save_ended_at is not None:
        save = f"saved in {run.save_ended_at - run.save_started_at:.2f} s, "
    since = f"{now - run.latch.first_at:.2f} s after the signal" if run.latch.first_at is not None else "now"
    name = signal_name(run.latch.first_signum)
    signal = (f"{name} at step {run.signal_step}" if name and run.signal_step is not None
              else name or "another rank's signal")  # rank 0 saw none: the agreement stopped it
    logger.warning("slurm_jit: JIT stop: %s, stopped at step %d, checkpoint %s complete (%s%s); the next run resumes "
                   "from it", signal, trainer.state.global_step, run.checkpoint, save, since)


# The launcher decides from the stop record, not from the exit status; 0 keeps srun's --kill-on-bad-exit from killing
# the ranks still on their way out, and a submitit function's outcome a success (launch/runner.py)
EXIT_STATUS_AFTER_JIT_STOP = 0


def exit_after_stop(is_rank0: bool) -> None:
    """End the process after a JIT stop (``JitConfig.exit_after_jit_stop``): train() has closed everything and the
    stop record is written; what a script does after train() would run in the grace period and be cut by the
    SIGKILL (a half-written final model). ``SystemExit``: atexit handlers and the trackers' finish still run."""
    if is_rank0:
        logger.warning("slurm_jit: JIT stop: the process exits now (status %d), so nothing after train() runs in the "
                       "grace period. HINT: JitConfig(exit_after_jit_stop=False) returns from train() instead "
                       "(check trainer.jit_stopped)", EXIT_STATUS_AFTER_JIT_STOP)
    raise SystemExit(EXIT_STATUS_AFTER_JIT_STOP)


@signals.worker_deaths_held()  # a DataLoader worker's death must not cut the record short
def record_end(session: Session, run: Run) -> None:
    """``train()`` returned: the trackers and (rank 0) the stop record say ``jit_stop`` or ``finished``."""
    trainer = session.trainer
    state = "jit_stop" if run.stopped else "finished"
    run.trackers_told = True
    log_stop_to_trackers(trainer, state, trainer.state.global_step, signal_name(run.latch.first_signum))
    if not session.is_rank0:
        return
    with stop_record.WRITE_LOCK:
        if not run.stop_recorded and not run.hung:  # a watchdog that fired meanwhile writes its own record
            stop_record.write(str(trainer.args.output_dir), state, step=trainer.state.global_step,
                              checkpoint=run.checkpoint, signal=signal_name(run.latch.first_signum))
            # the watchdog runs on through the side group's closing barrier: a hang there keeps this record
            run.stop_recorded, run.finish_recorded = run.stopped, not run.stopped


@signals.worker_deaths_held()  # a DataLoader worker's death must not cut the record short
def record_failure(session: Session, run: Run, exc: BaseException) -> None:
    trainer = session.trainer
    if _lost_peer(session, run, exc):
        return
    error = signals.failure_line(exc)[:2000]
    if run.timing is not None and not run.hung:  # rank 0's too: a survivor that sees it gone rewrites its record
        _report_own_failure(trainer, error)  # a survivor may see only this rank gone: it quotes the report
    if not session.is_rank0 or session.output_lock is None:
        return  # only the output_dir's lock holder writes its stop record (a refused launch is not it)
    if run.hung:
        return  # the watchdog's thread is writing ``hung`` before the exit
    try:
        _write_failure(trainer, run, error)
    except OSError as write_exc:  # a full disk: the record cannot be written; the error itself must go on
        said = str(write_exc)  # a StopRecordError is already the one line, prefix and HINT included
        logger.error("%s", said if said.startswith("slurm_jit:") else f"slurm_jit: stop record not written: {said}")
    if run.stop_recorded and not run.trackers_told:  # the trackers say what the record says: a JIT stop
        run.trackers_told = True
        log_stop_to_trackers(trainer, "jit_stop", trainer.state.global_step, signal_name(run.latch.first_signum),
                             error_after_stop=error)


def _report_own_failure(trainer: JitTrainerLike, error: str) -> None:
    """A rank whose train() raised its own error: its report, written before this process ends (and so before its
    peers see it gone), for the survivor that names it lost (lost_peers.record). Rank 0's too: its own ``failed``
    record is then rewritten by that survivor, which must still say why rank 0 ended (seen: a DataLoader worker's
    death on rank 0 became a bare lost peer, which the launcher requeues as a hang instead of a crash)."""
    rank = int(trainer.args.process_index)
    try:
        stop_record.write_report(stop_record.failed_report_path(str(trainer.args.output_dir), rank), {
            "rank": rank, "step": getattr(trainer.state, "global_step", None), "error": error})
    except OSError as write_exc:  # a full disk: the report cannot be written; the error itself must go on
        logger.error("slurm_jit: rank %d's failure report not written: %s", rank, write_exc)


def _lost_peer(session: Session, run: Run, exc: BaseException) -> bool:
    """A collective failed because a peer ended (train/lost_peers.py): every survivor reports, the lowest one
    writes ``failed`` with ``lost_peer``. Not when a peer's watchdog ended it (``hung``) or after the stop's
    checkpoint is complete (still ``jit_stop``)."""
    trainer = session.trainer
    how = lost_peers.how_lost(exc)
    if how is None or run.hung or run.stop_recorded or stop_record.hang_reports(str(trainer.args.output_dir)):
        return False
    if run.timing is None:  # not started on this rank (a peer gone at the side group's creation): no report into
        return False  # an output_dir that may not be this run's (rank 0 locked out of it, or never made it)
    try:
        lost_peers.record(session, run, how)
    except OSError as write_exc:  # a full disk: the record cannot be written; the error itself must go on
        logger.error("slurm_jit: lost-peer record not written: %s", write_exc)
    return True


def _write_failure(trainer: JitTrainerLike, run: Run, error: str) -> None:
    if run.stop_recorded:  # the stop checkpoint is complete: still a JIT stop (requeue), with what went wrong
        stop_record.write(str(trainer.args.output_dir), "jit_stop", step=trainer.state.global_step,
                          checkpoint=run.checkpoint, signal=signal_name(run.latch.first_signum),
                          error_after_stop=error)
    elif stop_record.hang_reports(str(trainer.args.output_dir)):  # a peer's watchdog ended it: this error follows
        stop_record.write(str(trainer.args.output_dir), "hung", step=getattr(trainer.state, "global_step", None),
                          ranks=stop_record.hang_reports(str(trainer.args.output_dir)), error=error)
    else:
        stop_record.write(str(trainer.args.output_dir), "failed", step=getattr(trainer.state, "global_step", None),
                          error=error)


def record_stop_timing(trainer: JitTrainerLike, run: Run) -> None:
    """On a JIT stop, where the time from this rank's first signal until now (train() returning) went."""
    if not run.stopped or run.latch.first_at is None or run.timing is None:
        return
    now, wall = time.monotonic(), time.time()
    fields: dict[str, Any] = {
        "signal_step": run.signal_step, "mode": run.agreement_mode, "kill_wait_s": trainer.jit_config.kill_wait_s,
        "signal_time": wall - (now - run.latch.first_at), "end_time": wall,
    }
    if run.save_started_at is not None and run.save_ended_at is not None:
        fields.update(signal_to_save_s=run.save_started_at - run.latch.first_at,
                      save_s=run.save_ended_at - run.save_started_at, teardown_s=now - run.save_ended_at,
                      save_start_time=wall - (now - run.save_started_at))
    run.timing.stop(trainer.state.global_step, signal_to_end_s=now - run.latch.first_at, fields=fields)


def run_due_grace_checks(session: Session) -> None:
    """Rank 0, at a boundary where training goes on and no signal is seen here (it may query Slurm)."""
    trainer = session.trainer
    run = session.run
    # Before warm-up has passed the timing log has no step to judge by: the checks wait (they run once each).
    if run is None or not run.grace_due or run.latch.seen or run.steps_done <= WARMUP_STEPS:
        return
    due, run.grace_due = run.grace_due, []
    if run.timing is not None:
        run.timing.flush()
    for when in due:
        if not trainer.jit_config.grace_check or when in run.grace_checked or not session.is_rank0:
            continue
        run.grace_checked.add(when)
        runtime_grace.check_and_warn(str(trainer.args.output_dir), trainer.jit_config.kill_wait_s, when,
                                     world_size=int(trainer.args.world_size))
