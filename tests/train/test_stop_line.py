"""The JIT stop's one line (the signal and the step it came at, the step of the stop, the checkpoint, seconds) in
the job log by default, once (rank 0), with no logging set up by the user's script; and the resume's "exact
resume" line said once, not by every rank. Real DeepSpeed ranks (2 CPU ranks over gloo), a real SIGTERM to each
rank's process group."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from jit_helpers import run_and_signal, run_logged

from slurm_jit import timing
from slurm_jit.train import stop_record

pytestmark = pytest.mark.deepspeed

QUIET_DEMO = [str(Path(__file__).resolve().parents[1] / "helpers" / "demo_without_logging.py")]
ARGS = ["--zero-stage", "2", "--max-steps", "40", "--step-sleep", "0.05", "--kill-wait", "0.5"]
STOP_LINE = re.compile(r"^slurm_jit: JIT stop: SIGTERM at step (\d+), stopped at step (\d+), checkpoint (\S+) "
                       r"complete \(saved in [\d.]+ s, [\d.]+ s after the signal\); the next run resumes from it$",
                       re.MULTILINE)


def test_the_jit_stop_is_one_line_by_default_and_the_resume_says_exact_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    stopped = run_and_signal(out, ARGS, [(0, 0.0), (1, 0.0)], program=QUIET_DEMO)
    assert stopped.codes == [0, 0], stopped.log[-4000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop", record
    lines = STOP_LINE.findall(stopped.log)
    (rank0_stop,) = [r for r in timing.read_records(out) if r["event"] == "stop" and r["rank"] == 0]
    # the kill wait (0.5 s) lets ~10 steps of 0.05 s run after the signal: the line names both steps
    assert lines == [(str(rank0_stop["signal_step"]), str(record["step"]), record["checkpoint"])], \
        stopped.log[-4000:]
    rank0 = (out.parent / f"logs-{out.name}" / "rank0.log").read_text(errors="replace")
    assert STOP_LINE.search(rank0), "the stop line is rank 0's"
    resumed = run_logged(out, [*ARGS, "--resume"], program=QUIET_DEMO)
    assert resumed.codes == [0, 0], resumed.log[-4000:]
    assert resumed.log.count("slurm_jit: exact resume: ") == 1, resumed.log[-4000:]
