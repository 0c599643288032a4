"""The launcher's --output-dir against the one its training command gives the script (--output_dir, as
HfArgumentParser reads it, or --output-dir): two directories are refused in one line with a HINT before anything is
submitted (before, a dry run with two different ones exited 0 without a word and the job trained into one while its
requeue read the other)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slurm_jit.train.refusals import command_output_dir

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(out: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "launch" / "submit.py"), "--dry-run", "--time", "30",
                           "--step-time", "1s", "--save-time", "5s", "--output-dir", str(out), "--", *command],
                          capture_output=True, text=True, check=False, timeout=60, cwd=out.parent)


@pytest.mark.parametrize("flag", [["--output_dir", "{d}"], ["--output_dir={d}"], ["--output-dir", "{d}"],
                                  ["--output_dir", ""]])  # "$SLURM_JIT_OUTPUT_DIR" in the submitting shell: empty
def test_another_output_dir_in_the_command_is_refused_in_one_line(tmp_path: Path, flag: list[str]) -> None:
    other = tmp_path / "other"
    refused = _dry_run(tmp_path / "out", "python", "train.py", *(f.format(d=other) for f in flag))
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout
    assert refused.stderr.count("\n") == 1 and "HINT" in refused.stderr
    assert str(other) in refused.stderr or "output_dir ''" in refused.stderr, refused.stderr
    assert not (tmp_path / "out").exists()  # nothing submitted, nothing written


def test_the_same_directory_however_spelled_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    same = _dry_run(tmp_path / "out", "python", "train.py", "--lr", "1", "--output_dir", "./out/")
    assert same.returncode == 0, same.stderr
    assert command_output_dir(["python", "t.py", "--output_dir", "a", "--output_dir=b"]) == "b"
    assert command_output_dir(["python", "t.py", "--output_dir"]) is None
    assert command_output_dir(["python", "t.py", "--output_dirs", "x"]) is None
