"""The job log explains slurmstepd's ``*** STEP N.0 ... CANCELLED AT ... ***`` line, which Slurm writes when its
warning signal reaches the step: after a JIT stop, after_step says that line was the signal the ranks answered,
not a cancel; after a crash or a finished training it says nothing of the kind. The Slurm gateway is faked at its
one boundary (tests/integration/ run the real one)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from slurm_jit import slurm
from slurm_jit.launch import after_step
from slurm_jit.train import stop_record

SHOW_JOB = ("JobId=42 JobName=x\n   JobState=RUNNING Reason=None Dependency=(null)\n   Requeue=1 Restarts=0 "
            "BatchFlag=1\n   RunTime=00:02:10 TimeLimit=00:03:00 TimeMin=N/A\n   PreemptTime=None\n")
NOTE = "is how Slurm logs its signal reaching the step, not a cancel"


def _after_step(out: Path, monkeypatch: pytest.MonkeyPatch, state: str) -> None:
    def runner(argv: Sequence[str], timeout_s: float) -> str:
        return SHOW_JOB if argv[:3] == ["scontrol", "show", "job"] else ""

    monkeypatch.setattr(slurm, "runner", runner)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    stop_record.write(out, state, step=10, checkpoint=str(out / "checkpoint-10"))
    after_step.main([str(out), "--srun-exit", "0", "--max-requeues", "3"],
                    env={"SLURM_JOB_ID": "42", "SLURM_JIT_SIGNAL_LEAD_S": "60"})


def test_a_jit_stop_explains_the_step_cancelled_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    _after_step(tmp_path, monkeypatch, "jit_stop")
    lines = capsys.readouterr().out.splitlines()
    assert "policy:" in lines[0] and "STEP 42.0" in lines[1] and NOTE in lines[1], lines


@pytest.mark.parametrize("state", ["failed", "finished"])
def test_no_explanation_after_a_crash_or_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str], state: str) -> None:
    _after_step(tmp_path, monkeypatch, state)
    out = capsys.readouterr().out
    assert "policy:" in out and NOTE not in out, out
