"""Reading a file that anyone who can write the directory may have replaced: regular files only, never blocking,
every read bounded, every JSON error a ValueError.

The one reader below every folder (it imports only the standard library): the checkpoint checks
(:mod:`slurm_jit.checkpoint.formats`), the timing log (:mod:`slurm_jit.timing`) and the records under
``OUT_DIR/slurm-jit/`` (:mod:`slurm_jit.train.output_lock`'s :func:`read_json`, which also never opens the
training's own lock file) all read through it. A symlink, FIFO, socket or device is reported, never opened
(opening a FIFO blocks, reading /dev/zero never ends).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import BinaryIO

JSON_MAX_BYTES = 64 * 1024 * 1024  # parsed whole below this (a hostile 64 MiB of "{}," costs ~1.7 GB to parse)
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # never block, never follow
# What reading and parsing a file others can write raises (UntrustedFile and every JSON error are ValueErrors)
READ_ERRORS = (OSError, ValueError)


class UntrustedFile(ValueError):
    """A path that must not be read: not a regular file, or over a size cap."""


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file reached without a final symlink.

    ``lstat`` first, so that a device or FIFO is never opened (an open can block or have side effects); then
    ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat`` of what was opened, so that a swap in between is caught too.
    """
    before = os.lstat(path)
    if not stat.S_ISREG(before.st_mode):
        raise UntrustedFile(f"{file_kind(before.st_mode)}, not a regular file: not read")
    fd = os.open(path, OPEN_FLAGS)
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino):
            raise UntrustedFile("replaced while being opened: not read")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The whole content of a regular file of at most ``max_bytes`` (else :class:`UntrustedFile`)."""
    with open_regular(path) as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UntrustedFile(f"over {max_bytes} bytes: too large to read")
    return data


def parse_json(data: str | bytes) -> object:
    """``json.loads``, with every way a hostile document fails as a ValueError (JSONDecodeError, a bad encoding,
    an integer of too many digits, and nesting past the recursion limit, which json raises as RecursionError)."""
    try:
        return json.loads(data)
    except RecursionError:  # [[[[... : the parser recurses once per level
        raise ValueError(f"nested deeper than the recursion limit ({sys.getrecursionlimit()})") from None


def load_json(path: str | os.PathLike[str], max_bytes: int = JSON_MAX_BYTES) -> object:
    """A JSON document from a regular file of at most ``max_bytes``; OSError or ValueError (:data:`READ_ERRORS`)
    when it cannot be one."""
    return parse_json(read_bounded(path, max_bytes))
