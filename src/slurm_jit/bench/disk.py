"""Row 1: the output filesystem's limits, sequential write (O_DIRECT, else buffered + fsync) and read (page cache
dropped where this process may, else O_DIRECT, else said), with the same byte count as the checkpoint."""

from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

from slurm_jit.bench.rows import REFERENCE, Row, measured

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 * 1024 * 1024  # large sequential requests, as torch.save's writes of big tensors are
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
MB = 1_000_000  # bandwidths in MB/s (decimal), as dd and fio print them


@dataclass(frozen=True, kw_only=True)
class DiskLimits:
    write_bps: float
    read_bps: float
    write_how: str  # "O_DIRECT" or "buffered + fsync"
    read_how: str  # how the page cache was kept out of the read, or that it could not be
    nbytes: int


def drop_page_cache() -> bool:
    """``echo 3 > /proc/sys/vm/drop_caches`` (needs root); False when not allowed."""
    try:
        os.sync()
        DROP_CACHES.write_text("3\n")
        return True
    except OSError:
        return False


def _write(path: Path, nbytes: int) -> tuple[float, str]:
    buf = mmap.mmap(-1, CHUNK_BYTES)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1024) * (CHUNK_BYTES // 1024))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd, how = os.open(path, flags | os.O_DIRECT), "O_DIRECT"
    except (OSError, AttributeError):
        fd, how = os.open(path, flags), "buffered + fsync"
    start_s = time.monotonic()
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    return written / (time.monotonic() - start_s), how


def _read(path: Path) -> tuple[float, str]:
    if drop_page_cache():
        fd, how = os.open(path, os.O_RDONLY), "page cache dropped (root)"
    else:
        try:
            fd, how = os.open(path, os.O_RDONLY | os.O_DIRECT), "O_DIRECT (could not drop the page cache: not root)"
        except (OSError, AttributeError):
            fd, how = os.open(path, os.O_RDONLY), "MAY BE CACHED: neither drop_caches nor O_DIRECT allowed"
    buf = mmap.mmap(-1, CHUNK_BYTES)
    start_s = time.monotonic()
    total = 0
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    return total / (time.monotonic() - start_s), how


def measure(directory: Path, nbytes: int) -> DiskLimits:
    """Write then read ``nbytes`` (rounded up to whole chunks) in ``directory``; the file is removed after."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "bench-disk.bin"
    nbytes = max(CHUNK_BYTES, -(-nbytes // CHUNK_BYTES) * CHUNK_BYTES)
    try:
        write_bps, write_how = _write(path, nbytes)
        read_bps, read_how = _read(path)
    finally:
        path.unlink(missing_ok=True)
    return DiskLimits(write_bps=write_bps, read_bps=read_bps, write_how=write_how, read_how=read_how, nbytes=nbytes)


def rows(limits: DiskLimits, directory: Path) -> list[Row]:
    size = f"{limits.nbytes / MB:.0f} MB"
    return [
        measured("disk_write", limits.write_bps / MB, "MB/s", REFERENCE,
                 f"sequential write of {size} ({limits.write_how}) in {directory}: the limit saves are held to"),
        measured("disk_read", limits.read_bps / MB, "MB/s", REFERENCE,
                 f"sequential read of {size} ({limits.read_how}): the limit verify and resume are held to"),
    ]
