"""Reading OUT_DIR/slurm-jit/timing-rank*.jsonl on rank 0 while it trains (the runtime grace check): whatever lies
there, the output lock stays held and the training is not held up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from jit_helpers import LOCK_BUSY

from slurm_jit import timing
from slurm_jit.train import output_lock, runtime_grace


@pytest.mark.timeout(60)  # before: the FIFO was waited on forever
@pytest.mark.parametrize("planted", ["symbolic-link-to-the-lock", "hard-link-to-the-lock", "fifo"])
def test_the_grace_check_skips_a_timing_log_that_is_not_a_file_and_keeps_the_lock(
        tmp_path: Path, planted: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: open() followed the link to output.lock, and closing it dropped rank 0's POSIX lock (a second
    # training could take the output_dir); a FIFO held rank 0 at a step boundary forever.
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # the check runs inside a Slurm job only
    out = tmp_path / "out"
    lock, why = output_lock.acquire(out)
    assert lock is not None and lock.locked, why
    try:
        log = timing.TimingLog(out, rank=0, world_size=2, run_id="r1")
        for step in range(1, 10):
            log.step(step, 1.0)
        log.close()
        path = output_lock.lock_path(out)
        planted_log = timing.timing_path(out, 9)
        if planted == "symbolic-link-to-the-lock":
            planted_log.symlink_to(path.name)
        elif planted == "hard-link-to-the-lock":
            os.link(path, planted_log)
        else:
            os.mkfifo(planted_log)
        with caplog.at_level("INFO", logger=runtime_grace.__name__):
            assert runtime_grace.check_and_warn(str(out), 1.0, "start") == []
        probe = subprocess.run([sys.executable, "-c", LOCK_BUSY, str(path)], capture_output=True, text=True,
                               timeout=60, check=True)
        assert probe.stdout.strip() == "busy", "reading the timing logs dropped the output lock"
        skipped = [r.getMessage() for r in caplog.records if "grace check skipped" in r.getMessage()]
        assert len(skipped) == 1 and str(planted_log) in skipped[0] and "HINT:" in skipped[0], skipped
    finally:
        output_lock.release(lock)
