"""The launcher's plan where the output directory's timing log has async periodic saves (issue #23 items 3, 4): the
staging buffers' host memory is said, and the grace counts the wait for an async save in flight."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import plan_text

from slurm_jit import timing

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024**2


def test_the_plan_says_the_staging_buffer_and_the_grace_counts_the_async_save(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for rank in (0, 1):  # the records a JitTrainer with async_periodic_saves=True writes, by its own writer
        log = timing.TimingLog(out, rank=rank, world_size=2, run_id="r1")
        log.save_blocked(10, "periodic", 0.25, (300 + rank) * MIB, {"wait_previous": 0.0, "stage": 0.2})
        log.save_background(10, "periodic", 7.0 + rank, 600 * MIB, {"write_s": 5.0, "staged_bytes": (300 + rank) * MIB})
        log.close()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "submit.py"), "--dry-run", "--output-dir", str(out), "--python",
         sys.executable, "--time", "30", "--ntasks-per-node", "2", "--step-time", "2m", "--save-time", "2m", "--margin",
         "0", "--explain", "--", "python", "train.py"], capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert plan_text.value(proc.stderr, "staging:") == (
        "async periodic saves stage up to 301.0 MiB per rank in host memory, 602.0 MiB on a node of 2 (the timing "
        "log's largest of 1); where it does not fit, the saves stay synchronous (one line)"), proc.stderr
    # 120 s step + 120 s save + 3 s kill_wait + the longest block 0.25 s and background write 8 s = 251.25 s
    assert "  grace:    step 120 s + save 120 s + kill_wait 3 s + async_save 8.2 s = 251 s" in proc.stderr
    assert "async_save 8.25 s: longest training block 0.25 s + longest background write and commit 8 s" in \
        " ".join(proc.stderr.split())  # --explain, its lines wrapped
    assert "#SBATCH --signal=TERM@252 (no B:" in proc.stderr


def test_no_staging_line_without_async_saves(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "submit.py"), "--dry-run", "--output-dir", str(tmp_path / "o"),
         "--python", sys.executable, "--time", "30", "--signal-lead", "300", "--", "python", "train.py"],
        capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "staging:" not in proc.stderr and "async_save" not in proc.stderr
