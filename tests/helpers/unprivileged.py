"""Running a command as user nobody, for the tests of "permission denied" (root reads everything)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

import pytest

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
PROBE_TIMEOUT_S = 60


def prefix() -> list[str]:
    """What runs a command as nobody ([] when we are not root: permissions already apply); skips the test where
    that cannot work: no setpriv, or a checkout nobody cannot enter (``mktemp -d`` makes a 0700 directory)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv absent: cannot drop root to test permission denied")
    why = _unusable_by_nobody()
    if why:
        pytest.skip(f"user nobody cannot run this checkout's python ({why}). HINT: clone under a directory every "
                    "user may enter (not mktemp -d's 0700) to run the permission tests")
    return NOBODY


@functools.cache
def _unusable_by_nobody() -> str | None:
    proc = subprocess.run([*NOBODY, sys.executable, "-c", "import slurm_jit"], capture_output=True, text=True,
                          timeout=PROBE_TIMEOUT_S, check=False, cwd="/")
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["exit status"])[-1][:200]
