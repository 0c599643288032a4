"""Submitting a 2-rank training through ``launch/submit.py`` to the local Slurm, as the integration tests do
(``--time 3``, the warning 60 s before), and reading the job's log across its requeues."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from slurm_jit import slurm

SUBMIT = Path(__file__).resolve().parents[2] / "launch" / "submit.py"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL"}


def submit_training(out: Path, jobs: list[str], program: Sequence[str], *options: str, train: Sequence[str] = (),
                    env: dict[str, str] | None = None) -> str:
    """``python launch/submit.py ... -- python PROGRAM --output-dir OUT --resume TRAIN``; the job id, also appended
    to ``jobs`` (the fixture that cancels what a test leaves)."""
    argv = [sys.executable, str(SUBMIT), "--output-dir", str(out), "--ntasks-per-node", "2", "--cpus-per-task",
            "1", "--time", "3", "--signal-lead", "60", *options, "--", sys.executable, *program,
            "--output-dir", str(out), "--resume", *train]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.split("submitted job ")[1].split(";")[0]
    jobs.append(job_id)
    return job_id


def limit_from_now(job_id: str, seconds: int) -> None:
    """Move the job's time limit to ``seconds`` from now (``scontrol update``): Slurm's own ``--signal`` warning then
    comes on its time-limit pass (every 30 s, up to 60 s early) at a time set once the ranks train, however long
    their start-up took on loaded cores (a fixed ``--time`` put it 60-120 s after the start, which a slow start-up
    could reach before the first step)."""
    limit_s = slurm.seconds(slurm.show_job(job_id)["RunTime"]) + seconds  # type: ignore[operator]
    slurm.run(["scontrol", "update", f"JobId={job_id}",
               f"TimeLimit={limit_s // 3600}:{limit_s % 3600 // 60:02d}:{limit_s % 60:02d}"])


def job_log(out: Path, job_id: str) -> str:
    """Task 0's log (``OUT/slurm-<id>.out``), all runs of the job; empty before it exists."""
    path = out / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def until(check: Callable[[], object], timeout_s: float, poll_s: float) -> object:
    """``check()``'s first true value within ``timeout_s`` (polled every ``poll_s``), else None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll_s)
    return None


def tasks_log(out: Path, job_id: str) -> str:
    """Every task's log (submitit's, one per task; task 0's holds the batch script's lines), in task order."""
    paths = sorted((out / "slurm-jit" / "logs").glob(f"{job_id}_*_log.out"),
                   key=lambda p: int(p.name.split("_")[1]))
    return "".join(p.read_text(errors="replace") for p in paths)


def until_job(what: str, check: Callable[[], object], out: Path, job_id: str, timeout_s: float,
              poll_s: float = 1.0) -> object:
    """``until(check)``, else fail naming ``what``, the job's state and the end of its tasks' logs."""
    value = until(check, timeout_s, poll_s)
    if value:
        return value
    raise AssertionError(f"job {job_id}: {what} not within {timeout_s} s; "
                         f"{slurm.show_job(job_id).get('JobState')}\n{tasks_log(out, job_id)[-3000:]}")


def ended(job_id: str) -> dict[str, str] | None:
    """The job, once Slurm says it ended; None before."""
    job = slurm.show_job(job_id)
    return job if slurm.job_state(job) in ENDED else None
