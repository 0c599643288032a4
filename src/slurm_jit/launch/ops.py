"""Whether the DeepSpeed ops a CPU job JIT-builds are built already, for the plan's ``ops:`` line.

DeepSpeed installed with ``DS_BUILD_OPS=0`` builds an op the first time a run needs it (torch's extension
builder, ``ninja``) into ``TORCH_EXTENSIONS_DIR``: on CPU ranks the communication op ``deepspeed_shm_comm``,
about 80 s on 2 idle cores, inside the first job, where the job's own time limit can cut the build off (and its
``lock`` file then makes every later start wait). The plan says so before the job is submitted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

# The op every CPU DeepSpeed rank loads (tools/setup-env prebuilds it with the Adam kernels).
CPU_COMM_OP = "deepspeed_shm_comm"
BUILD_S_MEASURED = 80  # tools/setup-env: ~80 s on 2 idle cores; a loaded machine takes several times that
DOCS = "docs/install.md#build-deepspeeds-ops-before-the-first-job"
# torch's builder holds ROOT/<op>/lock (torch.utils.file_baton) for a build, or seconds while a rank loads a built
# op; a build killed (a time limit) leaves it, and every later start then waits on it forever, silently. Older than
# ten idle builds, no build or load holds it any more.
STALE_LOCK_S = 10 * BUILD_S_MEASURED


def extensions_dir(env: Mapping[str, str]) -> Path:
    """Where torch's extension builder puts ops: TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/<py_cpu>."""
    given = env.get("TORCH_EXTENSIONS_DIR")
    return Path(given) if given else Path(env.get("HOME", "~")).expanduser() / ".cache" / "torch_extensions"


def built(op: str, root: Path) -> Path | None:
    """The op's shared library under ``root`` (directly, or in torch's per-Python subfolder), None if unbuilt."""
    for candidate in (root / op / f"{op}.so", *root.glob(f"*/{op}/{op}.so")):
        if candidate.is_file():  # a "lock" beside it is normal while a rank loads it (torch checks it is current)
            return candidate
    return None


def stale_lock(op: str, root: Path, now_s: float) -> Path | None:
    """torch's build ``lock`` of ``op`` under ``root`` older than :data:`STALE_LOCK_S`, None if there is none."""
    for lock in (root / op / "lock", *root.glob(f"*/{op}/lock")):
        try:
            if now_s - lock.stat().st_mtime >= STALE_LOCK_S:
                return lock
        except OSError:  # none there, or gone since the glob
            continue
    return None


def _age_min(path: Path) -> int:
    try:
        return round((time.time() - path.stat().st_mtime) / 60)
    except OSError:
        return 0


def plan_line(env: Mapping[str, str], gpus: bool) -> str:
    """The plan's ``ops:`` line: built (the job loads it), or built inside the first job and how long that takes."""
    if gpus:
        return "DeepSpeed's CUDA ops are built on first use on the GPU node unless installed prebuilt " \
               f"(see {DOCS})"
    root = extensions_dir(env)
    stale = stale_lock(CPU_COMM_OP, root, time.time())
    if stale is not None:
        return (f"{CPU_COMM_OP}: a lock left in {stale.parent} {_age_min(stale)} min ago (a build cut off): every "
                f"rank's start would wait on it forever, before its first step. HINT: if no job or build uses "
                f"{root} now, remove it (rm {stale}) and build the op ({DOCS})")
    found = built(CPU_COMM_OP, root)
    if found is not None:
        return f"{CPU_COMM_OP} built in {found.parent.parent} (the ranks load it; no build in the job)"
    return (f"{CPU_COMM_OP} not built in {root}: the first job builds it before its first step (~"
            f"{BUILD_S_MEASURED} s, inside its time limit). HINT: build it once before submitting ({DOCS}), with "
            "TORCH_EXTENSIONS_DIR as the job will have it")


def job_env() -> Mapping[str, str]:
    """The environment the job starts with: sbatch passes the submitting shell's on."""
    return os.environ
