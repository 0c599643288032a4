"""A real hang through ``python launch/submit.py`` on the local cluster: rank 1 of 2 real DeepSpeed ranks blocks
forever in ``on_step_begin`` on the first run only; the watchdog ends both ranks as ``hung``, after_step requeues
the job under ``--retry-on-hang`` (default 1), the requeued run resumes from the newest complete checkpoint and
finishes. Slow (two DeepSpeed starts, the hang bound, Slurm's requeue delay)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from jit_helpers import final_losses, losses, run_to_end
from submit_jobs import job_log, submit_training

from slurm_jit import slurm
from slurm_jit.launch import progress
from slurm_jit.train import stop_record

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

HANG_TIMEOUT_S = 10
STALL_AT_STEP = 3  # checkpoint-2 is the newest complete one when rank 1 blocks
JOB_DEADLINE_S = 420  # two starts of 2 DeepSpeed ranks on a loaded 2-core host, the bound, the requeue delay
# The training stalls on the first run only (SLURM_RESTART_COUNT unset or 0), else it is demo_train as is.
FIRST_RUN_STALLS = (
    "import os, sys; from slurm_jit import demo_train; "
    "extra = ['--stall-at-step', '3', '--stall-rank', '1', '--stall-s', '100000'] "
    "if os.environ.get('SLURM_RESTART_COUNT', '0') in ('', '0') else []; "
    "demo_train.main(sys.argv[1:] + extra)")


TRAINING = ["--max-steps", "8", "--save-steps", "2"]


def test_a_hung_rank_is_requeued_once_and_the_job_finishes(tmp_path: Path, jobs: list[str]) -> None:
    out = tmp_path / "out"
    train = [*TRAINING, "--hang-timeout", str(HANG_TIMEOUT_S)]
    job_id = submit_training(out, jobs, ["-c", FIRST_RUN_STALLS], "--time", "8", train=train)
    deadline = time.monotonic() + JOB_DEADLINE_S
    while slurm.live_state(job_id) is not None and time.monotonic() < deadline:
        time.sleep(2)
    log = job_log(out, job_id)
    assert slurm.live_state(job_id) is None, f"job {job_id} still running after {JOB_DEADLINE_S} s\n{log[-4000:]}"
    assert f"stopped by hang at step {STALL_AT_STEP} on rank 1 (node " in log, log[-4000:]
    assert "stack in the log (restart 0); policy: requeue" in log and "hang retry 1 of 1" in log, log[-4000:]
    assert "checkpoint-2" in log.split("policy: requeue")[1].split("\n")[0], log[-4000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished" and str(record.get("restart_count")) == "1", record
    saved = progress.read(out)
    assert progress.hang_retries(saved, job_id) == 1, saved
    assert [e["cause"] for e in progress.history(saved)] == ["hang", "finished"], saved
    reference = tmp_path / "reference"  # the same training, uninterrupted, outside Slurm
    assert run_to_end(reference, TRAINING) == [0, 0]
    assert final_losses(out) == losses(reference)  # bitwise: steps 1-2 of the hung run, 3-8 resumed from checkpoint-2
