"""JitConfig's bad values: refused at construction in one line with a HINT, in Python and through demo_train's
flags, never a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_jit.train.trainer import JitConfig


@pytest.mark.parametrize("kwargs", [{"kill_wait_s": -1}, {"kill_wait_s": float("nan")}, {"signals": ()},
                                    {"signals": ("KILL",)}, {"signals": ("BOGUS",)}])
def test_jit_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="HINT"):
        JitConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"kill_wait_s": 1e300},  # accepted, then time.sleep overflowed on the stop path: no JIT checkpoint
    {"kill_wait_s": float("inf")}, {"kill_wait_s": "3"}, {"kill_wait_s": True}, {"kill_wait_s": None},
    {"side_group_timeout_s": 0}, {"side_group_timeout_s": float("nan")}, {"side_group_timeout_s": -5},
    {"convert_timeout_s": 0}, {"convert_timeout_s": float("inf")}, {"keep_global_batch": "no"},
    {"keep_global_batch": None},
    {"signals": "TERM"}, {"signals": ("TERM", "SIGTERM")}, {"signals": ("USR1", 10)}, {"signals": (99,)},
    {"signals": ("CHLD",)}, {"signals": ("SEGV",)}, {"signals": ("STOP",)}, {"signals": ("",)},
    {"signals": (None,)},
])
def test_odd_jit_config_is_one_line_with_a_hint(kwargs: dict) -> None:
    with pytest.raises(ValueError) as caught:
        JitConfig(**kwargs)
    message = str(caught.value)
    assert "HINT:" in message and "\n" not in message, message


@pytest.mark.parametrize("flags", [["--kill-wait", "nan"], ["--signals", "TERM,CHLD"]])
def test_demo_train_says_a_bad_jit_config_in_one_line(tmp_path: Path, flags: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "slurm_jit.demo_train", "--output-dir", str(tmp_path / "out"),
                           "--zero-stage", "0", "--max-steps", "1", *flags], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("demo_train: slurm_jit") or
             line.startswith("demo_train: JitConfig")]
    assert len(lines) == 1 and "HINT:" in lines[0], done.stderr[-3000:]
