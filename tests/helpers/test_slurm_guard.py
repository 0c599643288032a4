"""The guard of the tests that fake Slurm (slurm_guard.py, beside this file): a test that fakes the gateway and starts
a process that runs a real Slurm command fails; one that fakes nothing, or keeps the fake in its own process, passes.
Checked on an inner pytest session that loads the guard as the suite does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import slurm_guard

HELPERS = Path(__file__).resolve().parent
INNER_TIMEOUT_S = 120  # a pytest start-up and three small Python processes; seconds on an idle host

INNER_TESTS = '''
import subprocess, sys
from slurm_jit import slurm

ASK = ("from slurm_jit import slurm\\ntry:\\n    slurm.run(['scontrol', 'show', 'job', '42'])\\n"
       "except slurm.SlurmError:\\n    pass")


def fake(argv, timeout_s):
    return "JobId=42 JobState=CANCELLED Restarts=0"


def test_faked_and_a_subprocess_asks_the_real_cluster(monkeypatch):
    monkeypatch.setattr(slurm, "runner", fake)
    subprocess.run([sys.executable, "-c", ASK], check=True)


def test_faked_and_asked_in_this_process(monkeypatch):
    monkeypatch.setattr(slurm, "runner", fake)
    assert "CANCELLED" in slurm.run(["scontrol", "show", "job", "42"])


def test_nothing_faked_and_a_subprocess_asks_the_real_cluster():
    subprocess.run([sys.executable, "-c", ASK], check=True)
'''


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="no scontrol here: no process can reach a cluster")
def test_a_faked_test_whose_subprocess_runs_the_real_scontrol_fails(tmp_path: Path,
                                                                    slurm_guard_shims: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the repository's options
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != str(slurm_guard_shims))
    env = {**os.environ, "PATH": path, "PYTHONPATH": f"{HELPERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop(slurm_guard.LOG_ENV)  # the inner session's guard, not this test's
    inner = subprocess.run([sys.executable, "-m", "pytest", "-p", "slurm_guard", "-p", "no:cacheprovider",
                            "-p", "no:xdist", "-q", "-rE", "test_inner.py"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=False, timeout=INNER_TIMEOUT_S)
    said = inner.stdout
    assert inner.returncode == 1 and "3 passed, 1 error" in said, said + inner.stderr
    (error,) = [line for line in said.splitlines() if line.startswith("ERROR ")]
    assert "test_faked_and_a_subprocess_asks_the_real_cluster" in error, said
    assert "this test fakes Slurm (slurm.runner) but a process it started ran the real 'scontrol show job 42'" in said


def test_a_command_not_installed_gets_no_stand_in(tmp_path: Path) -> None:
    """The gateway's "not found on PATH" hint stays as it is where Slurm is not installed."""
    assert list(slurm_guard.write_shims(tmp_path, path=str(tmp_path / "empty")).iterdir()) == []
