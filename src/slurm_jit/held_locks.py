"""The lock files this process holds a POSIX lock on: a file that nothing in this process may open.

A POSIX record lock (``fcntl.lockf``) is dropped when its process closes ANY descriptor of the file, a hard link's
included, and it does not exclude its own process (a second JitTrainer here would lock the file again). So
:mod:`slurm_jit.train.output_lock` registers the lock file it takes here, and every reader of a file that others
could have replaced by a link to it (the timing log, a record under ``OUT_DIR/slurm-jit/``, the launcher's gate)
asks here before opening it. Below every folder (standard library only), so that the timing log can ask
without importing the trainer's side.
"""

from __future__ import annotations

import os

# Lock files held by THIS process, by (st_dev, st_ino) -> the lock file's name (for the refusal's words)
_HELD: dict[tuple[int, int], str] = {}


def hold(fd: int, name: str) -> None:
    """``fd``'s file is now locked by this process (called by the module that took the lock)."""
    _HELD[_file_key(fd)] = name


def forget(fd: int) -> None:
    """``fd``'s file is no longer locked here (called before the lock's descriptor is closed)."""
    _HELD.pop(_file_key(fd), None)


def held_lock(path: str | os.PathLike[str]) -> str | None:
    """The name of the lock file ``path`` itself (not what a symbolic link names) is, when this process holds it
    (opening and closing it would drop the lock), else None."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return _HELD.get((st.st_dev, st.st_ino))


def held_here(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a lock file this process holds (:func:`held_lock`)."""
    return held_lock(path) is not None


def _file_key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino
