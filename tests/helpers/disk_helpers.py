"""Real full file systems for the tests of refused writes: fill a (small tmpfs) mount until it answers ENOSPC."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

MOUNT_TIMEOUT_S = 60  # mount(8) and umount(8) of a tmpfs answer in milliseconds; a hang fails the test, not the run


def fill(mount: Path) -> None:
    """Write a filler file until the file system answers ENOSPC."""
    fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def tmpfs(mount: Path, size_bytes: int, *, read_only: bool = False) -> Iterator[Path]:
    """A real tmpfs of ``size_bytes`` at ``mount`` (created), read-only if asked (EROFS), unmounted after. Root only."""
    mount.mkdir(parents=True, exist_ok=True)
    options = f"size={size_bytes}" + (",ro" if read_only else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], check=True, timeout=MOUNT_TIMEOUT_S)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=MOUNT_TIMEOUT_S)


def assert_one_line(message: str, *words: str) -> None:
    """A refused write's error: one line with a HINT, naming each of ``words``."""
    assert "\n" not in message and "HINT:" in message, message
    for word in words:
        assert word in message, message
