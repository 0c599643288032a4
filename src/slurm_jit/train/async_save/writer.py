"""The background writer: one thread per process that writes one staged save at a time, durably.

A caller may rely on:

- :meth:`BackgroundWriter.submit` runs ``prepare`` first (the staging's deferred copies), then starts the write of
  a list of ``(path, staged state)`` (``torch.save`` under the project's ``zip_crc32`` setting,
  :func:`slurm_jit.train.zip_crc.zip_crc32`, or safetensors: :mod:`.files`), then fsyncs each file and each
  directory from the files' up to the checkpoint directory, then runs ``after`` (e.g. this rank's "done" marker),
  then ``release`` (the staging buffers are free again; it runs whatever happened).
- One save in flight at most, never a queue: a ``submit`` while one is in flight waits for it
  (``wait_if_busy=True``, up to ``timeout_s``) or is refused; the returned :class:`Submitted` says which.
- A failed write is never lost: its error (a refused write, ENOSPC/EDQUOT/EROFS, as the synchronous save's one line
  with a HINT, :mod:`slurm_jit.train.save_errors`; any other as one line naming it) is raised, once, as
  :class:`~slurm_jit.train.save_errors.CheckpointWriteError` by the next :meth:`wait`, :meth:`submit` or
  :meth:`close`. Its traceback is logged at DEBUG.
- :meth:`wait` returns True once nothing is in flight (the last save's files durable), False at its timeout.
- :meth:`close` waits for the save in flight and ends the thread; call it at the end of training. The thread is a
  daemon: a process that ends without ``close`` leaves the save in flight unfinished, which the protocol's
  sentinel already calls incomplete.
- The thread never calls ``torch.distributed`` (a collective from a second thread would interleave with
  training's): telling the other ranks that this rank's share is durable is ``after``'s file, not a message.
- ``on_error`` (given to :meth:`~BackgroundWriter.submit`) runs in the thread when the write fails, before the
  error is kept for the caller: e.g. a "failed" marker that tells rank 0 at once (its own failure only logged).
- :meth:`cancel` stops the save in flight before its next file (or its fsyncs, or ``after``): nothing more is
  written for it, no error is kept, ``release`` still runs; a JIT stop sets a save aside this way when the signal
  lead leaves no time to wait for it (:mod:`.stop_wait`). The file being written when it is called is finished.
- ``zip_crc32``: the thread sets torch's ``compute_crc32`` around its ``torch.save`` calls; torch keeps its config
  values per thread (a ContextVar, torch 2.13), so a JIT save on the training thread while a set-aside write
  finishes its file keeps its own setting.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_jit.checkpoint import protocol
from slurm_jit.train import save_errors
from slurm_jit.train.async_save import fault_points, files
from slurm_jit.train.zip_crc import zip_crc32 as zip_records_crc32

logger = logging.getLogger(__name__)

THREAD_NAME = "slurm-jit-async-save"


class _Cancelled(Exception):  # noqa: N818 - not an error: the caller asked for it
    """The save in flight was cancelled (:meth:`BackgroundWriter.cancel`)."""


class Submitted(enum.Enum):
    """What :meth:`BackgroundWriter.submit` did."""

    STARTED = "started"  # nothing was in flight: the write started
    STARTED_AFTER_WAIT = "started after wait"  # waited for the one in flight (it succeeded), then started
    REFUSED_BUSY = "refused busy"  # one was in flight and the caller did not wait (or its wait timed out): nothing


@dataclass(frozen=True)
class WriteStats:
    """Where one background write's seconds went (separate from the seconds training was blocked: staging)."""

    ckpt_dir: Path
    nbytes: int  # bytes of the files written
    write_s: float  # torch.save of every file
    fsync_s: float  # fsync of every file and directory
    total_s: float  # from the write's start until every file and directory is durable (``after`` not included)
    file_max_s: float = 0.0  # the longest one file's write took (what a set-aside writer's current file may take)


@dataclass(frozen=True)
class _Job:
    ckpt_dir: Path
    items: tuple[tuple[Path, Any], ...]
    after: Callable[[], None] | None
    release: Callable[[], None] | None
    on_error: Callable[[str], None] | None = None
    prepare: Callable[[], None] | None = None


class BackgroundWriter:
    """One background thread writing one staged save at a time (module docstring)."""

    def __init__(self, *, zip_crc32: bool) -> None:
        """``zip_crc32``: JitConfig.zip_crc32, the setting the synchronous save writes its zip records with."""
        self._zip_crc32 = zip_crc32
        self._cond = threading.Condition()
        self._job: _Job | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._cancel = threading.Event()
        self.last_stats: WriteStats | None = None
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        """Whether a save is being written now."""
        with self._cond:
            return self._job is not None

    @property
    def done_ok(self) -> bool:
        """Whether nothing is in flight and no error is kept: the last save's write, and its ``after``, succeeded."""
        with self._cond:
            return self._job is None and self._error is None

    def submit(self, ckpt_dir: Path, items: Sequence[tuple[Path, Any]], *, wait_if_busy: bool,
               timeout_s: float | None = None, after: Callable[[], None] | None = None,
               release: Callable[[], None] | None = None,
               on_error: Callable[[str], None] | None = None,
               prepare: Callable[[], None] | None = None) -> Submitted:
        """Start writing ``items`` (paths under ``ckpt_dir``); raises the previous write's error, if any, instead
        (nothing started, ``release`` not called). Refused: nothing started, ``release`` not called."""
        ckpt_dir = Path(ckpt_dir)
        outside = [str(p) for p, _ in items if not Path(p).is_relative_to(ckpt_dir)]
        if outside:
            raise ValueError(f"slurm_jit: {outside[0]} is not under the checkpoint directory {ckpt_dir}. HINT: pass "
                             "the checkpoint-<step> directory the files belong to")
        with self._cond:
            self._raise_if_failed()
            if self._closed:
                raise RuntimeError("slurm_jit: the background checkpoint writer is closed. HINT: submit before "
                                   "close(), or make a new BackgroundWriter")
            waited = self._job is not None
            if waited and wait_if_busy:
                self._cond.wait_for(lambda: self._job is None, timeout=timeout_s)
                self._raise_if_failed()
            if self._job is not None:
                return Submitted.REFUSED_BUSY
            self._cancel.clear()
            self._job = _Job(ckpt_dir, tuple((Path(p), s) for p, s in items), after, release, on_error, prepare)
            self._cond.notify_all()
            return Submitted.STARTED_AFTER_WAIT if waited else Submitted.STARTED

    def wait(self, timeout_s: float | None = None) -> bool:
        """True when nothing is in flight (the last save durable); False at the timeout; raises its error."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._job is None, timeout=timeout_s)
            self._raise_if_failed()
            return done

    def cancel(self) -> None:
        """Stop the save in flight before its next file; :meth:`wait` and :meth:`close` then return as after a
        write that ended (nothing to raise for it)."""
        self._cancel.set()

    def close(self, timeout_s: float | None = None) -> bool:
        """Wait for the save in flight, end the thread; False when it still runs at the timeout. Raises its error."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            self._raise_if_failed()
        return not self._thread.is_alive()

    def _raise_if_failed(self) -> None:
        """Raise the captured error once (the caller holds the lock)."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._closed)
                job = self._job
                if job is None:
                    return  # closed with nothing in flight
            error = self._write_job(job)
            with self._cond:
                self._job, self._error = None, error
                self._cond.notify_all()

    def _write_job(self, job: _Job) -> BaseException | None:
        """The write of one job; its error as the caller will get it, or None."""
        try:
            try:
                if job.prepare is not None:
                    job.prepare()
                with save_errors.disk_full_is_one_line(job.ckpt_dir):
                    self.last_stats = _write_durably(job, self._zip_crc32, self._cancel)
                    _check(self._cancel)
                    if job.after is not None:
                        job.after()
            finally:
                if job.release is not None:
                    job.release()
        except _Cancelled:
            logger.info("slurm_jit: the background write of %s stopped: set aside (it stays incomplete)",
                        job.ckpt_dir)
            return None
        except save_errors.CheckpointWriteError as exc:
            logger.debug("slurm_jit: background write of %s failed", job.ckpt_dir, exc_info=True)
            return _report(job, exc)
        except Exception as exc:  # any failure goes to the caller, never lost in the thread
            logger.debug("slurm_jit: background write of %s failed", job.ckpt_dir, exc_info=True)
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            return _report(job, save_errors.CheckpointWriteError(
                f"slurm_jit: the background write of {job.ckpt_dir} failed: {type(exc).__name__}: {first}. It stays "
                f"incomplete ({protocol.SENTINEL_NAME} kept); earlier checkpoints are untouched. HINT: the traceback "
                "is logged at DEBUG (logger slurm_jit.train.async_save.writer); save synchronously "
                "(JitConfig(async_periodic_saves=False)) to see it in the training's own traceback"))
        return None


def _report(job: _Job, error: save_errors.CheckpointWriteError) -> save_errors.CheckpointWriteError:
    """``on_error`` told (best effort: on a full disk its own file may not fit either; logged), the error kept."""
    if job.on_error is not None:
        try:
            job.on_error(str(error))
        except Exception as exc:  # noqa: BLE001 - the write's own error is the one that matters
            logger.warning("slurm_jit: could not report the failed write of %s: %s", job.ckpt_dir, exc)
    return error


def _check(cancel: threading.Event) -> None:
    if cancel.is_set():
        raise _Cancelled


def _write_durably(job: _Job, zip_crc32: bool, cancel: threading.Event) -> WriteStats:
    """torch.save of each item, then fsync of each file and each directory up to the checkpoint directory; stops
    before the next file once ``cancel`` is set."""
    t0 = time.monotonic()
    directories: set[Path] = set()
    file_max_s = 0.0
    with zip_records_crc32(zip_crc32):
        for i, (path, state) in enumerate(job.items):
            _check(cancel)
            path.parent.mkdir(parents=True, exist_ok=True)
            t_file = time.monotonic()
            files.write(path, state)
            file_max_s = max(file_max_s, time.monotonic() - t_file)
            directories.update(_dirs_up_to(path.parent, job.ckpt_dir))
            if i == 0:
                fault_points.hit("write", job.ckpt_dir)  # fault injection: the first file written, not the rest
    t_write = time.monotonic()
    _check(cancel)
    nbytes = 0
    for path, _ in job.items:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
            nbytes += os.fstat(fd).st_size
        finally:
            os.close(fd)
    for directory in sorted(directories, key=lambda d: len(d.parts), reverse=True):  # deepest first
        protocol.fsync_dir(directory)
    t_sync = time.monotonic()
    return WriteStats(job.ckpt_dir, nbytes, t_write - t0, t_sync - t_write, t_sync - t0, file_max_s)


def _dirs_up_to(directory: Path, top: Path) -> list[Path]:
    """``directory`` and its parents up to ``top`` (the checkpoint directory; its own entry in the output directory
    is the sentinel's, already durable)."""
    found = [directory]
    while directory != top and directory.parent != directory and directory.is_relative_to(top):
        directory = directory.parent
        found.append(directory)
    return found
