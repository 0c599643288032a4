"""``tools/goodput --quick`` on the local cluster: the JitTrainer's uninterrupted run, then its chain under the
seeded schedule (a SIGKILL of a rank, a preemption by the urgent partition during the restart after it, a hung
rank), every job real. About 5-6 minutes here: two DeepSpeed starts per run, Slurm's requeue delays, the hang's
20 s bound."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from slurm_jit import slurm
from slurm_jit.goodput.schedule import make_schedule

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

ROOT = Path(__file__).resolve().parents[2]
QUICK_TIMEOUT_S = 1500  # a hang detector: ~6 min here; the chain's own budget is 600 s past the reference
SPLIT_TOLERANCE = 0.2  # the split against the matched loss: runs still differ in step and restart times
SPLIT_SLACK_S = 10.0


@pytest.mark.timeout(QUICK_TIMEOUT_S)
def test_tools_goodput_quick_measures_a_finished_chain(tmp_path: Path) -> None:
    out = tmp_path / "results"
    try:
        proc = subprocess.run([str(ROOT / "tools" / "goodput"), "--quick", "--out", str(out)], capture_output=True,
                              text=True, timeout=QUICK_TIMEOUT_S - 60, check=False)
    finally:  # a run cut short leaves its job: cancel the jobs whose batch script lies under this test's folder
        for line in slurm.run(["squeue", "-h", "-o", "%i|%o"]).splitlines():
            job, _, command = line.partition("|")
            if str(tmp_path) in command:
                slurm.cancel(job.strip())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results["systems"]) == ["c"]
    c = results["systems"]["c"]
    assert c["finished"] and c["steps_done"] == make_schedule(1, quick=True).work_steps, c["outcome"]
    assert 0 < c["goodput"] <= 1 and 0 < c["predicted_goodput"] <= 1
    assert c["paced_goodput"] is not None and 0 < c["paced_goodput"] <= 1  # the reference at the chain's own pace
    assert c["weights_equal"] is True  # bitwise: the same sha256 of every parameter as the uninterrupted run
    kinds = [e["kind"] for e in c["ends"]]
    assert kinds.count("kill") == 1 and kinds.count("hang") == 1 and kinds.count("preempt") == 1, kinds
    snapshot_steps = results["schedule"]["save_steps"] // 10
    kill = next(e for e in c["ends"] if e["kind"] == "kill")
    assert kill["redone_steps"] <= snapshot_steps, kill  # at most one snapshot interval at the unwarned kill
    preempt = next(e for e in c["ends"] if e["kind"] == "preempt")
    assert preempt["redone_steps"] == 0 and preempt["last_step"] is None, preempt  # it landed in the start-up
    # the matched loss: the reference's start-up and end (no fault's cost) swapped for the chain's; the raw loss
    # moves with the reference's start-up alone (a run here: 19.1 s against the chain's 6 s, split 59 s, loss 43 s)
    matched = c["matched_loss_s"]
    assert abs(c["split_s"] - matched) <= max(SPLIT_TOLERANCE * matched, SPLIT_SLACK_S), c
    assert c["allocation_s"] > c["uninterrupted_s"] > 0
    assert (out / "timeline-c.svg").read_text().startswith("<svg")
    assert "| (c) JitTrainer" in (out / "results.md").read_text()
