"""The plan says whether the DeepSpeed op a CPU job JIT-builds (deepspeed_shm_comm) is built already in the
TORCH_EXTENSIONS_DIR the job inherits, or will be built inside the first job, and how long that takes. Real dry
runs of ``python launch/submit.py`` over a real extensions directory layout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import plan_text

ROOT = Path(__file__).resolve().parents[2]
CMD = ["--", "python", "train.py"]


def ops_line(tmp_path: Path, ext_dir: Path, *extra: str) -> str:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir)}
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "submit.py"), "--dry-run", "--output-dir",
                           str(tmp_path / "out"), "--time", "30", "--signal-lead", "60", *extra, *CMD],
                          capture_output=True, text=True, check=False, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return plan_text.value(proc.stderr, "ops:", hint=True)  # the HINT on a line of its own


def test_an_unbuilt_op_is_said_to_be_built_in_the_job(tmp_path: Path) -> None:
    line = ops_line(tmp_path, tmp_path / "ext")
    assert "deepspeed_shm_comm not built" in line and "first job builds it" in line and "~80 s" in line, line
    assert "HINT:" in line and "docs/install.md" in line


def test_a_built_op_is_said_to_be_loaded(tmp_path: Path) -> None:
    op = tmp_path / "ext" / "py311_cpu" / "deepspeed_shm_comm"
    op.mkdir(parents=True)
    (op / "deepspeed_shm_comm.so").write_bytes(b"\x7fELF")
    line = ops_line(tmp_path, tmp_path / "ext")
    assert "deepspeed_shm_comm built in" in line and "no build in the job" in line, line


def test_a_gpu_job_is_pointed_to_the_cuda_ops(tmp_path: Path) -> None:
    assert "CUDA ops" in ops_line(tmp_path, tmp_path / "ext", "--gpus-per-node", "4")


def test_a_lock_left_by_a_build_cut_off_is_named_with_the_command_that_removes_it(tmp_path: Path) -> None:
    op = tmp_path / "ext" / "py311_cpu" / "deepspeed_shm_comm"
    op.mkdir(parents=True)
    (op / "deepspeed_shm_comm.so").write_bytes(b"\x7fELF")
    lock = op / "lock"
    lock.touch()
    assert "no build in the job" in ops_line(tmp_path, tmp_path / "ext")  # a rank loading it now holds a new one
    old = time.time() - 2 * 86400  # left by a job two days ago
    os.utime(lock, (old, old))
    line = ops_line(tmp_path, tmp_path / "ext")
    assert "wait on it forever" in line and f"rm {lock}" in line and "HINT:" in line, line
