"""Issue 7 items 1-4 under the real local Slurm: a real time-limit signal (``--signal=TERM@N`` without ``B:``,
delivered to the srun tasks), one job for all the checks (the cluster has 2 CPUs and is shared). About 2 minutes;
the limit is moved once the ranks train, so that a slow start-up never meets the warning first.

The job trains with eval_steps = save_steps = 2, metric_for_best_model="loss", save_total_limit=1,
save_only_model and an on_save callback until the time-limit signal; after the stop an on_train_end callback
sleeps, and the test SIGKILLs the job's tasks then (scancel --signal=KILL), as a time limit would.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from jit_helpers import ckpt_check, losses
from submit_jobs import limit_from_now

from slurm_jit import slurm
from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed, pytest.mark.usefixtures("slurm_cluster")]

# The job starts with a long limit; once it has trained a few steps (the warm-up grace check done) the test moves
# the limit to 150 s from now, and slurmctld sends --signal=TERM@90 on its time-limit pass (every 30 s, up to 60 s
# early): 0-60 s later. A fixed --time=3 put the warning 60-90 s after the start, which ranks starting slowly on 2
# loaded cores (20-60 s) could reach before their first step.
TIME_LIMIT = "10"
SIGNAL_LEAD_S = 90
LIMIT_FROM_NOW_S = 150
STEPS_BEFORE_THE_LIMIT = 8
JOB_TIMEOUT_S = 300  # from the limit's move: the limit (150 s) + KillWait (30 s) + margin
PENDING_TIMEOUT_S = 900  # other jobs on the shared 2-CPU cluster may hold it this long
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}


def _script(tmp_path: Path, out: Path) -> Path:
    script = tmp_path / "job.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --time={TIME_LIMIT}
#SBATCH --signal=TERM@{SIGNAL_LEAD_S}
#SBATCH --output={tmp_path}/slurm-%j.out
export PATH={Path(sys.executable).parent}:$PATH
export SLURM_JIT_SIGNAL_LEAD_S=1
srun python -m slurm_jit.demo_train --output-dir {out} --max-steps 100000 --eval-steps 2 --save-steps 2 \\
  --metric-for-best loss --save-total-limit 1 --save-only-model --on-save-file extra.txt --step-sleep 0.2 \\
  --kill-wait 1 --slow-train-end 200 --resume
python -m slurm_jit.train.stop_record {out}
echo "stop_record exit $?"
""")
    return script


def _wait_running(job_id: str) -> None:
    """The cluster is shared: the job may wait for the 2 CPUs behind other jobs."""
    deadline = time.monotonic() + PENDING_TIMEOUT_S
    while (state := slurm.show_job(job_id).get("JobState")) in {"PENDING", "CONFIGURING"}:
        assert time.monotonic() < deadline, f"job {job_id} still {state} after {PENDING_TIMEOUT_S} s"
        time.sleep(1)


def _move_the_limit_once_training(job_id: str, out: Path, log: Path) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while len(losses(out)) < STEPS_BEFORE_THE_LIMIT:
        assert time.monotonic() < deadline, f"no step {STEPS_BEFORE_THE_LIMIT} after {JOB_TIMEOUT_S} s"
        state = slurm.show_job(job_id).get("JobState")
        assert state not in TERMINAL, log.read_text(errors="replace")[-4000:] if log.exists() else state
        time.sleep(0.5)
    limit_from_now(job_id, LIMIT_FROM_NOW_S)


def _wait_for_jit_stop(job_id: str, out: Path, log: Path) -> dict:
    _wait_running(job_id)
    _move_the_limit_once_training(job_id, out, log)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        record = stop_record.read(out)
        if record is not None and record["state"] != "running":
            return record
        state = slurm.show_job(job_id).get("JobState")
        assert state not in TERMINAL, log.read_text(errors="replace")[-4000:] if log.exists() else state
        time.sleep(0.5)
    raise AssertionError(f"no stop record after {JOB_TIMEOUT_S} s")


def test_time_limit_signal_items_1_to_4(tmp_path: Path, jobs: list[str]) -> None:
    out = tmp_path / "out"
    job_id = slurm.submit(_script(tmp_path, out))
    jobs.append(job_id)
    log = tmp_path / f"slurm-{job_id}.out"
    record = _wait_for_jit_stop(job_id, out, log)
    time.sleep(2.0)  # inside the slow on_train_end
    slurm.cancel(job_id, signal_name="KILL")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while slurm.show_job(job_id).get("JobState") not in TERMINAL and time.monotonic() < deadline:
        time.sleep(1)
    text = log.read_text(errors="replace")
    # item 4: killed after the manifest, the record says jit_stop (recorded before the slow end of training)
    assert record["state"] == "jit_stop" and record["job_id"] == job_id, (record, text[-3000:])
    assert stop_record.read(out)["state"] == "jit_stop"  # type: ignore[index]
    ckpt = Path(record["checkpoint"])
    # item 1: upstream's end-of-training cleanup (save_total_limit=1, a best model) left the JIT checkpoint
    check = ckpt_check(out, "--deep")
    assert check.returncode == 0 and check.stdout.splitlines()[-1] == str(ckpt), check.stdout + check.stderr
    # item 2: rotation kept the checkpoint just written and the best one, nothing else whole
    state = json.loads((ckpt / "trainer_state.json").read_text())
    kept = {ckpt.name, Path(state["best_model_checkpoint"]).name}
    whole = {c.path.name for c in protocol.scan(out)[0] if c.status in protocol.WHOLE_STATUSES}
    assert whole == kept, (whole, kept)
    # item 3: the JIT save is full under save_only_model; the periodic ones say model_only
    manifest = json.loads((ckpt / protocol.MANIFEST_NAME).read_text())
    assert manifest["kind"] == "jit" and manifest["contents"] == "full"
    assert any("optim_states" in rel for rel in manifest["files"]) and "extra.txt" in manifest["files"]
    best = Path(state["best_model_checkpoint"])
    if best != ckpt:
        assert json.loads((best / protocol.MANIFEST_NAME).read_text())["contents"] == "model_only"
    # item 4: the runtime grace check (it queries Slurm) never ran after the stop decision
    jit_line = text.index(f"jit checkpoint-{record['step']}:")
    assert "slurm_jit grace check" in text[:jit_line] and "slurm_jit grace check" not in text[jit_line:]
