"""grace-calc against the real local Slurm cluster: its KillWait and GraceTime, real scripts, submitted jobs,
and the delivery rules the calculator models (without ``B:`` only job steps get --signal; with ``B:`` only the
batch shell).

Needs ``tools/local-slurm up`` (started here when missing). With ``CI`` set, an unreachable cluster fails.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from grace_helpers import EXAMPLE_SIZING, EXPECTED, SBATCH, TINY_SIZING, grace_calc

from slurm_jit import slurm

pytestmark = pytest.mark.slurm

# slurmctld sends a --signal=...@60 warning on its time-limit pass (every 30 s) once start + limit - 60 - 30 <= now.
# With --time=1 that can be the very instant the job starts, before the batch shell has set its trap (seen here:
# the shell died of the TERM 50 ms after the start). With --time=2 it comes 30-60 s after the start.
DELIVERY_TIMEOUT_S = 120
# Job states of a job that has not ended; SIGNALING is shown (Slurm 22.05) while slurmctld delivers --signal.
NOT_ENDED = {"PENDING", "CONFIGURING", "RUNNING", "SIGNALING", "COMPLETING", "STAGE_OUT"}
QUEUE_TIMEOUT_S = 180  # the cluster has 2 CPUs; another test's job may hold them for a few minutes


@pytest.fixture(scope="module", autouse=True)
def cluster(slurm_cluster: None) -> None:
    """Every test here needs the cluster up."""


def raw_value(text: str, key: str) -> str:
    match = re.search(rf"(?:^|\s){key}\s*=\s*(\S+)", text, re.MULTILINE)
    assert match, f"{key} not in scontrol output"
    return match.group(1)


def test_kill_wait_and_grace_time_come_from_the_cluster() -> None:
    config = slurm.run(["scontrol", "show", "config"])
    kill_wait = int(raw_value(config, "KillWait"))
    preempt_type = raw_value(config, "PreemptType")
    for partition in re.findall(r"PartitionName=(\S+)", slurm.run(["scontrol", "show", "partition"])):
        text = slurm.run(["scontrol", "show", "partition", partition])
        grace_time = int(raw_value(text, "GraceTime"))
        preemptable = preempt_type != "preempt/none" and raw_value(text, "PreemptMode") != "OFF"
        proc = grace_calc("--step-time", "2m", "--save-time", "2m", "--margin", "0", "--partition", partition,
                          "--json")
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        facts = out["cluster"]
        assert (facts["kill_wait_s"], facts["grace_time_s"]) == (kill_wait, grace_time)
        assert facts["partition"] == partition
        assert facts["preemptable"] is preemptable and facts["kill_wait_source"] == "scontrol show config"
        assert any(f"hard deadline {243 + kill_wait} s after the signal" in n for n in out["notes"])
        warned = any(f"GraceTime {grace_time} s < needed 243 s" in w for w in out["warnings"])
        assert warned is (preemptable and grace_time < 243), (partition, out["warnings"])


def test_default_partition_is_read_when_none_is_named() -> None:
    default = slurm.default_partition()
    proc = grace_calc("--step-time", "1s", "--save-time", "1s", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cluster"]["partition"] == default


def test_unknown_partition_is_an_error() -> None:
    proc = grace_calc("--step-time", "1s", "--save-time", "1s", "--partition", "no-such-partition")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "HINT: check the partition name" in proc.stderr


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_check_real_scripts_with_the_cluster(name: str) -> None:
    code, text = EXPECTED[name]
    sizing = EXAMPLE_SIZING if name.startswith("examples/") else TINY_SIZING
    proc = grace_calc("check", str(SBATCH / name), *sizing)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert text in (proc.stdout if code < 2 else proc.stderr)
    if code < 2:
        kill_wait = int(raw_value(slurm.run(["scontrol", "show", "config"]), "KillWait"))
        assert f"SIGKILL {kill_wait} s later (KillWait, scontrol show config)" in proc.stdout


def submit_held(script: Path, *extra: str) -> str:
    return slurm.submit(script, ["--hold", *extra])


def test_check_job_reads_the_submitted_script_and_limit(jobs: list[str]) -> None:
    good = submit_held(SBATCH / "train-tiny.sbatch")
    jobs.append(good)
    proc = grace_calc("check", "--job", good, *TINY_SIZING)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"check job {good}: ENOUGH" in proc.stdout and "PENDING" in proc.stdout

    bad = submit_held(SBATCH / "examples/bad-bare-python.sbatch")
    jobs.append(bad)
    proc = grace_calc("check", "--job", bad, *EXAMPLE_SIZING)
    assert proc.returncode == 1 and "SIGTERM never reaches Python" in proc.stdout

    # The job's real limit (sbatch --time=1 on the command line) beats the script's 30 minutes.
    short = submit_held(SBATCH / "train-tiny.sbatch", "--time=1")
    jobs.append(short)
    proc = grace_calc("check", "--job", short, *TINY_SIZING)
    assert proc.returncode == 1 and "--signal lead 60 s >= --time 60 s" in proc.stdout


def test_check_of_a_missing_job_is_an_error() -> None:
    proc = grace_calc("check", "--job", "999999999", *TINY_SIZING)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1


def wait_for_markers(markers: dict[str, Path]) -> None:
    """Wait until every job wrote its marker; DELIVERY_TIMEOUT_S counts from each job's start, so a busy
    cluster (jobs PENDING for QUEUE_TIMEOUT_S) skips the test, or fails it under CI."""
    submitted = time.monotonic()
    started: dict[str, float] = {}
    while not all(marker.exists() for marker in markers.values()):
        now = time.monotonic()
        for job_id, marker in markers.items():
            state = slurm.show_job(job_id).get("JobState", "")
            if state != "PENDING":
                started.setdefault(job_id, now)
            if marker.exists():
                continue
            if state == "PENDING" and now - submitted > QUEUE_TIMEOUT_S:
                message = f"job {job_id} still PENDING after {QUEUE_TIMEOUT_S} s: the cluster is busy"
                if os.environ.get("CI"):
                    pytest.fail(message)
                pytest.skip(message)
            assert state in NOT_ENDED or marker.exists(), (
                f"job {job_id} ended ({state}) without {marker.name}")
            ran_s = now - started.get(job_id, now)
            assert ran_s < DELIVERY_TIMEOUT_S, f"job {job_id} never wrote {marker.name}"
        time.sleep(1)


WAITER = """import signal, sys, time
def got(*_):
    open(sys.argv[1], "a").write("got TERM\\n"); sys.exit(0)
signal.signal(signal.SIGTERM, got)
time.sleep(120)
"""


def test_signal_delivery_rules(tmp_path: Path, jobs: list[str]) -> None:
    """Without B: the srun step gets --signal and a python run by the batch shell does not; with B: the batch
    shell gets it and the srun step does not. This is what `check` fails scripts for."""
    waiter = tmp_path / "waiter.py"
    waiter.write_text(WAITER)
    py = sys.executable
    steps = tmp_path / "steps.sbatch"
    steps.write_text(f"""#!/bin/bash
#SBATCH --signal=TERM@60
#SBATCH --time=2
#SBATCH --output={tmp_path}/steps.out
{py} {waiter} {tmp_path}/steps-batch-child &
child=$!
srun {py} {waiter} {tmp_path}/steps-step
sleep 1
kill -0 $child && echo alive > {tmp_path}/steps-batch-child-alive
kill -KILL $child
echo done > {tmp_path}/steps-done
""")
    batch = tmp_path / "batch.sbatch"
    batch.write_text(f"""#!/bin/bash
#SBATCH --signal=B:TERM@60
#SBATCH --time=2
#SBATCH --output={tmp_path}/batch.out
trap 'echo got TERM > {tmp_path}/batch-shell' TERM
srun {py} {waiter} {tmp_path}/batch-step &
wait
sleep 1
[ -e {tmp_path}/batch-step ] || echo silent > {tmp_path}/batch-step-silent
echo done > {tmp_path}/batch-done
kill -TERM %1  # srun forwards it: the step ends cleanly (its marker now comes after the check above)
wait
""")
    markers = {slurm.submit(steps): tmp_path / "steps-done", slurm.submit(batch): tmp_path / "batch-done"}
    jobs.extend(markers)
    wait_for_markers(markers)
    # No B: the step got it, the python started by the batch shell did not.
    assert (tmp_path / "steps-step").read_text() == "got TERM\n"
    assert not (tmp_path / "steps-batch-child").exists() and (tmp_path / "steps-batch-child-alive").exists()
    # B: the batch shell got it, the srun step did not.
    assert (tmp_path / "batch-shell").read_text() == "got TERM\n"
    assert (tmp_path / "batch-step-silent").exists()
