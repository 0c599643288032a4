"""The JitTrainer under the real local Slurm cluster: one srun task per rank, Slurm's own signal delivery (to
every process of the step, DataLoader workers included), the runtime grace check, the stop record."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from jit_helpers import ckpt_check, losses

from slurm_jit import slurm
from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed, pytest.mark.usefixtures("slurm_cluster")]

JOB_TIMEOUT_S = 300


def _wait_state(job_id: str, done: set[str], timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = slurm.show_job(job_id)
        if job.get("JobState") in done:
            return job
        time.sleep(1)
    slurm.cancel(job_id)
    raise AssertionError(f"job {job_id} still {slurm.show_job(job_id).get('JobState')} after {timeout_s} s")


def _run_and_signal(tmp_path: Path, jobs: list[str], extra: str) -> tuple[dict[str, str], str, str]:
    out = tmp_path / "out"
    script = tmp_path / "job.sbatch"
    bin_dir = Path(sys.executable).parent
    script.write_text(f"""#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:10:00
#SBATCH --output={tmp_path}/slurm-%j.out
export PATH={bin_dir}:$PATH
export SLURM_JIT_SIGNAL_LEAD_S=1
srun python -m slurm_jit.demo_train --output-dir {out} --max-steps 3000 --step-sleep 0.03 --workers 2 \\
  --kill-wait 1 --resume {extra}
python -m slurm_jit.train.stop_record {out}
echo "stop_record exit $?"
""")
    job_id = slurm.submit(script)
    jobs.append(job_id)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while len(losses(out)) < 5:
        assert time.monotonic() < deadline, (tmp_path / f"slurm-{job_id}.out").read_text()[-3000:]
        assert slurm.show_job(job_id).get("JobState") in {"PENDING", "RUNNING", "CONFIGURING"}, \
            (tmp_path / f"slurm-{job_id}.out").read_text()[-3000:]
        time.sleep(0.5)
    slurm.cancel(job_id, signal_name="TERM")  # to the job step's processes, as --signal=TERM@N does
    job = _wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 120)
    return job, job_id, (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")


def test_scancel_signal_to_srun_tasks_with_workers_gives_jit_stop(tmp_path: Path, jobs: list[str]) -> None:
    out = tmp_path / "out"
    job, job_id, log = _run_and_signal(tmp_path, jobs, "")
    assert job["JobState"] == "COMPLETED", log[-4000:]
    assert "DataLoader worker" not in log  # workers ignored the step's SIGTERM
    assert "stop_record exit 10" in log  # jit_stop: the requeue code
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["job_id"] == job_id
    check = ckpt_check(out, "--deep")
    assert check.returncode == 0 and check.stdout.splitlines()[-1] == record["checkpoint"]
    assert protocol.inspect(Path(record["checkpoint"]), record["step"]).kind == "jit"
    # the runtime grace check read SLURM_JIT_SIGNAL_LEAD_S=1 and said it is too short, with the fix
    assert "signal lead 1 s < needed" in log and "HINT: #SBATCH --signal=TERM@" in log


def test_without_the_worker_signal_mask_the_step_signal_kills_a_worker(tmp_path: Path, jobs: list[str]) -> None:
    """The control: Slurm really signals the DataLoader workers, so the default mask is what saves the run."""
    _, _, log = _run_and_signal(tmp_path, jobs, "--workers-take-signals")
    assert "DataLoader worker" in log and "killed by signal" in log, log[-3000:]
    assert "stop_record exit 1" in log  # failed: the launcher must not take it for a JIT stop
    record = stop_record.read(tmp_path / "out")
    assert record is not None and record["state"] == "failed" and "DataLoader worker" in record["error"]
