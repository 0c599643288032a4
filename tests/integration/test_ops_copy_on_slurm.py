"""A job's ranks load DeepSpeed's ops from their start's own copy (launch/ops.py): a build lock in the shared
TORCH_EXTENSIONS_DIR, another job's build in flight or one left by a build cut off, no longer holds them. Before,
torch's loader waited on that lock forever, silently, before the first step. Real job, real op, real lock file."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from jit_helpers import final_losses
from submit_jobs import ended, submit_training, tasks_log, until_job

from slurm_jit import slurm
from slurm_jit.launch import ops

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed, pytest.mark.usefixtures("slurm_cluster")]

DEMO = ["-m", "slurm_jit.demo_train"]
# A hang detector: the job starts in ~20-40 s on the loaded 2-core host, after others' jobs on its 2 CPUs.
JOB_DEADLINE_S = 600


def test_a_lock_in_the_shared_ops_dir_does_not_hold_the_job(tmp_path: Path, jobs: list[str]) -> None:
    built = ops.torch_build_root({k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"})
    assert built is not None and ops.built(ops.CPU_COMM_OP, built), "HINT: tools/setup-env builds the op"
    shared = tmp_path / "ext"
    shutil.copytree(built / ops.CPU_COMM_OP, shared / ops.CPU_COMM_OP)
    lock = shared / ops.CPU_COMM_OP / ops.LOCK
    lock.touch()
    an_hour_ago = time.time() - 3600  # a build cut off by its job's time limit an hour ago
    os.utime(lock, (an_hour_ago, an_hour_ago))
    out = tmp_path / "out"
    job_id = submit_training(out, jobs, DEMO, train=("--max-steps", "3"), env={"TORCH_EXTENSIONS_DIR": str(shared)})
    job = until_job("its end", lambda: ended(job_id), out, job_id, JOB_DEADLINE_S)
    log = tasks_log(out, job_id)
    assert slurm.job_state(job) == "COMPLETED", log[-3000:]  # type: ignore[arg-type]
    assert [step for step, _ in final_losses(out)] == [1, 2, 3], log[-3000:]
    assert f"rm {lock}" in log, log[-3000:]  # the lock said in one line, for the loaders it still holds
    assert lock.exists()  # not the job's to remove: someone may be building
    assert not ops.copy_path(os.environ, job_id, 0).exists()  # the job's end removed its node's copy
