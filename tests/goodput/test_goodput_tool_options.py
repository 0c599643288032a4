"""tools/goodput's bad inputs: one line with a HINT and exit 2, before any job is submitted (the Slurm check comes
after them; here a stand-in scontrol says none answers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PATH whose scontrol answers nothing (a stand-in that fails at once): a valid run stops at the Slurm check
    and never submits (a real scontrol without a controller retries for a minute)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'slurm_load_ctl_conf error: no controller' >&2\nexit 1\n")
    (bin_dir / "scontrol").chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def _run(path: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": path, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "slurm_jit.goodput.cli", *argv], capture_output=True, text=True,
                          check=False, timeout=120, env=env)


@pytest.mark.parametrize(("argv", "said"), [
    (["--systems", "a,a"], "a system named twice"),
    (["--systems", ""], "unknown none given"),
    (["--systems", "x"], "unknown x"),
    (["--kill-at-step", "0"], "must be a whole number >= 1"),
    (["--quick", "--kill-at-step", "500"], "not inside the training's 400 steps"),
])
def test_a_bad_option_is_one_line_and_exit_2(path: str, argv: list[str], said: str) -> None:
    proc = _run(path, *argv)
    assert proc.returncode == 2 and said in proc.stderr and "HINT:" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_an_out_that_is_a_file_or_not_empty_is_refused_before_slurm_is_asked(path: str, tmp_path: Path) -> None:
    a_file = tmp_path / "results.txt"
    a_file.write_text("mine")
    proc = _run(path, "--out", str(a_file))
    assert proc.returncode == 2 and "is a file. HINT:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert a_file.read_text() == "mine"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept").write_text("x")
    proc = _run(path, "--out", str(tmp_path / "full"))
    assert proc.returncode == 2 and "is not empty. HINT:" in proc.stderr, proc.stderr
    proc = _run(path, "--out", str(a_file / "sub"))  # under a file: one line, before Slurm is asked
    assert proc.returncode == 2 and "HINT: a folder that can be created" in proc.stderr, proc.stderr
    proc = _run(path, "--out", "")
    assert proc.returncode == 2 and "--out is empty. HINT:" in proc.stderr, proc.stderr
    proc = _run(path, "--out", str(tmp_path / "new"))  # valid: refused only for want of Slurm here
    assert proc.returncode == 2 and "no Slurm controller answers. HINT: tools/local-slurm up" in proc.stderr
