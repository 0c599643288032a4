"""The floors a save, a resume and ``ckpt-check --deep`` are held to (issue #34): the same bytes per rank written
from memory (``os.write`` in large chunks, then fsync) or read back, by as many threads as ranks (``os.write``
and ``os.readv`` release the GIL), on the same filesystem. On tmpfs (``/dev/shm``) the floor is memory bandwidth
and the kernel's page handling, what any writer pays: best of 3, the target. On the real disk, here a host cache
whose speed moves 5x between runs: min/median/max of 5, reported."""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import xxhash

from slurm_jit.bench.disk import CHUNK_BYTES
from slurm_jit.checkpoint import names
from slurm_jit.checkpoint.manifest import HASH_CHUNK_BYTES

logger = logging.getLogger(__name__)

TMPFS = Path("/dev/shm")  # Linux's tmpfs of every glibc system: the filesystem without a disk under it
FLOOR_TARGET = "<= 1.25"  # issue #34: a save (a resume, a deep check) within 25 % of the raw floor on tmpfs
TMPFS_TRIALS = 3  # best of 3: the floor is what the machine can do, so the fastest trial is the measure
DISK_TRIALS = 5  # min/median/max of 5: the disk here swings, so its spread is what is reported
# A checkpoint of fp32 training holds 12 bytes per parameter (master weights + Adam's two moments) and the
# model-states and small files a little more: 16 is a bound for the room a run on tmpfs needs per copy.
STATE_BYTES_PER_PARAM = 16
# Copies on tmpfs at once: the checkpoint, the floor's files beside it, the resume's final save.
TMPFS_COPIES = 3
TMPFS_SPARE_BYTES = 2 * 2**30  # left free in tmpfs and in memory (tmpfs pages are memory) for everything else


@dataclass(frozen=True, kw_only=True)
class Spread:
    """Seconds of several trials of one floor."""

    min_s: float
    median_s: float
    max_s: float

    def as_details(self) -> dict[str, float]:
        return {"min_s": round(self.min_s, 4), "median_s": round(self.median_s, 4), "max_s": round(self.max_s, 4)}


def best_of(trials_s: Sequence[float]) -> float:
    """The fastest trial: what the machine can do (slower ones measured something else besides)."""
    if not trials_s or min(trials_s) <= 0:
        raise ValueError(f"a floor needs positive trial times, got {list(trials_s)}")
    return min(trials_s)


def spread(trials_s: Sequence[float]) -> Spread:
    best_of(trials_s)  # the same check
    return Spread(min_s=min(trials_s), median_s=statistics.median(trials_s), max_s=max(trials_s))


def over_floor(measured_s: float, floor_s: float) -> float:
    """How many times the floor a measurement took (1.0: at the floor)."""
    if floor_s <= 0 or measured_s < 0:
        raise ValueError(f"cannot compare {measured_s} s with a floor of {floor_s} s")
    return measured_s / floor_s


def above_floor(phases_s: Mapping[str, float], floor_s: float, carrier: str = "write") -> dict[str, float]:
    """Where a save's seconds above the floor went: the ``carrier`` phase (the one that moves the bytes) less
    the floor, every other phase whole; a carrier faster than the floor shows as negative."""
    return {name: round(s - floor_s if name == carrier else s, 4) for name, s in phases_s.items()}


rank_of = names.writer_rank  # the rank that writes a checkpoint file, from its name


def by_rank(files: Mapping[str, int], world_size: int) -> list[list[tuple[str, int]]]:
    """The checkpoint's files (relative path -> bytes) dealt to the ranks that write them."""
    if world_size < 1:
        raise ValueError(f"world size {world_size}: want at least 1")
    out: list[list[tuple[str, int]]] = [[] for _ in range(world_size)]
    for rel, size in sorted(files.items()):
        rank = rank_of(rel)
        if rank >= world_size:
            raise ValueError(f"{rel} names rank {rank}, beyond a world size of {world_size}")
        out[rank].append((rel, size))
    return out


def state_bytes(params: int) -> int:
    """A bound on one checkpoint's bytes for a model of ``params`` parameters (fp32, Adam)."""
    return params * STATE_BYTES_PER_PARAM


def room_missing(need_bytes: int, free_bytes: int, available_memory_bytes: int) -> str | None:
    """Why tmpfs cannot take ``need_bytes`` now, or None when it can (its free space and the memory behind it)."""
    want = need_bytes + TMPFS_SPARE_BYTES
    if free_bytes < want:
        return (f"{TMPFS} has {free_bytes / 2**30:.1f} GiB free, the run needs {want / 2**30:.1f} GiB "
                f"({TMPFS_COPIES} copies of the checkpoint + {TMPFS_SPARE_BYTES / 2**30:.0f} GiB spare)")
    if available_memory_bytes < want:
        return (f"{available_memory_bytes / 2**30:.1f} GiB of memory available, the run's tmpfs files need "
                f"{want / 2**30:.1f} GiB")
    return None


def tmpfs_room_missing(need_bytes: int, root: Path = TMPFS) -> str | None:
    """:func:`room_missing` for this machine now; also why when there is no tmpfs at ``root``."""
    if not root.is_dir() or not os.access(root, os.W_OK):
        return f"no writable tmpfs at {root}"
    return room_missing(need_bytes, shutil.disk_usage(root).free, psutil.virtual_memory().available)


@contextmanager
def scratch(root: Path, name: str) -> Iterator[Path]:
    """A fresh directory under ``root``, removed with everything in it when the block ends (however it ends)."""
    path = Path(tempfile.mkdtemp(prefix=f"slurm-jit-bench-{name}-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _source(nbytes: int) -> memoryview:
    """``nbytes`` of incompressible bytes in touched memory, to write from as a save writes its tensors."""
    block = os.urandom(2**20)
    return memoryview(block * (nbytes // len(block) + 1))[:nbytes]


def _write_rank(paths: list[Path], sizes: list[int], source: memoryview) -> int:
    """One writer: its files in turn from consecutive parts of ``source``, each in CHUNK_BYTES writes, fsynced."""
    offset = 0
    for path, size in zip(paths, sizes, strict=True):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            end = offset + size
            while offset < end:
                offset += os.write(fd, source[offset:min(end, offset + CHUNK_BYTES)])
            os.fsync(fd)
        finally:
            os.close(fd)
    return offset


def write_trials(directory: Path, sizes_by_rank: Sequence[Sequence[int]], trials: int) -> list[float]:
    """Seconds of each of ``trials`` parallel writes (one thread per rank, all started together) of each rank's
    file sizes into ``directory``; the files are removed after each trial."""
    sources = [_source(sum(sizes)) for sizes in sizes_by_rank]
    paths = [[directory / f"rank{r}-file{i}.bin" for i in range(len(sizes))] for r, sizes in enumerate(sizes_by_rank)]
    sizes_lists = [list(sizes) for sizes in sizes_by_rank]
    times: list[float] = []
    with ThreadPoolExecutor(max_workers=len(sizes_by_rank), thread_name_prefix="bench-floor") as pool:
        for _ in range(trials):
            start_s = time.monotonic()
            written = sum(pool.map(_write_rank, paths, sizes_lists, sources))
            times.append(time.monotonic() - start_s)
            for path in (p for ps in paths for p in ps):
                path.unlink(missing_ok=True)
            logger.info("bench: floor write of %d bytes by %d writers in %s: %.3f s", written, len(paths),
                        directory, times[-1])
    return times


def _read_rank(paths: list[Path]) -> int:
    buf = bytearray(CHUNK_BYTES)
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    return total


def read_trials(paths_by_rank: Sequence[Sequence[Path]], trials: int) -> list[float]:
    """Seconds of each of ``trials`` parallel reads (one thread per rank) of each rank's files."""
    return _parallel_trials(_read_rank, [list(paths) for paths in paths_by_rank], trials, "read")


def _parallel_trials(work: Callable[[Any], int], per_rank: list[Any], trials: int, what: str) -> list[float]:
    """Seconds of each of ``trials`` runs of ``work`` on every rank's item at once, one thread per rank."""
    times: list[float] = []
    with ThreadPoolExecutor(max_workers=len(per_rank), thread_name_prefix="bench-floor") as pool:
        for _ in range(trials):
            start_s = time.monotonic()
            done = sum(pool.map(work, per_rank))
            times.append(time.monotonic() - start_s)
            logger.info("bench: floor %s of %d bytes by %d threads: %.3f s", what, done, len(per_rank), times[-1])
    return times


def _hash_rank(source: memoryview) -> int:
    """One hasher: the manifest's checksum (xxh3-128, in the manifest's chunks) of ``source``, from memory."""
    digest = xxhash.xxh3_128()
    for offset in range(0, len(source), HASH_CHUNK_BYTES):
        digest.update(source[offset:offset + HASH_CHUNK_BYTES])
    digest.digest()
    return len(source)


def hash_trials(sizes_by_rank: Sequence[Sequence[int]], trials: int) -> list[float]:
    """Seconds of each of ``trials`` parallel checksums (one thread per rank, as each rank hashes the files it wrote
    for the manifest) of each rank's bytes, from memory: no file, no copy. A checkpoint whose every byte carries a
    checksum costs at least this beside its write; the save rows report it, to show what of the time above the write
    floor the checksum alone takes on this CPU."""
    return _parallel_trials(_hash_rank, [_source(sum(sizes)) for sizes in sizes_by_rank], trials, "checksum")
