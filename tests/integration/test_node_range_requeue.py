"""``--nodes 1-2`` through the launcher on the real two-node local cluster (``tools/local-slurm up --nodes 2``):
the job starts on both nodes (2 ranks, per-device batch 2, accumulation 2: 8 samples per optimizer step), is
JIT-stopped (TERM to the ranks, as --signal sends it), node2 is drained meanwhile, the requeued job starts on node1
alone (1 rank), the JitTrainer keeps the global batch (accumulation 4), the job finishes; ``status`` shows the
world size of each restart. node2 is resumed whatever happens (fixture teardown).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from jit_helpers import ckpt_check
from submit_jobs import ended, tasks_log, until_job

from slurm_jit import slurm
from slurm_jit.train import stop_record

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SUBMIT = ROOT / "launch" / "submit.py"
DRAINED = "node2"
MAX_STEPS = 30
STOP_AT_STEP = 4  # the first run is signalled once its timing log has this step (0.5 s a step: far from the end)
JOB_DEADLINE_S = 300  # a hang detector for each phase


@pytest.fixture
def drain(two_node_jobs: list[str]) -> Iterator[None]:
    """Drains DRAINED when the test asks; resumed at teardown, even when the test failed (set up after
    ``two_node_jobs``: torn down before the jobs are cancelled and the cluster's SLURM_CONF is dropped)."""
    yield
    if "DRAIN" in slurm.parse_key_values(slurm.run(["scontrol", "show", "node", DRAINED])).get("State", ""):
        slurm.run(["scontrol", "update", f"nodename={DRAINED}", "state=resume"])
    assert "DRAIN" not in slurm.run(["sinfo", "-h", "-n", DRAINED, "-o", "%T"]).upper()


def _stepped(out: Path) -> bool:
    """demo_train's loss log, written at every step (the timing log is flushed every 20 steps: a run whose first
    flush came at step 3 showed step 4 only at step 23, the signal came 5 steps before the end, and the trainer
    rightly finished instead of stopping)."""
    path = out / "losses-rank0.jsonl"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    steps = [json.loads(line)["step"] for line in lines if line.endswith("}")]
    return max(steps, default=-1) >= STOP_AT_STEP


@pytest.mark.timeout(3 * JOB_DEADLINE_S)
def test_a_node_range_job_comes_back_on_one_node_and_keeps_its_global_batch(
    tmp_path: Path, two_node_jobs: list[str], drain: None
) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, str(SUBMIT), "--nodes", "1-2", "--ntasks-per-node", "1", "--cpus-per-task", "1",
            "--time", "10", "--signal-lead", "60", "--max-requeues", "2", "--output-dir", str(out),
            "--", sys.executable, "-m", "slurm_jit.demo_train", "--output-dir", str(out), "--resume",
            "--zero-stage", "2", "--batch-size", "2", "--grad-accum", "2", "--max-steps", str(MAX_STEPS),
            "--step-sleep", "0.5", "--step-sleep-requeued", "0"]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "  nodes:    --nodes 1-2: each start (the first and every requeue) gets 1 to 2 nodes" in proc.stdout
    job_id = proc.stdout.split("submitted job ")[1].split(";")[0]
    two_node_jobs.append(job_id)

    until_job(f"step {STOP_AT_STEP}", lambda: _stepped(out), out, job_id, JOB_DEADLINE_S)
    assert slurm.show_job(job_id)["NodeList"] == "node[1-2]", tasks_log(out, job_id)[-3000:]
    # drained before the stop: the requeue is eligible again within ~11 s here, and must not find node2 free
    slurm.run(["scontrol", "update", f"nodename={DRAINED}", "state=drain", "reason=slurm-jit node-range test"])
    slurm.cancel(job_id, signal_name="TERM")  # to the ranks, as --signal sends it: a JIT stop
    until_job("the requeue", lambda: slurm.show_job(job_id).get("Restarts", "0") != "0", out, job_id, JOB_DEADLINE_S)
    job = until_job("the end", lambda: ended(job_id), out, job_id, JOB_DEADLINE_S)

    log = tasks_log(out, job_id)
    assert (job["JobState"], job["Restarts"], job["NodeList"]) == ("COMPLETED", "1", "node1"), log[-4000:]
    assert "slurm-jit: 2 ranks on 2 node(s) (--nodes=1-2)" in log and \
        "slurm-jit: 1 ranks on 1 node(s) (--nodes=1-2)" in log, log[-4000:]
    assert "world size 2 -> 1: gradient accumulation 2 -> 4, 8 samples per optimizer step" in log, log[-4000:]
    decisions = [line for line in log.splitlines() if line.startswith("slurm-jit: ") and "; policy: " in line]
    assert len(decisions) == 2 and "(restart 0); policy: requeue: JIT checkpoint complete" in decisions[0], decisions
    assert decisions[1] == f"slurm-jit: finished at step {MAX_STEPS} (restart 1); policy: no requeue: " \
                           "training reached its end"
    record = stop_record.read(out)
    assert record is not None and (record["state"], record["step"]) == ("finished", MAX_STEPS), record
    assert ckpt_check(out).returncode == 0
    status = subprocess.run([sys.executable, str(SUBMIT), "status", str(out)], capture_output=True, text=True,
                            check=False, timeout=60)
    assert f"ranks:    job {job_id}: restart 0 on 2 ranks, restart 1 on 1 rank (accumulation 2 -> 4)" \
        in status.stdout, status
