"""The DeepSpeed ops a job JIT-builds: whether they are built (the plan's ``ops:`` line), and each job start's own
copy of them (the ranks load from it).

DeepSpeed installed with ``DS_BUILD_OPS=0`` builds an op the first time a run needs it (torch's extension
builder, ``ninja``) into ``TORCH_EXTENSIONS_DIR``: on CPU ranks the communication op ``deepspeed_shm_comm``,
about 80 s on 2 idle cores, inside the first job, where the job's own time limit can cut the build off (and its
``lock`` file then makes every later start wait). The plan says so before the job is submitted.

Every load of an op, a built one too, takes torch's ``lock`` in the op's directory and runs ``ninja`` there, which
rebuilds the op whenever the last build came from another toolchain (another ninja version, another venv): 40-190 s
here, and every rank of every job that loads from that directory meanwhile waits on the lock (a stale one: for
ever). So each job start's ranks load from a node-local copy (:func:`job_copy`), made once per node and start: no
other job's build, load or stale lock can hold them. An op built in the copy is published to the shared directory
where that has none (:func:`publish`), so that the next jobs load it.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Collection, Mapping
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
        return (f"{CPU_COMM_OP}: a lock left in {stale.parent} {_age_min(stale)} min ago (a build cut off): other "
                f"loaders wait on it forever, this job loads its own copy. HINT: if no job or build uses "
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


# --- each job start's own copy of the built ops --------------------------------------------------------------------
COPIES_DIR = "slurm-jit-ops"  # <tmp>/slurm-jit-ops-<uid>/<job id>.<restart>: node-local, one per job start
COPIED = ".copied"  # in a copy, written when it was made: an op library newer than this was built by the job
LOCK = "lock"  # torch.utils.file_baton's file in an op's directory: never copied (a copy has no holder to drop it)
# An op directory whose files change under this many copies in a row is being built right now: the job builds its
# own instead of taking half of that build (a copy takes well under a second; a build writes for 40-80 s).
COPY_TRIES = 3
# A file of an op's directory gone between its listing and its copy: a build replacing it (ESTALE: the same on NFS).
# Any other error (ENOSPC, EDQUOT, EACCES, EROFS, ...) is the copy's own: it cannot be made on this node.
_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ESTALE})
FAILED = ".failed"  # <copy>.failed, beside where the copy would be: the node's first rank could not make it
_TORCH_VERSION = re.compile(r"^(cuda|hip)\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", re.MULTILINE)


def torch_build_root(env: Mapping[str, str]) -> Path | None:
    """The directory torch's builder puts this interpreter's ops in (torch.utils.cpp_extension's
    ``_get_build_directory``, without importing torch): TORCH_EXTENSIONS_DIR, else
    ``~/.cache/torch_extensions/py<XY>_<cpu|cuXYZ|rocmXYZ>``; None where torch is not installed."""
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        found = dict(_TORCH_VERSION.findall((Path(spec.origin).parent / "version.py").read_text()))
    except OSError:
        return None
    accelerator = (f"rocm{found['hip'].replace('.', '')}" if "hip" in found
                   else f"cu{found['cuda'].replace('.', '')}" if "cuda" in found else "cpu")
    cache = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".cache")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(os.path.realpath(Path(cache) / "torch_extensions")) / f"{python}_{accelerator}"


def copies_root(env: Mapping[str, str]) -> Path:
    """Where this node keeps the job starts' copies (TMPDIR honoured, one folder per user)."""
    base = env.get("TMPDIR") or tempfile.gettempdir()
    return Path(base) / f"{COPIES_DIR}-{os.getuid()}"


def copy_path(env: Mapping[str, str], job_id: str, restart: int) -> Path:
    return copies_root(env) / f"{job_id}.{restart}"


def _snapshot(op_dir: Path) -> dict[str, tuple[int, int]]:
    """Size and mtime of each file of an op's directory but its lock: what a build in progress changes."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns)
            for p in op_dir.iterdir() if p.name != LOCK and p.is_file()}


def _copy_tree(src: Path, dest: Path) -> None:
    """shutil.copytree(ignore=LOCK), each OSError raised as it comes: copytree gathers a file's errors into one
    shutil.Error of strings, where a full disk and a file a build replaced read the same."""
    dest.mkdir()
    for entry in src.iterdir():
        if entry.name == LOCK:
            continue
        if entry.is_dir():
            _copy_tree(entry, dest / entry.name)
        else:
            shutil.copy2(entry, dest / entry.name)
    shutil.copystat(src, dest)


def _copy_op(op_dir: Path, dest: Path) -> bool:
    """Copy one op's directory, file times kept (ninja compares them); False if it changed under every try.
    Raises the OSError of a copy that cannot be made here (TMPDIR full, read-only, not ours)."""
    for _ in range(COPY_TRIES):
        shutil.rmtree(dest, ignore_errors=True)
        try:
            before = _snapshot(op_dir)
            _copy_tree(op_dir, dest)
            if _snapshot(op_dir) == before:
                return True
        except OSError as exc:
            if exc.errno not in _GONE_ERRNOS:
                raise
    shutil.rmtree(dest, ignore_errors=True)
    return False


def job_copy(shared: Path, dest: Path) -> tuple[bool, list[str]]:
    """Copy the built ops of ``shared`` to ``dest`` (once per node: the first rank's copy is everyone's, moved in
    whole). Returns whether this call made it, and the ops left out because a build was changing them. Raises
    OSError where the copy cannot be made (TMPDIR full, read-only, not writable), leaving nothing of it behind."""
    if dest.is_dir():
        return False, []
    staging = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True, mode=0o700)
    try:
        skipped = [op.name for op in (sorted(shared.iterdir()) if shared.is_dir() else [])
                   if op.is_dir() and not _copy_op(op, staging / op.name)]
        (staging / COPIED).touch()
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # a full disk gets its room back (for failed_path's reason too)
        raise
    try:
        staging.rename(dest)
    except OSError:  # another rank of this start on this node moved its copy in first: that one is used
        shutil.rmtree(staging, ignore_errors=True)
        return False, []
    return True, skipped


def failed_path(dest: Path) -> Path:
    """The marker the node's first rank leaves where it could not make the copy ``dest``."""
    return dest.with_name(dest.name + FAILED)


def mark_failed(dest: Path, reason: str) -> None:
    """Tell the node's other ranks that ``dest`` will not be made (best effort: an unwritable TMPDIR takes no
    marker, and :func:`copy_failed` sees that one itself)."""
    try:
        failed_path(dest).write_text(reason + "\n")
    except OSError:
        pass


def copy_failed(dest: Path) -> bool:
    """Whether this node's copy ``dest`` will not be made: its first rank said so, or no rank can write there."""
    if failed_path(dest).exists():
        return True
    existing = dest.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return not os.access(existing, os.W_OK | os.X_OK)


def publish(copy: Path, shared: Path) -> tuple[list[str], list[str]]:
    """After the job: each op built in ``copy`` that ``shared`` has no directory for is moved in whole (the next
    jobs load it). Returns the ops published, and those rebuilt in the copy although ``shared`` has them built
    (its build is another toolchain's: another ninja or venv, so every start of this job rebuilds them)."""
    published: list[str] = []
    rebuilt: list[str] = []
    try:
        copied_ns = (copy / COPIED).stat().st_mtime_ns
    except OSError:  # no copy made on this node
        return published, rebuilt
    for op in sorted(p for p in copy.iterdir() if p.is_dir()):
        lib = op / f"{op.name}.so"
        if not lib.is_file() or lib.stat().st_mtime_ns <= copied_ns or (op / LOCK).exists():
            continue  # copied as it was, not built here; or a build of the job cut off
        if (shared / op.name).exists():
            if (shared / op.name / lib.name).is_file():
                rebuilt.append(op.name)
            continue
        staging = shared / f".{op.name}.{os.getpid()}.tmp"
        try:
            shutil.copytree(op, staging)
            staging.rename(shared / op.name)
            published.append(op.name)
        except OSError:  # another job published it first, or shared is not writable: theirs stays
            shutil.rmtree(staging, ignore_errors=True)
    return published, rebuilt


def prune_copies(root: Path, running_job_ids: Collection[str]) -> list[Path]:
    """Remove this node's copies of jobs no longer running (a node other than the batch one, whose copy the
    job's end does not remove); returns what was removed."""
    gone = [p for p in (root.iterdir() if root.is_dir() else []) if not p.name.startswith(".")
            and p.name.split(".")[0] not in running_job_ids]
    for path in gone:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:  # a failed_path marker
            path.unlink(missing_ok=True)
    return gone
