"""The memory guard: the staging buffers are allocated only where host memory can hold them.

:func:`check_host_memory` raises :class:`HostMemoryError` (one line with a HINT; the caller falls back to synchronous
saves) when ``nbytes`` more would not fit into this rank's share of the memory it may use: the smaller of what the
kernel says is available (``psutil.virtual_memory().available``, MemAvailable) and the room left under the memory
limit of this process's cgroup (Slurm's ``--mem`` is enforced there, and psutil does not see it), less
:data:`HOST_MEMORY_MARGIN_BYTES` (or ``SLURM_JIT_ASYNC_MEMORY_MARGIN``, :data:`MARGIN_ENV`), divided among the ranks
of this node that stage at the same time.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from slurm_jit.grace.parsing import parse_size
from slurm_jit.grace.rules import GraceError

# MemAvailable is the kernel's estimate of what can be allocated without swapping (proc(5)), taken before the
# buffers exist; training keeps allocating after the check (the next batches, the dataloader workers' prefetch,
# torch's host caching allocator), so 1 GiB of it stays unclaimed. A chosen headroom, not a measured one: the demo
# rank's whole RSS is under 1 GiB; raise it for large dataloaders.
HOST_MEMORY_MARGIN_BYTES = 1 << 30
# The margin for this process instead (512MiB, 4GiB, 0): raise it where dataloaders or other processes of the job
# grow after the check; set in every rank's environment (the job script's export reaches them all).
MARGIN_ENV = "SLURM_JIT_ASYNC_MEMORY_MARGIN"
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")
_NO_LIMIT = 1 << 62  # cgroup v1 reports "no limit" as a huge page-rounded number (9223372036854771712)
GIB = 1024**3


class HostMemoryError(RuntimeError):
    """The staging buffers would not fit in host memory; the message is one line with a HINT."""


def margin_from_env() -> int:
    """The safety margin: ``SLURM_JIT_ASYNC_MEMORY_MARGIN`` where set, else :data:`HOST_MEMORY_MARGIN_BYTES`; a value
    that is no size is a HostMemoryError (one line: the saves stay synchronous, never an error of training)."""
    text = os.environ.get(MARGIN_ENV, "").strip()
    if not text:
        return HOST_MEMORY_MARGIN_BYTES
    if text == "0":
        return 0
    try:
        return parse_size(text, what=MARGIN_ENV)
    except GraceError as exc:
        raise HostMemoryError(f"slurm_jit: async periodic saves: {exc}; periodic saves stay synchronous "
                              f"(e.g. {MARGIN_ENV}=4GiB)") from None


def check_host_memory(nbytes: int, *, sharing_ranks: int = 1, margin_bytes: int | None = None) -> None:
    """Return when ``nbytes`` more host memory fits this rank's share (module docstring); else HostMemoryError.
    ``margin_bytes``: None reads :func:`margin_from_env`."""
    margin_bytes = margin_from_env() if margin_bytes is None else margin_bytes
    available, source = available_bytes()
    share = (available - margin_bytes) // max(sharing_ranks, 1)
    if nbytes <= share:
        return
    ranks = f", shared by {sharing_ranks} ranks of this node" if sharing_ranks > 1 else ""
    raise HostMemoryError(
        f"slurm_jit: async periodic saves need {nbytes / GIB:.2f} GiB of host memory for this rank's staging buffer, "
        f"but its share is {max(share, 0) / GIB:.2f} GiB ({source}: {available / GIB:.2f} GiB available, less a "
        f"{margin_bytes / GIB:.2f} GiB safety margin{ranks}); periodic saves stay synchronous. HINT: ask for more "
        f"memory (#SBATCH --mem), lower the margin ({MARGIN_ENV}=512MiB) if the job's memory use is steady, or set "
        "JitConfig(async_periodic_saves=False) to save synchronously without this line")


def available_bytes(proc_cgroup: Path = _PROC_CGROUP, cgroup_root: Path = _CGROUP_ROOT) -> tuple[int, str]:
    """(bytes this process may still allocate, where the number comes from): psutil's or the cgroup's, the smaller."""
    host = int(psutil.virtual_memory().available)
    room = cgroup_room(proc_cgroup, cgroup_root)
    if room is not None and room < host:
        return room, "the cgroup's memory limit"
    return host, "host memory"


def cgroup_room(proc_cgroup: Path = _PROC_CGROUP, cgroup_root: Path = _CGROUP_ROOT) -> int | None:
    """The smallest room (limit less the working set) of this process's memory cgroup and its ancestors; None when
    no limit is set or none can be read. The working set is usage less the inactive page cache, which the kernel
    reclaims before it kills (kubelet and docker stats count memory so)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # cgroup v2: one unified hierarchy
            rooms += _rooms(cgroup_root, rel, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # cgroup v1: the memory controller's own hierarchy
            rooms += _rooms(cgroup_root / "memory", rel, "memory.limit_in_bytes", "memory.usage_in_bytes",
                            "total_inactive_file")
    return min(rooms) if rooms else None


def _rooms(root: Path, rel: str, limit_name: str, usage_name: str, inactive_key: str) -> list[int]:
    """limit - (usage - inactive page cache) of each cgroup from ``rel`` up to ``root`` that has a limit."""
    rooms = []
    directory = root / rel.lstrip("/")
    while directory.is_relative_to(root):
        limit = _read_int(directory / limit_name)
        if limit is not None and limit < _NO_LIMIT:
            usage = _read_int(directory / usage_name) or 0
            rooms.append(limit - max(usage - _stat_value(directory / "memory.stat", inactive_key), 0))
        if directory == root:
            break
        directory = directory.parent
    return rooms


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0

