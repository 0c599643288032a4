"""--exclude-hung-node on the real two-node local cluster: a 1-node job whose stop record says ``hung`` on its node
is requeued by after_step with that node in its ExcNodeList (requeuehold, update, release) and runs again on the
other node; a 2-node job (no spare node: excluded, it would pend forever) is requeued plainly, said in one line.

The training is a stand-in that writes the ``hung`` record as the watchdog does (a fake allowed only here: a real
hang on real ranks is tests/train/test_hang_watchdog.py; what this checks is the launcher's side, on real Slurm).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from submit_jobs import until

from slurm_jit import slurm
from slurm_jit.launch import progress

pytestmark = pytest.mark.slurm

JOB_DEADLINE_S = 120  # the first run is seconds long; the requeue is at once
POLL_S = 1.0
# The last rank reports a hang on its node (SLURMD_NODENAME: on this cluster both nodes' hostname is the
# machine's), any other as waiting in the collective, as a real hang's reports read; rank 0 writes the record.
# The other ranks exit only once it is written: a real rank 0 outlives srun's --kill-on-bad-exit SIGTERM (its
# handler only notes it) until its own watchdog fires, but a stand-in still starting would die of it (seen in CI).
STAND_IN = """\
import os, sys, time
from slurm_jit.train import stop_record
out, rank, world = sys.argv[1], int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
report = {"rank": rank, "node": os.environ["SLURMD_NODENAME"], "step": 4, "phase": "step", "since_s": 31.0,
          "frame": "distributed_c10d.py:2501 in all_reduce" if rank < world - 1 else "train.py:12 in on_step_begin"}
stop_record.write_hang_report(out, rank, report)
if rank == 0:
    while len(stop_record.hang_reports(out)) < world:
        time.sleep(0.1)
    stop_record.write(out, "hung", step=4, ranks=stop_record.hang_reports(out), job_id=os.environ["SLURM_JOB_ID"],
                      restart_count=int(os.environ.get("SLURM_RESTART_COUNT") or 0))
deadline = time.monotonic() + 60
while stop_record.read(out) is None and time.monotonic() < deadline:
    time.sleep(0.1)
sys.exit(87)
"""


def _script(tmp_path: Path, nodes: int) -> Path:
    out, stand_in = tmp_path / "out", tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    script = tmp_path / "job.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes={nodes} --ntasks-per-node=1 --time=5 --requeue --open-mode=append --output={tmp_path}/job.log
if [ "${{SLURM_RESTART_COUNT:-0}}" != 0 ]; then echo "restarted on $SLURM_JOB_NODELIST"; exit 0; fi
srun --kill-on-bad-exit=1 {sys.executable} {stand_in} {out}
srun_exit=$?
exec {sys.executable} -m slurm_jit.launch.after_step {out} --srun-exit "$srun_exit" --max-requeues 2 \\
  --exclude-hung-node
""")
    return script


def _until(what: str, check, log: Path):  # type: ignore[no-untyped-def]
    value = until(check, JOB_DEADLINE_S, POLL_S)
    if value:
        return value
    raise AssertionError(f"{what} not within {JOB_DEADLINE_S} s\n{log.read_text() if log.exists() else ''}")


def test_a_hang_on_a_node_requeues_the_job_without_that_node(tmp_path: Path, two_node_jobs: list[str]) -> None:
    job_id = slurm.submit(_script(tmp_path, nodes=1))
    two_node_jobs.append(job_id)
    log = tmp_path / "job.log"
    _until("the restart", lambda: "restarted on" in (log.read_text() if log.exists() else ""), log)
    text = log.read_text()
    hung_on = text.split("stopped by hang at step 4 on rank 0 (node ")[1].split(")")[0]
    assert hung_on in ("node1", "node2") and "policy: requeue" in text and f"excluding node {hung_on}" in text, text
    assert f"restarted on {({'node1', 'node2'} - {hung_on}).pop()}" in text, text  # never again on the hung one
    assert slurm.show_job(job_id).get("ExcNodeList") == hung_on
    saved = progress.read(tmp_path / "out")
    assert progress.hang_retries(saved, job_id) == 1 and saved["history"][-1]["outcome"] == "requeued"


def test_a_job_that_needs_every_node_is_requeued_without_the_exclusion_and_says_so(
        tmp_path: Path, two_node_jobs: list[str]) -> None:
    job_id = slurm.submit(_script(tmp_path, nodes=2))
    two_node_jobs.append(job_id)
    log = tmp_path / "job.log"
    # excluding node2 would leave one node for a 2-node job: pending forever (ReqNodeNotAvail); it runs again
    _until("the restart", lambda: "restarted on" in (log.read_text() if log.exists() else ""), log)
    text = log.read_text()
    assert "stopped by hang at step 4 on rank 1 (node node2), stack in the log" in text, text
    assert ("warning: node node2 not excluded: the job needs 2 node(s) and partition debug would have 1 left "
            "without it") in text and "HINT:" in text, text
    assert slurm.show_job(job_id).get("ExcNodeList") == "(null)"

