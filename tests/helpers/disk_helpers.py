"""Real full file systems for the tests of refused writes: fill a (small tmpfs) mount until it answers ENOSPC."""

from __future__ import annotations

import os
from pathlib import Path


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
