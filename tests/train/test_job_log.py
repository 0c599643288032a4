"""A job log that fits Slurm (issue 12): with stderr a file, as in every Slurm job, JitTrainer prints one line
per logging step and no tqdm bar (each redraw of a bar stays in the file: tens of MB per job)."""

from __future__ import annotations

from pathlib import Path

import pytest
from jit_helpers import run_logged

STEPS = 40
# Measured: 7.7 KB without bars (one loss line per step on rank 0, start-up warnings of both ranks, the save and
# evaluation lines), 27.5 KB with them (320 redraws for 40 steps; megabytes in a real job). Twice the first.
MAX_LOG_BYTES = 15_000


@pytest.mark.deepspeed
def test_a_job_log_has_one_line_per_logging_step_and_no_bars(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # demo_train turns tqdm off; a user's TrainingArguments leaves it on (disable_tqdm=None -> False)
    result = run_logged(out, ["--max-steps", str(STEPS), "--eval-steps", "20", "--save-steps", "20",
                              "--targ", "disable_tqdm=false"])
    assert result.codes == [0, 0], result.log[-4000:]
    assert "\r" not in result.log, "a progress bar was drawn into the log: " + repr(result.log[-2000:])
    loss_lines = [line for line in result.log.splitlines() if line.startswith("{'loss'")]
    assert len(loss_lines) == STEPS, f"{len(loss_lines)} loss lines for {STEPS} logging steps"
    log_bytes = len(result.log.encode())
    assert log_bytes <= MAX_LOG_BYTES, f"job log {log_bytes} bytes > {MAX_LOG_BYTES}"
    print(f"job log: {log_bytes} bytes for {STEPS} steps")  # measured, for the report
