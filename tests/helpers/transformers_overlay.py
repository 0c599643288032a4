"""transformers==version alone in an overlay directory under a cache (``SLURM_JIT_TEST_CACHE``, default
``~/.cache/slurm-jit``; kept across runs), for the tests of the range's lowest transformers
(tests/train/test_compat_versions.py). Imported by module name from a test's subprocess too."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PIP_TIMEOUT_S = 600  # a ~12 MB wheel; a stalled download fails the install (a skip), not the test run
OVERLAY_LOCK = ".overlay.lock"  # in the cache directory: one install at a time


def overlay(version: str) -> Path:
    """transformers==version alone in a directory (the venv supplies its dependencies), installed once. Under a lock
    on the cache: a concurrent run (another worktree, another CI job on the machine) waits for the install and
    uses it; it never replaces an overlay another run's ranks are importing."""
    cache = Path(os.environ.get("SLURM_JIT_TEST_CACHE", Path.home() / ".cache" / "slurm-jit"))
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / OVERLAY_LOCK).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        return _install_once(cache, version)


def _install_once(cache: Path, version: str) -> Path:
    target = cache / f"transformers-{version}"
    if (target / "transformers" / "__init__.py").exists():
        return target
    for stale in cache.glob(".transformers-*.partial-*"):  # a killed run's (installs run only under the lock)
        shutil.rmtree(stale, ignore_errors=True)
    partial = cache / f".transformers-{version}.partial-{os.getpid()}"
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial),
                               f"transformers=={version}"], capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        reason = "timed out" if done is None else (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        pytest.skip(f"cannot install transformers=={version} into {target} (no network?): {reason}")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)  # a killed install leaves a .partial, never a half overlay taken as done
    return target
