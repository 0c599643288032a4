"""A JIT stop's wait for the async periodic save in flight, bounded by the signal lead (issue #23: "wait for it if
the grace allows").

The stop's own checkpoint is the newest state; the save in flight is the newest but one, worth waiting for only
while the wait still leaves the JIT save its time before Slurm's SIGKILL. Past that, the save in flight is set
aside: its writer begins no next file, rank 0 writes no manifest for it (its sentinel stays: ``ckpt-check``
calls it ``incomplete``, never complete), and the JIT save begins. The JIT save is then the resume point; if it
too is cut off, the newest complete checkpoint before both is.

The deadline is the earliest stop signal rank 0 knows of (its own; else the one the stop round carried from another
rank, which reads late where the stop came more than kill_wait after it) plus the signal lead,
``SLURM_JIT_SIGNAL_LEAD_S`` (the N of ``--signal=TERM@N``, exported by this project's launchers and sbatch scripts;
Slurm's warning may come up to 60 s earlier than N before the limit, which only leaves more time). The JIT save is
taken to need as long as the longest background write of this output_dir (this run's, and the earlier runs' in the
timing log: :func:`earlier_writes`, read when the run's first async save starts; a set-aside write's time so far
counts) or as long as the save in flight has taken so far, whichever is longer (it writes the same states; a disk
that slowed down slows both), plus grace-calc's margin (20 %, at least 10 s) and the set-aside writer's current file,
which goes on beside the JIT save and which the end of train() waits for (:func:`set_aside_file_s`: twice the
longest one file write measured, 5 s where none was). No lead known (no launcher exported it, a bare
``scancel --signal``), or the stop at the step of the save in flight (that save is the JIT checkpoint: never two
writers on one directory): the stop waits without a bound, as a synchronous save in flight would make it.

Rank 0 computes the bound and broadcasts it, every rank waits that long for its own writer, and the ranks agree
(one all-reduce) whether every rank's share was written. Where one was not (late, or its write failed), rank 0's
:class:`CommitGate` decides: a commit that has already begun its manifest is finished and kept (every rank's files
were durable), else the commit is closed for good and the save set aside. Rank 0 broadcasts which: the same
decision on every rank, and never a manifest for a save set aside, nor its rotation, after the JIT save's.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_jit import timing
from slurm_jit.grace.formula import Margin
from slurm_jit.grace.rules import LEAD_ENV_VAR
from slurm_jit.train import save_errors
from slurm_jit.train.async_save.claim import taken_as_saved
from slurm_jit.train.async_save.in_flight import SET_ASIDE_FILE_UNMEASURED_S, WriteHistory

if TYPE_CHECKING:
    from slurm_jit.train.async_save.in_flight import AsyncSaves, InFlight
    from slurm_jit.train.session import Session

logger = logging.getLogger(__name__)

# The set-aside writer's current file: how long the stop budgets for it and the end of train() waits for it
# (SET_ASIDE_FILE_UNMEASURED_S, in_flight.py: before any file write is measured).
SET_ASIDE_FILE_FACTOR = 2.0  # the longest file write measured, twice: beside the JIT save, two writers share the disk
SET_ASIDE_FILE_MIN_S = 1.0  # a file measured in milliseconds still gets a second (a loaded host's scheduling)
MAX_LEAD_S = 65535  # Slurm's --signal=<sig>@<N> takes N up to 65535 s: a larger "lead" is no lead Slurm gives
_BISECT_ROUNDS = 60  # the bound to far below a millisecond for any lead


def earlier_writes(output_dir: str | os.PathLike[str]) -> WriteHistory:
    """What the timing log of ``output_dir`` says of the background writes so far (none: an empty history)."""
    try:
        stats = timing.async_save_stats(timing.read_records(output_dir))
    except timing.TimingLogError as exc:
        logger.debug("slurm_jit: no earlier background writes read from %s: %s", Path(output_dir), exc)
        return WriteHistory()
    if stats is None:
        return WriteHistory()
    return WriteHistory(longest_write_s=max(stats.background_max_s or 0.0, stats.set_aside_max_s or 0.0),
                        file_max_s=stats.file_max_s)


def set_aside_file_s(file_max_s: float | None) -> float:
    """How long the set-aside writer's current file may still take, from the longest one file write measured."""
    if file_max_s is None:
        return SET_ASIDE_FILE_UNMEASURED_S
    return max(SET_ASIDE_FILE_MIN_S, SET_ASIDE_FILE_FACTOR * file_max_s)


def signal_lead_s() -> float | None:
    """``SLURM_JIT_SIGNAL_LEAD_S`` as seconds, or None (unset, not a number, not positive)."""
    raw = os.environ.get(LEAD_ENV_VAR, "").strip()
    try:
        lead = float(raw) if raw else None
    except ValueError:
        return None
    return lead if lead is not None and 0 < lead <= MAX_LEAD_S else None


def bound_s(*, lead_s: float | None, earliest_signal: float, now: float, submitted_at: float,
            longest_write_s: float, margin: Margin | None = None,
            set_aside_s: float = SET_ASIDE_FILE_UNMEASURED_S) -> float | None:
    """How long the stop may still wait for the save in flight (0: not at all), None without a deadline. Pure.

    All times are one monotonic clock: ``earliest_signal`` (the first stop signal on any rank), ``now``,
    ``submitted_at`` (the save in flight's submission). Waiting until ``t`` leaves the JIT save
    ``max(longest_write_s, t - submitted_at)``, the margin of that and ``set_aside_s`` (the set-aside writer's
    current file, :func:`set_aside_file_s`) before ``earliest_signal + lead_s``."""
    if lead_s is None:
        return None
    margin = margin or Margin()
    deadline = earliest_signal + lead_s

    def fits(t: float) -> bool:
        need = max(longest_write_s, t - submitted_at, 0.0)
        return t + need + margin.seconds(need) + set_aside_s <= deadline

    if not fits(now):
        return 0.0
    low, high = now, max(now, deadline)  # fits(low); the wait ends before the deadline whatever the need
    for _ in range(_BISECT_ROUNDS):
        mid = (low + high) / 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return min(low - now, lead_s)


def settle(session: Session, saves: AsyncSaves, job: InFlight, t0: float) -> None:
    """A JIT stop: the save in flight written within the bound on every rank (taken as saved), or set aside; a
    background write that failed is logged, never raised: the JIT save is the stop's to write (a full disk fails
    it with its own line)."""
    bound = _stop_bound(session, saves, job)
    error, written = None, True
    try:
        written = saves.writer.wait(bound)
    except save_errors.CheckpointWriteError as exc:
        error = exc
    agreement = session.agreement
    if agreement.all_true(written and error is None):  # the same decision on every rank
        saves.waited_s = time.monotonic() - t0
        taken_as_saved(session, job, saves.writer)
        return
    kept = agreement.broadcast(not job.commit_gate.close() if session.is_rank0 else None)
    if not kept:
        _set_aside(session, saves, job, bound, error, time.monotonic() - job.submitted_at)
        return
    try:  # rank 0's manifest had begun: every rank's files are durable, the commit ends in a moment
        saves.writer.wait()
    except save_errors.CheckpointWriteError as exc:
        error = error or exc
    if error is not None:  # rank 0's manifest failed (a full disk): not saved; the JIT save decides
        logger.warning("%s", error)
    if agreement.all_true(error is None):  # every rank takes it as saved, or none: the same save path after
        taken_as_saved(session, job, saves.writer)


def _stop_bound(session: Session, saves: AsyncSaves, job: InFlight) -> float | None:
    """Rank 0's bound on the JIT stop's wait (:func:`bound_s`), the same on every rank; None (no bound)
    at the step of the save in flight: that save is the stop's checkpoint, whose directory it is writing. Every rank
    also keeps rank 0's budget for the set-aside file: the end of train()'s wait for it."""
    trainer = session.trainer
    bound, file_s = None, SET_ASIDE_FILE_UNMEASURED_S
    run = session.run
    if session.is_rank0 and run is not None and run.kill_wait_until > 0 and job.step != trainer.state.global_step:
        carried = run.kill_wait_until - trainer.jit_config.kill_wait_s  # late where the stop came after kill_wait
        earliest = min(carried, run.latch.first_at) if run.latch.first_at is not None else carried
        files = [s for s in (saves.longest_file_s, saves.earlier.file_max_s) if s is not None]
        file_s = set_aside_file_s(max(files) if files else None)
        bound = bound_s(lead_s=signal_lead_s(), earliest_signal=earliest, now=time.monotonic(),
                        submitted_at=job.submitted_at, set_aside_s=file_s,
                        longest_write_s=max(saves.longest_write_s, saves.earlier.longest_write_s))
    bound, file_s = session.agreement.broadcast((bound, file_s))
    saves.set_aside_wait_s = float(file_s)
    return None if bound is None else float(bound)


def _set_aside(session: Session, saves: AsyncSaves, job: InFlight, bound: float | None,
               error: save_errors.CheckpointWriteError | None, elapsed_s: float) -> None:
    """Some rank's share of the save in flight is late or failed at the stop: every rank's writer stops before its
    next file, rank 0's commit is closed (no manifest: the sentinel stays), the JIT save goes on. The timing log
    gets the write's time so far (a lower bound), so that grace-calc sizes the next lead with it."""
    trainer = session.trainer
    saves.writer.cancel()
    saves.abort.set()
    saves.set_aside, saves.disabled = job.ckpt, True  # any later save (none after a JIT stop) is synchronous
    run = session.run
    if run is not None and run.timing is not None:
        run.timing.save_background(job.step, job.kind, elapsed_s, 0, {"set_aside": True, "staged_bytes": job.nbytes})
    if error is not None:  # this rank's share failed: the JIT save's own outcome decides
        logger.warning("%s", error)
    if session.is_rank0:
        why = "still being written" if error is None else "not written on every rank"
        logger.warning("slurm_jit: the async save of %s is %s %.1f s after its submission (the stop waited %.1f s); "
                       "set aside (it stays incomplete, never claimed) for the JIT save of step %d. HINT: a longer "
                       "--signal lead keeps both (grace-calc --from %s sizes it with the async save in flight)",
                       job.ckpt, why, elapsed_s, bound or 0.0, trainer.state.global_step, trainer.args.output_dir)
