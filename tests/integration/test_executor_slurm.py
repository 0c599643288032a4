"""JitExecutor end to end on the real local Slurm: a Python function trains a JitTrainer on 2 ranks, is cut off by
its timeout_min warning, stops with a JIT checkpoint, is requeued as the same job id, finishes, and job.result()
is the function's value; a scancelled job says so and is never requeued.

The cluster has 2 CPUs and each job takes both, so jobs run one after another: one job carries every assertion of
the requeue chain. A loaded host takes over 2 minutes to start 2 DeepSpeed ranks, so a warning timed from the job's
start can come before the first step (a stop without a checkpoint, never requeued): once the job trains, its time
limit is brought to 2 minutes from now, and Slurm's own --signal=TERM@60 warning cuts it off about 1 minute later.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import executor_helpers
import pytest
from jit_helpers import losses
from submit_jobs import limit_from_now

from slurm_jit import slurm
from slurm_jit.launch import Command, CommandOutcome, JitExecutor
from slurm_jit.launch.executor import JitExecutorError
from slurm_jit.launch.job import JitJob as Job
from slurm_jit.train import stop_record

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed, pytest.mark.usefixtures("slurm_cluster")]

TESTS = Path(__file__).resolve().parents[1]
JOB_DEADLINE_S = 600  # a hang detector: queued behind other jobs on 2 CPUs, a 3-minute job ends well within
# 300 steps of >= 0.4 s cannot end before the warning (at most 60 s after the limit is moved, as TERM@60 may come
# up to 60 s early); the requeued run finishes the rest without the sleep.
TRAIN = ("--max-steps", "300", "--step-sleep", "0.4", "--step-sleep-requeued", "0")
LIMIT_FROM_NOW_S = 120  # TERM@60: the warning 0-60 s after the limit is moved


def _executor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str = "jit-executor",
              out: str = "out") -> JitExecutor:
    # sbatch exports this environment: the job imports executor_helpers (and this tree's slurm_jit) from it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS.parent / "src"), str(TESTS / "helpers"),
                                                      os.environ.get("PYTHONPATH", "")]))
    ex = JitExecutor(folder=tmp_path / "logs" / "%j", output_dir=tmp_path / out, max_requeues=3,
                     signal_lead_s=60)
    ex.update_parameters(timeout_min=3, tasks_per_node=2, cpus_per_task=1, name=name)
    return ex


def _until(what: str, check, job: Job, timeout_s: float = JOB_DEADLINE_S):  # type: ignore[no-untyped-def]
    """Poll ``check`` until it is truthy; a job that ended first fails at once, with its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        assert not job.done(force_check=True), f"job {job.job_id} ended before {what}\n{_log(job)}"
        time.sleep(1)
    raise AssertionError(f"job {job.job_id}: {what} not within {timeout_s} s\n{_log(job)}")


def _log(job: Job) -> str:
    return f"{job.stdout() or ''}\n{job.stderr() or ''}"[-4000:]


def test_a_function_is_cut_off_by_its_time_limit_requeued_and_its_result_is_the_last_runs(
        tmp_path: Path, jobs: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    job = _executor(tmp_path, monkeypatch).submit(executor_helpers.train_demo, str(out), *TRAIN)
    jobs.append(job.job_id)
    _until("training steps", lambda: len(losses(out)) >= 3, job)
    limit_from_now(job.job_id, LIMIT_FROM_NOW_S)
    _until("the requeue", lambda: slurm.show_job(job.job_id).get("Restarts", "0") != "0", job)
    assert not job.done(force_check=True)  # a JIT stop that is requeued is not a result
    assert not list(job.paths.folder.glob("*_result.pkl"))
    # The requeued run gets the time to finish (the chain is under test, not a second warning).
    slurm.run(["scontrol", "update", f"JobId={job.job_id}", "TimeLimit=10"])
    result = job.result()
    log = _log(job)
    assert result == {"rank": 0, "world_size": 2, "submitit_rank": 0, "restart": "1", "step": 300}, log[-3000:]
    assert [r["rank"] for r in job.results()] == [0, 1]
    assert job.state == "COMPLETED" and job.exception() is None
    assert slurm.show_job(job.job_id)["Restarts"] == "1"  # the same job id, run again
    batch_log = job.task(0).stdout() or ""  # the batch shell's lines, with rank 0's
    decisions = [line for line in batch_log.splitlines() if "; policy: " in line]
    assert len(decisions) == 2, log[-3000:]
    assert "stopped by time limit" in decisions[0] and "policy: requeue: JIT checkpoint complete" in decisions[0]
    assert decisions[1] == "slurm-jit: finished at step 300 (restart 1); policy: no requeue: training reached its end"
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished" and record["job_id"] == job.job_id
    assert losses(out)[-1][0] == 300


def test_a_scancelled_job_says_it_was_cancelled_and_is_never_requeued(
        tmp_path: Path, jobs: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    ex = _executor(tmp_path, monkeypatch, name="x JobState=RUNNING")  # a name that reads as a state in scontrol
    job = ex.submit(executor_helpers.train_demo, str(out), "--max-steps", "3000", "--step-sleep", "0.1")
    jobs.append(job.job_id)
    _until("training steps", lambda: len(losses(out)) >= 3, job)
    second = _executor(tmp_path, monkeypatch, name="second")  # a live job's output_dir: refused before sbatch
    with pytest.raises(JitExecutorError, match=f"in use by job {job.job_id}.*another output_dir=$"):
        second.submit(executor_helpers.train_demo, str(out), "--max-steps", "3")
    job.cancel()
    error = job.exception()
    assert error is not None and "cancelled" in str(error).splitlines()[0], error
    # the task's error log quoted as submitit quotes it: slurmstepd's line is in task 0's, the batch shell's, .err
    assert "\nError stream produced:\n" in str(error) and "CANCELLED AT" in str(error), error
    time.sleep(15)  # longer than a requeued job's wait for eligibility here (cred_expire=10 s)
    assert slurm.state_of(job.job_id) == "CANCELLED" and slurm.show_job(job.job_id)["Restarts"] == "0"
    assert job.state == "CANCELLED"
    assert "policy: requeue" not in (job.stdout() or "")


def test_a_command_is_execd_as_every_rank_and_a_raising_function_gives_its_reason(
        tmp_path: Path, jobs: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ex = _executor(tmp_path, monkeypatch)
    show_rank = "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])"
    command_job = ex.submit(Command([sys.executable, "-c", show_rank]))
    failing_job = _executor(tmp_path, monkeypatch, out="out-failing").submit(executor_helpers.fail, "boom")
    jobs.extend([command_job.job_id, failing_job.job_id])
    outcome = command_job.result()
    assert isinstance(outcome, CommandOutcome) and (outcome.srun_exit, outcome.restarts) == (0, 0), _log(command_job)
    assert outcome.stop_record is None and outcome.job_id == command_job.job_id
    assert "rank 1 of 2" in (command_job.task(1).stdout() or ""), _log(command_job)
    error = failing_job.exception()
    assert error is not None and str(error).startswith(
        f"job {failing_job.job_id}: task 0 raised ValueError: boom; stopped by crash (restart 0); policy: no "
        "requeue:"), error
    assert failing_job.state == "FAILED"
