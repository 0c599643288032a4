"""Both launch paths end to end on the real local Slurm: the real --signal at the time limit, preemption through
the urgent partition, a user's scancel, SIGKILL during a save, the maximum requeues and the no-progress stop.

The cluster has 2 CPUs and each job takes both, so jobs run one after another: every job here is shared by
several assertions, and the time limits are as short as a reliable warning allows (--time=3 with TERM@60: the
warning comes 60-120 s in; at --time=1 it can beat the batch shell). The time-limit test moves its limit once the
ranks train (submit_jobs.limit_from_now), so that a slow start-up never meets the warning first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jit_helpers import ckpt_check, final_losses, losses, run_to_end
from submit_jobs import SUBMIT, job_log, limit_from_now, submit_training

from slurm_jit import slurm
from slurm_jit.launch import progress
from slurm_jit.train import stop_record

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed, pytest.mark.usefixtures("slurm_cluster")]

ROOT = Path(__file__).resolve().parents[2]
JOB_DEADLINE_S = 600  # a hang detector: queued behind other jobs on 2 CPUs, a 3-minute job ends well within
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL"}
DEMO = ["-m", "slurm_jit.demo_train"]
LIMIT_FROM_NOW_S = 120  # --signal-lead 60: the warning 0-60 s after the limit is moved (submit_jobs.limit_from_now)


def _submit(out: Path, jobs: list[str], *options: str, train: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> str:
    return submit_training(out, jobs, DEMO, *options, train=train, env=env)


def _until(what: str, check, out: Path, job_id: str, timeout_s: float = JOB_DEADLINE_S,  # type: ignore[no-untyped-def]
           poll_s: float = 1.0):
    """Poll ``check`` until it is truthy; a job that ended first fails at once, with its log (a record is purged
    MinJobAge after the end, so waiting on would only hide why)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        state = _state(job_id)
        ended = state in ENDED or state.startswith("PURGED")
        assert not ended, f"job {job_id} ended {state} before {what}\n{job_log(out, job_id)[-3000:]}"
        time.sleep(poll_s)
    raise AssertionError(f"job {job_id}: {what} not within {timeout_s} s; "
                         f"{_state(job_id)}\n{job_log(out, job_id)[-3000:]}")


def _state(job_id: str) -> str:
    try:
        return slurm.job_state(slurm.show_job(job_id))
    except slurm.SlurmError as exc:  # ended more than MinJobAge ago: the record is gone, the log is what is left
        return f"PURGED ({exc})"


def _ended(job_id: str) -> dict[str, str] | None:
    job = slurm.show_job(job_id)
    return job if slurm.job_state(job) in ENDED else None


def _requeued(job_id: str) -> bool:
    return slurm.show_job(job_id).get("Restarts", "0") != "0"


def _steps_at_least(out: Path, n: int) -> bool:
    return len(losses(out)) >= n


def _decisions(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("slurm-jit: ") and "; policy: " in line]


def _kill_ranks(out: Path) -> list[int]:
    """SIGKILL the training processes of ``out`` (the srun tasks run on this machine)."""
    killed = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and b"slurm_jit.demo_train" in argv and str(out).encode() in argv:
            os.kill(int(proc.name), signal.SIGKILL)
            killed.append(int(proc.name))
    return killed


def _reference(tmp: Path, args: list[str]) -> list[tuple[int, float]]:
    """The same training, uninterrupted, outside Slurm (no step sleep: it does not change the losses)."""
    out = tmp / "reference"
    assert run_to_end(out, args) == [0, 0]
    return losses(out)


def test_time_limit_signal_jit_requeue_resume_finish_through_submit(tmp_path: Path, jobs: list[str]) -> None:
    out = tmp_path / "out"
    # 400 steps of >= 0.4 s: the first run cannot finish before the latest warning, 60 s after the limit is moved
    # (at 0.2 s a step it did on an idle CI machine: finished, no requeue, and the record was purged while the test
    # waited). The requeued run (SLURM_RESTART_COUNT 1) steps without the sleep: it only has to finish.
    train = ("--max-steps", "400", "--save-steps", "150", "--step-sleep", "0.4", "--step-sleep-requeued", "0")
    job_id = _submit(out, jobs, "--max-requeues", "3", "--job-name", "time limit; $(x)", "--time", "10",
                     train=train)
    assert slurm.run(["squeue", "-h", "-j", job_id, "-o", "%j"]).strip() == "time limit; $(x)"  # as argv
    _until("training steps", lambda: _steps_at_least(out, 3), out, job_id)
    limit_from_now(job_id, LIMIT_FROM_NOW_S)
    _until("the requeue", lambda: _requeued(job_id), out, job_id)
    # The requeued run gets the time to finish (the loop itself is what is under test, not a second warning).
    slurm.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=8"])
    reference = _reference(tmp_path, ["--max-steps", "400", "--save-steps", "150"])  # while the resumed run trains
    job = _until("the end", lambda: _ended(job_id), out, job_id)
    log = job_log(out, job_id)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", log[-3000:]
    decisions = _decisions(log)
    assert len(decisions) == 2, log[-3000:]
    assert "stopped by time limit" in decisions[0] and "policy: requeue: JIT checkpoint complete" in decisions[0]
    assert decisions[1] == "slurm-jit: finished at step 400 (restart 1); policy: no requeue: training reached its end"
    assert f"slurm-jit: job {job_id} restart 1 on" in log  # the same job id, restart count shown
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished" and record["step"] == 400
    assert record["job_id"] == job_id and record["restart_count"] == "1"
    assert final_losses(out) == reference  # bitwise, across the restart
    assert ckpt_check(out).returncode == 0
    status = subprocess.run([sys.executable, str(SUBMIT), "status", job_id], capture_output=True, text=True,
                            check=False, timeout=60)
    assert status.returncode == 0 and f"job:      {job_id} COMPLETED, restarts 1" in status.stdout, status
    assert "stopped:  finished at step 400 (restart 1)" in status.stdout
    assert "resume:   training finished at step 400" in status.stdout, status.stdout
    assert "grace:    step" in status.stdout


def test_user_scancel_is_never_requeued(tmp_path: Path, jobs: list[str]) -> None:
    out = tmp_path / "out"
    job_id = _submit(out, jobs, train=("--max-steps", "3000", "--step-sleep", "0.1"))
    _until("training steps", lambda: _steps_at_least(out, 3), out, job_id)
    slurm.cancel(job_id)
    job = _until("the end", lambda: _ended(job_id), out, job_id, timeout_s=120)
    time.sleep(15)  # longer than a requeued job's wait for eligibility here (cred_expire=10 s)
    job = slurm.show_job(job_id)
    assert job["JobState"] == "CANCELLED" and job["Restarts"] == "0", job_log(out, job_id)[-3000:]
    assert "restart 1" not in job_log(out, job_id)
    assert all("policy: requeue" not in d for d in _decisions(job_log(out, job_id)))
    # scancel killed the batch shell with the ranks: no after_step, no slurm-jit: line; status says it from Slurm
    status = subprocess.run([sys.executable, str(SUBMIT), "status", str(out)], capture_output=True, text=True,
                            check=False, timeout=60)
    assert status.returncode == 0 and "stopped:  user cancel (restart 0), not requeued: Slurm says CANCELLED " \
        "(scancel)" in status.stdout, status


def test_maximum_requeues_reached(tmp_path: Path, jobs: list[str]) -> None:
    out = tmp_path / "out"
    job_id = _submit(out, jobs, "--max-requeues", "0", train=("--max-steps", "3000", "--step-sleep", "0.1"))
    _until("training steps", lambda: _steps_at_least(out, 3), out, job_id)
    slurm.cancel(job_id, signal_name="TERM")  # to the ranks, as --signal does: a JIT stop
    job = _until("the end", lambda: _ended(job_id), out, job_id, timeout_s=180)
    log = job_log(out, job_id)
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop", log[-3000:]
    assert job["Restarts"] == "0" and job["JobState"] in {"FAILED", "COMPLETED"}
    (decision,) = _decisions(log)
    # "stop signal", or "time limit" when startup was slow enough to bring the stop within N + 60 s of the limit
    assert "at step" in decision and "policy: no requeue: maximum requeues reached (0 of 0)" in decision


def test_no_progress_since_the_last_restart_stops_the_loop(tmp_path: Path, jobs: list[str]) -> None:
    """Run 0 stops at step S and is requeued; run 1 is signalled before its first step, so it stops at S again:
    a crash loop (as when the warning comes before a run can make a step), not requeued."""
    out = tmp_path / "out"
    job_id = _submit(out, jobs, "--max-requeues", "3", train=("--max-steps", "3000", "--step-sleep", "0.1"))
    _until("training steps", lambda: _steps_at_least(out, 3), out, job_id)
    slurm.cancel(job_id, signal_name="TERM")

    def run1_in_train() -> bool:
        record = stop_record.read(out) or {}
        return record.get("state") == "running" and record.get("restart_count") == "1"

    # the window until its first step is DeepSpeed's start and the load (~3 s idle): looked at every 50 ms
    _until("restart 1 in train()", run1_in_train, out, job_id, poll_s=0.05)
    slurm.cancel(job_id, signal_name="TERM")  # before its first step: DeepSpeed is still initialising
    job = _until("the end", lambda: _ended(job_id), out, job_id, timeout_s=180)
    log = job_log(out, job_id)
    decisions = _decisions(log)
    assert len(decisions) == 2 and "policy: requeue" in decisions[0], log[-3000:]
    step = int(decisions[0].split(" at step ")[1].split()[0])
    assert f"crash loop: no progress since the last restart (step {step})" in decisions[1]
    assert job["Restarts"] == "1"
    assert progress.read(out)["last_step"] == step


def test_sigkill_during_a_save_resumes_from_the_previous_complete_checkpoint(tmp_path: Path,
                                                                            jobs: list[str]) -> None:
    out = tmp_path / "out"
    job_id = _submit(out, jobs, "--retry-on-failure", "1",
                     train=("--max-steps", "30", "--save-steps", "10", "--step-sleep", "0.1"),
                     env={"SLURM_JIT_FAULT_SAVE_SLEEP_S": "6"})
    _until("checkpoint-20 being written", lambda: (out / "checkpoint-20").is_dir()
           and (out / "checkpoint-10" / "slurm-jit-manifest.json").exists(), out, job_id)
    # SIGKILL every rank mid-save, as the OOM killer would (scancel --signal=KILL cancels the whole job instead)
    killed = _kill_ranks(out)
    assert len(killed) == 2, killed
    job = _until("the end", lambda: _ended(job_id), out, job_id)
    log = job_log(out, job_id)
    decisions = _decisions(log)
    assert "stopped by crash" in decisions[0] and "failure retry 1 of 1" in decisions[0], log[-3000:]
    assert f"resume from {out}/checkpoint-10" in log  # the gate of run 1: the complete one, not checkpoint-20
    assert "checkpoint-20 incomplete" in log
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1"
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished" and record["step"] == 30
    steps = [s for s, _ in losses(out)]
    assert steps.count(11) == 2 and steps[-1] == 30  # steps 11.. ran again after the resume from 10


def test_raw_sbatch_preempted_through_urgent_is_requeued_and_finishes(tmp_path: Path, jobs: list[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job_id = slurm.submit(ROOT / "sbatch" / "demo.sbatch", [
        f"--export=ALL,OUT={out},MAX_STEPS=150,SAVE_STEPS=1000,STEP_SLEEP=0.1", f"--output={out}/slurm-%j.out",
        "--partition=debug"])
    jobs.append(job_id)
    reference = _reference(tmp_path, ["--max-steps", "150", "--save-steps", "1000"])
    _until("training steps", lambda: _steps_at_least(out, 10), out, job_id)
    urgent = slurm.run(["sbatch", "--parsable", "--partition=urgent", "--ntasks=2", "--cpus-per-task=1",
                        "--time=1", f"--output={tmp_path}/urgent-%j.out", "--wrap=sleep 5"]).strip()
    jobs.append(urgent)
    _until("the requeue", lambda: _requeued(job_id), out, job_id)
    job = _until("the end", lambda: _ended(job_id), out, job_id)
    log = job_log(out, job_id)
    decisions = _decisions(log)
    assert "stopped by preemption" in decisions[0] and "policy: requeue" in decisions[0], log[-3000:]
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1"
    assert final_losses(out) == reference


MARK = ("import os, sys, time\n"
        "open(sys.argv[1], 'a').write(f\"{sys.argv[2]} {os.environ.get('SLURM_RESTART_COUNT', '0')}\\n\")\n"
        "time.sleep(600)\n")


def _submit_mark(out: Path, marks: Path, name: str) -> subprocess.CompletedProcess[str]:
    """A one-task job whose command appends ``NAME RESTART`` to ``marks``, then sleeps."""
    return subprocess.run([sys.executable, str(SUBMIT), "--output-dir", str(out), "--ntasks-per-node", "1",
                           "--cpus-per-task", "1", "--time", "5", "--signal-lead", "60", "--job-name", name, "--",
                           sys.executable, "-c", MARK, str(marks), name], capture_output=True, text=True,
                          check=False, timeout=120)


def test_a_second_submit_into_a_live_jobs_directory_is_refused_and_a_requeue_runs_the_jobs_own_command(
        tmp_path: Path, jobs: list[str]) -> None:
    """Before, the second submit went in and rewrote OUT_DIR/slurm-jit/launch-spec.json: the first job, requeued,
    ran the second one's command. The directory's name holds a '%' (sbatch's --output pattern escapes it)."""
    out, marks = tmp_path / "run 50%x", tmp_path / "marks"
    first = _submit_mark(out, marks, "first")
    assert first.returncode == 0, first.stdout + first.stderr
    job_id = first.stdout.split("submitted job ")[1].split(";")[0]
    jobs.append(job_id)
    _until("the first run's mark", lambda: marks.exists() and "first 0" in marks.read_text(), out, job_id)
    second = _submit_mark(out, marks, "second")
    if "submitted job " in second.stdout:
        jobs.append(second.stdout.split("submitted job ")[1].split(";")[0])
    assert second.returncode == 1 and second.stdout == "", second
    assert f"is in use by job {job_id} (RUNNING)" in second.stderr and "HINT" in second.stderr
    assert len(second.stderr.splitlines()) == 1, second.stderr
    slurm.requeue(job_id)
    _until("the requeued run's mark", lambda: "first 1" in marks.read_text(), out, job_id)
    assert marks.read_text().split("\n")[:2] == ["first 0", "first 1"]
    assert (out / f"slurm-{job_id}.out").is_file()  # the literal directory, not "run 50first"
    assert sorted(p.name for p in (out / "slurm-jit").glob("*.sbatch")) == [f"job-{job_id}.sbatch"]
