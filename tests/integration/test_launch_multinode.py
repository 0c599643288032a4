"""Two nodes through the launcher, for real: ``python launch/submit.py --nodes 2 --ntasks-per-node 1`` on the
two-node local cluster (``tools/local-slurm up --nodes 2``, its own SLURM_CONF; see
tests/integration/test_multinode.py). One
rank per node with MASTER_ADDR from the node list, the real time-limit ``--signal=TERM@60``, a JIT checkpoint, the
same job requeued by the policy, resumed, finished; per-step losses equal an uninterrupted 2-rank run's.

Both runs pin one thread per rank (OMP_NUM_THREADS=1): else accelerate gives each rank cores / ranks-per-node
threads, 1 rank per node here but 2 in the local reference, and the sums differ in the last bits from step 4 on
(measured: 80 of 400 steps) — the topology, not the restart. 3.6 min measured on 2 cores under load ~9 (the first
run until the time-limit warning <= 120 s, the JIT stop, the resumed run ~70 s; the reference meanwhile).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from jit_helpers import ckpt_check, losses, run_to_end
from submit_jobs import ended, limit_from_now, tasks_log, until_job

from slurm_jit import slurm
from slurm_jit.train import stop_record

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed]

ROOT = Path(__file__).resolve().parents[2]
SUBMIT = ROOT / "launch" / "submit.py"
SIGNAL_LEAD_S = 60
LIMIT_FROM_NOW_S = 120  # moved once the ranks train: the warning 0-60 s later (sbatch(1): up to 60 s early)
MAX_STEPS = 400  # at >= 0.4 s a step the first run cannot finish before the latest warning (60 s) plus margin
STEP_SLEEP_S = 0.4
RESUMED_TIME_LIMIT_MIN = 8  # the requeued run gets time to finish: the loop is under test, not a second warning
JOB_DEADLINE_S = 420  # a hang detector for each phase
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# Each rank says where it runs and what the task entry set, then becomes the training (exec: still the srun task).
SAY_RANK = 'echo "RANK $RANK of $WORLD_SIZE on $SLURMD_NODENAME MASTER_ADDR=$MASTER_ADDR ' \
           'LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE"; exec "$@"'


@pytest.mark.timeout(3 * JOB_DEADLINE_S)
def test_two_nodes_through_submit_time_limit_jit_requeue_resume_finish(
    tmp_path: Path, two_node_jobs: list[str]
) -> None:
    out = tmp_path / "out dir"  # a space: the path reaches sbatch, the gate and the ranks as data
    train = ["--model", "gpt2", "--zero-stage", "2", "--max-steps", str(MAX_STEPS), "--save-steps", "150"]
    argv = [sys.executable, str(SUBMIT), "--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task", "1",
            "--time", "10", "--signal-lead", str(SIGNAL_LEAD_S), "--max-requeues", "2", "--output-dir", str(out),
            "--", "bash", "-c", SAY_RANK, "bash", sys.executable, "-m", "slurm_jit.demo_train",
            "--output-dir", str(out), "--resume", "--step-sleep", str(STEP_SLEEP_S),
            "--step-sleep-requeued", "0", *train]  # the requeued run only has to finish: no sleep
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120,
                          env={**os.environ, **ONE_THREAD})  # SLURM_CONF: the two-node cluster (fixture)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.split("submitted job ")[1].split(";")[0]
    two_node_jobs.append(job_id)
    until_job("training steps", lambda: len(losses(out)) >= 3, out, job_id, JOB_DEADLINE_S)
    limit_from_now(job_id, LIMIT_FROM_NOW_S)
    until_job("the requeue", lambda: slurm.show_job(job_id).get("Restarts", "0") != "0", out, job_id, JOB_DEADLINE_S)
    slurm.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={RESUMED_TIME_LIMIT_MIN}"])
    reference = tmp_path / "reference"  # meanwhile: the same training, uninterrupted, 2 local ranks
    assert run_to_end(reference, train, env=ONE_THREAD) == [0, 0]
    job = until_job("the end", lambda: ended(job_id), out, job_id, JOB_DEADLINE_S)

    log = tasks_log(out, job_id)
    assert (job["JobState"], job["Restarts"], job["NodeList"]) == ("COMPLETED", "1", "node[1-2]"), log[-4000:]
    master = slurm.node_address("node1")
    ranks = {line for line in log.splitlines() if line.startswith("RANK ")}
    # Both runs: one rank per node, rank 0 on the first node, MASTER_ADDR its address, one rank per node.
    assert ranks == {f"RANK 0 of 2 on node1 MASTER_ADDR={master} LOCAL_WORLD_SIZE=1",
                     f"RANK 1 of 2 on node2 MASTER_ADDR={master} LOCAL_WORLD_SIZE=1"}, log[-4000:]
    decisions = [line for line in log.splitlines() if line.startswith("slurm-jit: ") and "; policy: " in line]
    assert len(decisions) == 2, log[-4000:]
    assert decisions[0].startswith("slurm-jit: stopped by time limit at step ") and \
        "(restart 0); policy: requeue: JIT checkpoint complete; requeue 1 of 2" in decisions[0], decisions
    assert decisions[1] == f"slurm-jit: finished at step {MAX_STEPS} (restart 1); policy: no requeue: " \
                           "training reached its end"
    assert f"slurm-jit: job {job_id} restart 1 on node[1-2]" in log  # the same job id, requeued
    record = stop_record.read(out)
    assert record is not None and (record["state"], record["job_id"]) == ("finished", job_id), record
    final = dict(losses(out))  # per step, the last run's loss (the stopped run may log a step its resume repeats)
    assert sorted(final.items()) == losses(reference)  # bitwise, across the restart and the two nodes
    assert ckpt_check(out).returncode == 0
