"""The barrier-free commit of an async periodic save: per-rank done markers, and rank 0's manifest once all exist.

Each rank's background thread, once its files are durable, writes its done marker (:func:`write_marker`): the
sizes and checksums of the files it wrote in the background (:func:`slurm_jit.checkpoint.protocol.file_entries`),
through a temporary file, fsync and rename, so that a marker is either whole or absent. Rank 0's thread waits for
all ``world_size`` markers (:func:`wait_for_markers`, with a deadline) and then :func:`commit`: the files no marker
lists (the small files every rank wrote synchronously before its background write, durable before its marker) are
hashed, the markers removed, and the manifest written by the caller's ``seal`` (the synchronous path's own
:func:`slurm_jit.train.save_path.seal`), which removes the sentinel last. No collective runs in a thread.

A rank whose background write fails writes a failed marker instead (:func:`write_failed_marker`, best effort:
its one-line error), and rank 0 gives up at once (:class:`CommitError` naming the rank) rather than at the
deadline, which is left for a rank that died or could not write even that small file. That is before its done
marker only (:class:`Share`): once the marker is renamed into place, rank 0 may commit (or have committed) the
rank's files, which are then never removed; a later failure (the marker's directory fsync, rank 0's commit or
rotation) is reported in a line that says so, and the checkpoint is as complete as the protocol says.

Until then the sentinel stays: a directory with markers and no manifest is ``incomplete`` by the protocol
(:mod:`slurm_jit.checkpoint.protocol`), never ``corrupt``. The markers' names start with ``.`` + the manifest's
name, which :func:`~slurm_jit.checkpoint.protocol.payload_files` leaves out; they are removed before the manifest
is written, so that a committed checkpoint holds the files a synchronous save writes, and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from slurm_jit.checkpoint import formats, protocol
from slurm_jit.train.async_save import fault_points
from slurm_jit.train.save_errors import CheckpointWriteError

logger = logging.getLogger(__name__)

MARKER_PREFIX = f".{protocol.MANIFEST_NAME}.done-rank"  # + the global rank
FAILED_PREFIX = f".{protocol.MANIFEST_NAME}.failed-rank"  # + the global rank: its background write failed
POLL_S = 0.05  # how often rank 0 looks for the other ranks' markers: a save's write takes far longer
# How long rank 0 waits for the other ranks' markers after its own: the ranks write shares of about one size, so a
# rank still writing after 10x rank 0's own write time (and at least COMMIT_WAIT_MIN_S) is taken as failed.
COMMIT_WAIT_MIN_S = 300.0
COMMIT_WAIT_FACTOR = 10.0


class CommitError(CheckpointWriteError):
    """The checkpoint could not be committed; it stays incomplete. The message is one line with a HINT."""


def marker_path(ckpt: Path, rank: int) -> Path:
    return ckpt / f"{MARKER_PREFIX}{rank}"


def write_marker(ckpt: Path, rank: int, entries: dict[str, dict[str, Any]],
                 published: Callable[[], None] | None = None) -> None:
    """This rank's share of ``ckpt`` is durable: its files' entries, in a marker that is whole or absent.
    ``published`` runs once the marker is in place (rank 0 may read it from then on), before its directory fsync."""
    target = marker_path(ckpt, rank)
    tmp = target.with_name(f"{target.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump({"rank": rank, "files": entries}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(tmp, target)
    if published is not None:
        published()
    fault_points.hit("published", ckpt)  # fault injection: the marker in place, the directory not yet fsynced
    protocol.fsync_dir(ckpt)


def failed_marker_path(ckpt: Path, rank: int) -> Path:
    return ckpt / f"{FAILED_PREFIX}{rank}"


def write_failed_marker(ckpt: Path, rank: int, why: str, partial: Sequence[Path] = ()) -> None:
    """This rank's share of ``ckpt`` will never be durable: a marker for rank 0's commit to stop at, with ``why``
    (one line) where it fits. On a full disk the marker must still appear: this rank's ``partial`` files (its
    background files, useless in a checkpoint that can never be committed) are removed first, and the marker is
    created before its reason is written (an empty marker says "failed" all the same)."""
    for path in partial:
        with contextlib.suppress(OSError):
            path.unlink()
    fd = os.open(failed_marker_path(ckpt, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        with contextlib.suppress(OSError):
            os.write(fd, (why.splitlines()[0] if why else "failed").encode())
            os.fsync(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        protocol.fsync_dir(ckpt)


class Share:
    """One rank's share of an async save (its background files) and whether it is published: its done marker in
    place. Before, a failure removes the files and leaves a failed marker (rank 0's commit stops at once); from
    then on rank 0 may commit (or have committed) them: they are never removed, and a failure is reported in a line
    that says whether the checkpoint is complete. Used in the background writer's thread only."""

    def __init__(self, ckpt: Path, rank: int, files: Sequence[Path]) -> None:
        self.ckpt, self.rank, self.files = ckpt, rank, tuple(files)
        self.published = False  # this rank's done marker is in place
        self.committed = False  # rank 0: the manifest is written (the checkpoint complete)

    def publish(self, entries: dict[str, dict[str, Any]]) -> None:
        """This rank's done marker (:func:`write_marker`)."""
        write_marker(self.ckpt, self.rank, entries, published=self._mark_published)

    def _mark_published(self) -> None:
        self.published = True

    def failed(self, why: str) -> None:
        """The background write failed (its ``on_error``): a failed marker, this rank's files removed first, unless
        the share is published (then nothing is removed: the error itself is raised to training as usual)."""
        if self.published:
            logger.info("slurm_jit: rank %d's files of %s are kept (its done marker was published before: %s)",
                        self.rank, self.ckpt, (why.splitlines() or [""])[0][:200])
            return
        write_failed_marker(self.ckpt, self.rank, why, self.files)

    @contextlib.contextmanager
    def reported_once_published(self) -> Iterator[None]:
        """A failure once the share is published raised as a :class:`CheckpointWriteError` whose line says that the
        files are kept (a CheckpointWriteError of its own, e.g. a commit that did not happen, passes unchanged)."""
        try:
            yield
        except CheckpointWriteError:
            raise
        except Exception as exc:
            if not self.published:
                raise
            logger.debug("slurm_jit: after the done marker of rank %d in %s", self.rank, self.ckpt, exc_info=True)
            first = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            check = f"ckpt-check {self.ckpt.parent}"
            if self.committed:
                line = (f"slurm_jit: {self.ckpt} is complete (its manifest written), but rank 0's rotation of older "
                        f"checkpoints (save_total_limit) then failed: {first}. The checkpoint and its files are kept; "
                        f"it is the resume point. HINT: {check} lists what the rotation left")
            else:
                line = (f"slurm_jit: rank {self.rank}'s files of {self.ckpt} are durable and were reported so (its "
                        f"done marker), then: {first}. Its files are kept (rank 0 commits the checkpoint once every "
                        f"rank reported). HINT: {check} says whether it is complete and names the resume point")
            raise CheckpointWriteError(f"{line}; the traceback is logged at DEBUG (logger {__name__})") from None


def _raise_if_a_rank_failed(ckpt: Path, world_size: int) -> None:
    for rank in range(world_size):
        path = failed_marker_path(ckpt, rank)
        if path.exists():
            why = path.read_text(encoding="utf-8", errors="replace").strip()[:300] or "no reason: its disk was full"
            raise CommitError(f"slurm_jit: {ckpt} not committed: rank {rank}'s background write failed ({why}); it "
                              f"stays incomplete ({protocol.SENTINEL_NAME} kept), the previous complete checkpoint "
                              f"is the resume point. HINT: rank {rank}'s log says why")


def read_markers(ckpt: Path, world_size: int) -> dict[int, dict[str, dict[str, Any]]]:
    """The markers present now: rank -> its files' entries (a marker that is not one is a CommitError)."""
    found = {}
    for rank in range(world_size):
        path = marker_path(ckpt, rank)
        if not path.exists():
            continue
        try:
            marker = formats.load_json(path)
            if not isinstance(marker, dict):
                raise ValueError("not a JSON object")
            files = marker["files"]
            if marker.get("rank") != rank or not isinstance(files, dict):
                raise ValueError("not this rank's marker")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CommitError(f"slurm_jit: {path} is not a done marker ({type(exc).__name__}: {exc}); {ckpt} "
                              "stays incomplete. HINT: nothing but slurm_jit writes these files") from None
        found[rank] = files
    return found


def wait_for_markers(ckpt: Path, world_size: int, timeout_s: float, poll_s: float = POLL_S,
                     abort: threading.Event | None = None) -> dict[int, dict[str, dict[str, Any]]]:
    """Every rank's marker, once all exist; CommitError at the deadline, or at once when ``abort`` is set (train()
    ended with a peer lost: its marker can never come). The checkpoint stays incomplete."""
    deadline = time.monotonic() + timeout_s
    while True:
        if abort is not None and abort.is_set():
            raise CommitError(f"slurm_jit: {ckpt} not committed: training ended with a peer lost, whose files can "
                              f"never be durable; it stays incomplete ({protocol.SENTINEL_NAME} kept). HINT: the "
                              "previous complete checkpoint is the resume point")
        _raise_if_a_rank_failed(ckpt, world_size)
        found = read_markers(ckpt, world_size)
        if len(found) == world_size:
            return found
        if time.monotonic() >= deadline:
            missing = [r for r in range(world_size) if r not in found]
            raise CommitError(
                f"slurm_jit: {ckpt} not committed: rank(s) {missing} did not report their files durable within "
                f"{timeout_s:.1f} s; it stays incomplete ({protocol.SENTINEL_NAME} kept), the previous complete "
                "checkpoint is the resume point. HINT: those ranks' logs say why their background write failed")
        time.sleep(poll_s)


def commit(ckpt: Path, world_size: int, timeout_s: float,
           seal: Callable[[dict[str, dict[str, Any]]], int], poll_s: float = POLL_S,
           abort: threading.Event | None = None) -> int:
    """Rank 0: once every marker exists, the manifest of every file (``seal``), then the sentinel removed.
    Returns what ``seal`` returns (the bytes)."""
    markers = wait_for_markers(ckpt, world_size, timeout_s, poll_s, abort)
    listed = {rel: entry for entries in markers.values() for rel, entry in entries.items()}
    present = protocol.payload_files(ckpt)
    gone = sorted(set(listed) - set(present))
    if gone:
        raise CommitError(f"slurm_jit: {ckpt} not committed: {gone[0]} is in a done marker but not on disk; it "
                          "stays incomplete. HINT: something else removed files from the checkpoint directory")
    files = {**protocol.file_entries(ckpt, [rel for rel in present if rel not in listed]), **listed}
    for rank in markers:
        marker_path(ckpt, rank).unlink()
    protocol.fsync_dir(ckpt)
    return seal(files)
