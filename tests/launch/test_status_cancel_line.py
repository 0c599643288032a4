"""``status`` says a user's ``scancel`` from Slurm's state: a plain scancel kills the batch shell with the ranks, so
after_step never runs and the launcher records nothing. The Slurm gateway is faked at its one boundary
(tests/integration/test_launch_slurm.py::test_user_scancel_is_never_requeued: the real one)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from slurm_jit import slurm
from slurm_jit.launch import output_claim, progress, status

CANCEL_LINE = ("stopped:  user cancel (restart 1), not requeued: Slurm says CANCELLED (scancel); it ended the batch "
               "shell too, so the log has no slurm-jit: line for it")


def scontrol(state: str) -> object:
    def runner(argv: Sequence[str], timeout_s: float) -> str:
        if list(argv[:3]) == ["scontrol", "show", "job"]:
            return f"JobId={argv[3]} JobName=x\n   JobState={state} Reason=None\n   Restarts=1\n"
        raise slurm.SlurmError(f"{argv[0]}: not faked")
    return runner


def stopped(out: Path, monkeypatch: pytest.MonkeyPatch, state: str) -> list[str]:
    monkeypatch.setattr(slurm, "runner", scontrol(state))
    return [line for line in status.report(str(out), None) if line.startswith("stopped:")]


def record_job(out: Path, job_id: str) -> None:
    output_claim.job_script_path(out, job_id).parent.mkdir(parents=True, exist_ok=True)
    output_claim.job_script_path(out, job_id).write_text("#!/bin/bash\n")  # as a submit keeps it


def test_a_cancel_after_a_requeue_is_said_over_the_requeue_before_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    record_job(tmp_path, "31")
    progress.write(tmp_path, {"job_id": "31", "last_step": 40, "history": [
        {"job_id": "31", "restart": 0, "cause": "time limit", "step": 40, "requeue": True,
         "reason": "JIT checkpoint complete", "outcome": "requeued"}]})
    assert stopped(tmp_path, monkeypatch, "CANCELLED") == [CANCEL_LINE]
    assert stopped(tmp_path, monkeypatch, "RUNNING") == [
        "stopped:  time limit at step 40 (restart 0), requeued: JIT checkpoint complete"]


def test_a_cancel_with_no_launcher_record_at_all_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record_job(tmp_path, "32")
    assert stopped(tmp_path, monkeypatch, "CANCELLED") == [CANCEL_LINE]
    assert stopped(tmp_path, monkeypatch, "COMPLETED") == []


def test_a_cancel_the_launcher_recorded_is_said_once_in_its_words(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    record_job(tmp_path, "33")
    progress.write(tmp_path, {"job_id": "33", "last_step": 7, "history": [
        {"job_id": "33", "restart": 1, "cause": "user cancel", "step": 7, "requeue": False,
         "reason": "the job was cancelled", "outcome": "not requeued"}]})
    assert stopped(tmp_path, monkeypatch, "CANCELLED") == [
        "stopped:  user cancel at step 7 (restart 1), not requeued: the job was cancelled"]
