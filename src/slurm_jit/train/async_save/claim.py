"""The training thread takes an async periodic save as saved: the run's saved step, the timing log's
``save_background`` record, and the callbacks that read the checkpoint told (:mod:`slurm_jit.train.save_callbacks`).

It happens at one instant on every rank: where the ranks have agreed that every rank's write is done, rank 0's
ending with the manifest. Either a step boundary's stop round carries it (:func:`done_step` sent by each rank,
:func:`tell_committed` with the agreed value: the first boundary after the commit), or the wait of the next save, of
a JIT stop or of the end of training agrees on it (:func:`slurm_jit.train.async_save.periodic.before_save`,
:func:`slurm_jit.train.async_save.stop_wait.settle`) and calls :func:`taken_as_saved`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_jit.train import save_callbacks

if TYPE_CHECKING:
    from slurm_jit.train.async_save.in_flight import AsyncSaves, InFlight
    from slurm_jit.train.async_save.writer import BackgroundWriter
    from slurm_jit.train.session import Session

NOT_DONE = -1  # what a rank sends in the stop round while no save in flight is written (done_step)


def taken_as_saved(session: Session, job: InFlight, writer: BackgroundWriter) -> None:
    """Every rank's files of ``job`` durable and rank 0's manifest written (the ranks agreed): the run's saved step,
    the timing log's record, then the callbacks' ``on_save``."""
    run = session.run
    if run is None:
        return
    run.saved_step, run.saved_contents, run.checkpoint = job.step, job.contents, str(job.ckpt)
    stats = writer.last_stats
    if stats is not None and stats.ckpt_dir == job.ckpt and run.async_saves is not None:
        saves = run.async_saves
        saves.longest_write_s = max(saves.longest_write_s, stats.total_s + job.after_s)
        saves.longest_file_s = max(saves.longest_file_s or 0.0, stats.file_max_s)
    if run.timing is not None and stats is not None and stats.ckpt_dir == job.ckpt:
        run.timing.save_background(job.step, job.kind, stats.total_s + job.after_s, stats.nbytes, {
            "write_s": round(stats.write_s, 6), "fsync_s": round(stats.fsync_s, 6),
            "commit_s": round(job.after_s, 6), "file_max_s": round(stats.file_max_s, 6),
            "staged_bytes": job.nbytes})
    save_callbacks.tell_readers(session, job.step, job.epoch)


def _saves(session: Session) -> AsyncSaves | None:
    run = session.run
    saves: AsyncSaves | None = run.async_saves if run is not None else None
    return saves


def done_step(session: Session) -> int:
    """What this rank sends in the stop round: the step of the save in flight once its writer is done without an
    error (rank 0's: committed), else :data:`NOT_DONE`."""
    saves = _saves(session)
    job = saves.in_flight if saves is not None else None
    return job.step if job is not None and saves is not None and saves.writer.done_ok else NOT_DONE


def tell_committed(session: Session, agreed_step: int) -> None:
    """At a step boundary, the agreed stop round's :func:`done_step` (the same on every rank): where it is the save
    in flight's, every rank takes it as saved and tells its callbacks, here."""
    saves = _saves(session)
    job = saves.in_flight if saves is not None else None
    if saves is None or job is None or job.step != agreed_step:
        return
    saves.in_flight = None
    if job.gate is not None:
        job.gate.open()  # opened by the optimizer step since (a no-op), unless no step came between
    taken_as_saved(session, job, saves.writer)
