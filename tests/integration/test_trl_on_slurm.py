"""One row of the TRL matrix (tests/train/test_trl_matrix.py) through the real local Slurm: TRL's DPOTrainer with an
explicit reference model, JIT by ``with_jit``, on 2 ZeRO-2 ranks submitted by ``launch/submit.py``: the time
limit's warning (``--signal-lead 60``; the limit moved to 2 minutes from now once the ranks train) stops it with a
JIT checkpoint, the job is requeued (the same job id), resumes and finishes; every loss and the final weights
bitwise equal to the uninterrupted run outside Slurm. About 5 minutes (the cluster's 2 CPUs are shared).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from jit_helpers import ckpt_check, run_logged
from submit_jobs import job_log, limit_from_now, submit_training
from trl_rows import EXAMPLES, final_state, losses

from slurm_jit import slurm
from slurm_jit.train import stop_record

pytest.importorskip("trl")

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed, pytest.mark.usefixtures("slurm_cluster")]

PROGRAM = [str(EXAMPLES / "trl_matrix.py"), "--row", "dpo"]
# 300 steps of >= 0.4 s: the first run cannot finish before the latest warning (60 s after the limit is moved, once
# the ranks train); no evaluation.
TRAIN = ["--max-steps", "300", "--zero-stage", "2", "--kill-wait", "1", "--samples", "64"]
STEP_SLEEP = ["--step-sleep", "0.4"]  # only under Slurm: sleeping changes no loss
LIMIT_FROM_NOW_S = 120  # --signal-lead 60: the warning 0-60 s after the limit is moved
JOB_DEADLINE_S = 900  # a hang detector: queued behind other jobs on 2 CPUs, then 3 minutes + the rest
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL"}


def _submit(out: Path, jobs: list[str]) -> str:
    return submit_training(out, jobs, PROGRAM, "--max-requeues", "2", "--time", "10", train=[*TRAIN, *STEP_SLEEP])


def _until(what: str, check, out: Path, job_id: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Poll ``check`` until it returns the job; a job that ended otherwise fails at once, with its log."""
    deadline = time.monotonic() + JOB_DEADLINE_S
    while time.monotonic() < deadline:
        job = slurm.show_job(job_id)
        if check(job):
            return job
        assert slurm.job_state(job) not in ENDED, f"job {job_id} ended before {what}\n{job_log(out, job_id)[-3000:]}"
        time.sleep(1)
    raise AssertionError(f"job {job_id}: {what} not within {JOB_DEADLINE_S} s\n{job_log(out, job_id)[-3000:]}")


def test_a_dpo_run_stopped_by_the_time_limit_is_requeued_and_finishes_bitwise(tmp_path: Path,
                                                                               jobs: list[str]) -> None:
    out = tmp_path / "out"
    job_id = _submit(out, jobs)
    _until("training steps", lambda job: len(losses(out)) >= 3, out, job_id)
    limit_from_now(job_id, LIMIT_FROM_NOW_S)
    _until("the requeue", lambda job: job.get("Restarts", "0") != "0", out, job_id)
    slurm.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"])  # the resumed run finishes
    reference = tmp_path / "reference"
    ran = run_logged(reference, TRAIN, program=PROGRAM)  # while the resumed run trains
    assert ran.codes == [0, 0], ran.log[-4000:]
    job = _until("the end", lambda job: slurm.job_state(job) in ENDED, out, job_id)
    log = job_log(out, job_id)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", log[-3000:]
    decisions = [line for line in log.splitlines() if line.startswith("slurm-jit: ") and "; policy: " in line]
    assert len(decisions) == 2 and "stopped by time limit" in decisions[0], log[-3000:]
    assert "policy: requeue: JIT checkpoint complete" in decisions[0], decisions
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished" and record["step"] == 300, record
    final: dict[int, float] = {}
    for step, loss in losses(out):  # the stopped run may log a step its resume repeats: the last one counts
        final[step] = loss
    assert sorted(final.items()) == losses(reference)  # bitwise, across the requeue
    assert final_state(out) == final_state(reference)
    assert ckpt_check(out).returncode == 0
