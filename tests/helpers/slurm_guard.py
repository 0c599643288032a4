"""The guard of the tests that fake Slurm (a pytest plugin: tests/conftest.py loads it, ``-p slurm_guard`` elsewhere).

A test fakes Slurm by swapping ``slurm.runner``, the gateway's one boundary; the fake lives in the test's own process.
A process the test starts (``launch/submit.py status``, a ``python -c`` script) has the real gateway and reads the
real local cluster, where job 42 may be one the suite just cancelled: the test's result then depends on what the
cluster did before. So every test not marked ``slurm`` runs with a folder first on PATH that holds, for each Slurm
command installed here, a stand-in that notes the call in the test's log (``SLURM_JIT_TEST_SLURM_LOG``) and runs the
real command (a test that fakes nothing behaves as before). A test that still fakes the gateway when it ends and
whose log has a call fails at teardown, naming the call.
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_jit import slurm

LOG_ENV = "SLURM_JIT_TEST_SLURM_LOG"
# Every command that reads or changes the cluster: the gateway's, and sacct (submitit's own watcher may run it).
GUARDED_COMMANDS = tuple(sorted(slurm.SLURM_COMMANDS | {"sacct"}))
REAL_RUNNER = slurm.runner  # imported before any test runs: the gateway's own runner, unswapped
_SHIM = """#!/bin/sh
# slurm-jit's test guard (tests/helpers/slurm_guard.py): note the call, then run the real command.
if [ -n "${{{log}:-}}" ]; then printf '%s\\n' "{name} $*" >> "${{{log}}}"; fi
exec {real} "$@"
"""
_numbers = itertools.count()


def write_shims(folder: Path, path: str) -> Path:
    """The stand-ins, in ``folder``, for the guarded commands found on ``path`` (one not installed stays missing:
    the gateway's "not found on PATH" hint is unchanged)."""
    for name in GUARDED_COMMANDS:
        real = shutil.which(name, path=path)
        if real is not None:
            shim = folder / name
            shim.write_text(_SHIM.format(log=LOG_ENV, name=name, real=shlex.quote(real)))
            shim.chmod(0o755)
    return folder


def calls(log: Path) -> list[str]:
    """The Slurm commands the processes of a test ran, as ``scontrol show job 42`` lines."""
    try:
        return log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def problem(log: Path) -> str | None:
    """What is wrong when the gateway is faked now and a process of the test reached the real cluster; else None."""
    reached = calls(log)
    if slurm.runner is REAL_RUNNER or not reached:
        return None
    return (f"this test fakes Slurm (slurm.runner) but a process it started ran the real {reached[0]!r}"
            f"{f' and {len(reached) - 1} more' if len(reached) > 1 else ''}: its result depends on the local "
            "cluster's jobs. HINT: call the code in this process under the fake (e.g. status.status_main), or mark "
            "the test slurm and use the real cluster")


@pytest.fixture(scope="session")
def slurm_guard_shims(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of stand-ins, written once per session (per xdist worker)."""
    return write_shims(tmp_path_factory.mktemp("slurm-guard"), os.environ.get("PATH", ""))


@pytest.fixture(autouse=True)
def slurm_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path | None]:
    """The test's log of real Slurm calls (None for a ``slurm`` test, which is meant to make them). Asks for
    ``monkeypatch`` so that its check runs before the test's own monkeypatching is undone."""
    if request.node.get_closest_marker("slurm") is not None:
        yield None
        return
    shims: Path = request.getfixturevalue("slurm_guard_shims")
    log = shims / f"calls-{next(_numbers)}.log"
    monkeypatch.setenv(LOG_ENV, str(log))
    monkeypatch.setenv("PATH", f"{shims}{os.pathsep}{os.environ.get('PATH', '')}")
    yield log
    said = problem(log)
    if said is not None:
        pytest.fail(said, pytrace=False)
