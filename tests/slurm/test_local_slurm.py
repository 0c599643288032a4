"""tools/local-slurm and the real cluster it runs, driven through the slurm_jit.slurm gateway.

Started here when missing (``up`` is idempotent). With ``CI`` set, a cluster that cannot come up fails the
tests instead of skipping them. 45-75 s on 2 cores, most of it waiting for the preemption requeue.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_jit import local_ranks, slurm

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
LOCAL_SLURM = ROOT / "tools" / "local-slurm"
UP_TIMEOUT_S = 300  # a fresh CI machine apt-installs slurm-wlm and munge first; then up waits <= 60 s
POLL_S = 0.5
# Facts tools/local-slurm writes into slurm.conf; the tests read them back through the gateway.
KILL_WAIT_S = 30
MIN_JOB_AGE_S = 300
GRACE_TIME_S = 20  # partition debug
# On an idle node a job starts within ~2 s; on a shared one it may wait for other jobs' cores.
START_TIMEOUT_S = 240
# The preemptor is placed within ~2 s; the victim's job steps get SIGTERM then, at the start of GraceTime.
SIGTERM_TIMEOUT_S = GRACE_TIME_S / 2
# slurmctld requeues a preempted job on its first periodic pass (every 30 s, fixed in Slurm 22.05) after
# GraceTime. A requeued job is eligible again ~11 s later (AuthInfo=cred_expire=10), then waits for cores.
PERIODIC_PASS_S = 30
REQUEUE_TIMEOUT_S = GRACE_TIME_S + PERIODIC_PASS_S + 10
RERUN_TIMEOUT_S = 15 + START_TIMEOUT_S
# The first line of every slurm.conf tools/local-slurm writes.
MARKER = "# slurm-jit local cluster: written by tools/local-slurm; remove this line to keep local edits"
DAEMON_EXIT_S = 5  # `down` waits up to 10 s per daemon, then SIGKILLs it; init reaps it within moments
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


def local_slurm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LOCAL_SLURM), *args], capture_output=True, text=True, timeout=UP_TIMEOUT_S,
                          check=False, env=env)


@pytest.fixture(scope="module", autouse=True)
def cluster(slurm_cluster: None) -> None:
    """Every test here needs the cluster up."""


def wait_job(job_id: str, done: Callable[[dict[str, str]], bool], timeout_s: float) -> dict[str, str]:
    """Poll ``scontrol show job`` until ``done(job)``; returns the job."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = slurm.show_job(job_id)
        if done(job):
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {job['JobState']} (Reason={job.get('Reason')}) "
                                 f"after {timeout_s:.0f} s")
        time.sleep(POLL_S)


def finished(job: dict[str, str]) -> bool:
    return job["JobState"] in FINISHED


def wait_line(path: Path, line: str, timeout_s: float) -> list[str]:
    """Poll a file written by a job until it has ``line``; returns all its lines."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if line in lines:
            return lines
        if time.monotonic() > deadline:
            raise AssertionError(f"{line!r} not in {path} after {timeout_s:.0f} s: {lines}")
        time.sleep(POLL_S / 5)


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body)
    return path


def test_status_exits_0_and_shows_both_partitions() -> None:
    proc = local_slurm("status")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sinfo = [line for line in proc.stdout.splitlines() if line.startswith("sinfo:")]
    assert len(sinfo) == 1 and "debug*" in sinfo[0] and "urgent" in sinfo[0], proc.stdout


def test_up_again_is_a_no_op() -> None:
    proc = local_slurm("up")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("local-slurm: already up;"), proc.stdout
    assert proc.stderr == ""


def test_foreign_config_is_left_alone_and_reported(tmp_path: Path) -> None:
    foreign = tmp_path / "slurm.conf"
    port = local_ranks.free_port()  # nothing listens there: no cluster answers
    text = (f"ClusterName=theirs\nSlurmctldHost=localhost\nSlurmctldPort={port}\nNodeName=n1 CPUs=1\n"
            "PartitionName=p Nodes=n1\n")
    foreign.write_text(text)
    env = {**os.environ, "SLURM_CONF": str(foreign)}

    up = local_slurm("up", env=env)
    status = local_slurm("status", env=env)

    assert up.returncode == 1 and up.stdout == ""
    assert up.stderr.count("\n") == 1 and "not written by local-slurm" in up.stderr and "HINT:" in up.stderr
    assert foreign.read_text() == text
    assert status.returncode == 1 and "HINT: run" in status.stdout


def test_nodes_other_than_1_or_2_are_refused_in_one_line() -> None:
    proc = local_slurm("up", "--nodes", "3")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "1 or 2 nodes" in proc.stderr and "HINT:" in proc.stderr


def test_the_other_local_clusters_config_is_refused_and_left_alone(tmp_path: Path) -> None:
    """SLURM_CONF left pointing at the two-node cluster's config: the single-node commands must neither rewrite
    it nor act on one cluster's daemons with the other's config."""
    conf = tmp_path / "slurm-2nodes.conf"
    text = f"{MARKER}\nClusterName=slurm-jit-2nodes\nSlurmctldPort=6999\n"
    conf.write_text(text)
    # its own (empty) state dir too, so that nothing here can touch the running cluster's daemons
    env = {**os.environ, "SLURM_CONF": str(conf), "SLURM_JIT_LOCAL_STATE": str(tmp_path / "state")}

    for command in ("up", "status", "down"):
        proc = local_slurm(command, env=env)
        assert proc.returncode == 1 and proc.stdout == "", (command, proc.stdout)
        assert proc.stderr.count("\n") == 1 and "holds the local cluster slurm-jit-2nodes, not slurm-jit-local" \
            in proc.stderr and "HINT: unset SLURM_CONF" in proc.stderr, (command, proc.stderr)
    assert conf.read_text() == text


def test_cluster_facts_match_what_local_slurm_wrote() -> None:
    config = slurm.show_config()
    debug = slurm.show_partition("debug")
    urgent = slurm.show_partition("urgent")

    assert slurm.seconds(config["KillWait"]) == KILL_WAIT_S
    assert slurm.seconds(config["MinJobAge"]) == MIN_JOB_AGE_S
    assert (config["JobRequeue"], config["PreemptType"]) == ("1", "preempt/partition_prio")
    assert slurm.seconds(debug["GraceTime"]) == GRACE_TIME_S
    assert debug["PreemptMode"] == "REQUEUE" and urgent["PreemptMode"] == "OFF"
    assert int(urgent["PriorityTier"]) > int(debug["PriorityTier"])
    assert slurm.default_partition() == "debug"


@pytest.mark.parametrize(("exit_code", "state"), [(0, "COMPLETED"), (3, "FAILED")])
def test_batch_job_runs_writes_its_file_and_reports_exit_code(
    tmp_path: Path, jobs: list[str], exit_code: int, state: str
) -> None:
    out = tmp_path / "out.txt"
    script = write_script(tmp_path / "job.sh", f'echo "job $SLURM_JOB_ID in $SLURM_JOB_PARTITION" > {out}\n'
                                               f"exit {exit_code}\n")

    job_id = slurm.submit(script, ["--job-name=local-slurm-test", f"--output={tmp_path}/slurm-%j.out",
                                   "--time=1"])
    jobs.append(job_id)
    job = wait_job(job_id, finished, START_TIMEOUT_S)

    assert job["JobState"] == state
    assert job["ExitCode"] == f"{exit_code}:0"
    assert out.read_text() == f"job {job_id} in debug\n"


def start_victim(tmp_path: Path, jobs: list[str], after_step: str) -> tuple[str, Path]:
    """A debug-partition job whose srun step logs SIGTERM and exits; the batch shell then runs ``after_step``.

    Waits until the step runs. Preemption signals job steps, not the batch shell (Slurm 22.05), so the work
    runs under srun, as a trainer would.
    """
    log = tmp_path / "victim.log"
    victim = write_script(tmp_path / "victim.sh", (
        f'echo "start restarts=${{SLURM_RESTART_COUNT:-0}}" >> {log}\n'
        f"srun --ntasks=1 bash -c 'trap \"echo SIGTERM >> {log}; exit 0\" TERM\n"
        f"  echo step-ready >> {log}; while :; do sleep 0.1; done'\n"
        f"echo step-done >> {log}\n"
        f"{after_step}\n"))
    job_id = slurm.submit(victim, ["--ntasks=1", f"--output={tmp_path}/victim-%j.out"])
    jobs.append(job_id)
    wait_line(log, "step-ready", START_TIMEOUT_S)
    return job_id, log


def preempt_all_cpus(tmp_path: Path, jobs: list[str]) -> str:
    """Submit a 1 s job to the urgent partition that needs every CPU of the node."""
    script = write_script(tmp_path / "preemptor.sh", "sleep 1\n")
    all_cpus = slurm.show_partition("urgent")["TotalCPUs"]
    job_id = slurm.submit(script, ["--partition=urgent", f"--ntasks={all_cpus}", "--time=1",
                                   f"--output={tmp_path}/preemptor-%j.out"])
    jobs.append(job_id)
    return job_id


def test_urgent_job_preempts_debug_job_which_gets_sigterm_and_is_requeued(
    tmp_path: Path, jobs: list[str]
) -> None:
    victim_id, log = start_victim(tmp_path, jobs, after_step="sleep 600")  # only the requeue ends the job
    preemptor_id = preempt_all_cpus(tmp_path, jobs)

    # SIGTERM at the start of GraceTime, well before the requeue kills the job.
    wait_line(log, "SIGTERM", SIGTERM_TIMEOUT_S)
    assert slurm.show_job(victim_id)["Restarts"] == "0"
    requeued = wait_job(victim_id, lambda job: job["Restarts"] != "0", REQUEUE_TIMEOUT_S)
    assert requeued["Restarts"] == "1"
    assert requeued["JobState"] in {"COMPLETING", "PENDING", "REQUEUED"}
    assert requeued["Requeue"] == "1"
    # The requeued job runs again once the preemptor is done, and knows it is a restart.
    assert wait_job(preemptor_id, finished, RERUN_TIMEOUT_S)["JobState"] == "COMPLETED"
    lines = wait_line(log, "start restarts=1", RERUN_TIMEOUT_S)
    assert lines[:4] == ["start restarts=0", "step-ready", "SIGTERM", "step-done"]


def test_preempted_job_that_exits_during_grace_time_completes_and_is_not_requeued(
    tmp_path: Path, jobs: list[str]
) -> None:
    # What a trainer does on SIGTERM: save, exit 0. Slurm 22.05 then ends the job, it does not requeue it.
    victim_id, log = start_victim(tmp_path, jobs, after_step="exit 0")
    preempt_all_cpus(tmp_path, jobs)

    job = wait_job(victim_id, finished, SIGTERM_TIMEOUT_S)

    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0")
    assert log.read_text().splitlines() == ["start restarts=0", "step-ready", "SIGTERM", "step-done"]


# Keep this test last in the file: it stops the cluster (and starts it again) under every other test's feet.
def test_down_stops_the_daemons_keeps_job_state_and_up_restarts(tmp_path: Path, jobs: list[str]) -> None:
    """README: `down` stops only what `up` started and keeps the job state, like a cluster restart."""
    # A pending job outlives the restart (this test shows it), so only another session's running jobs keep the
    # cluster up. Under CI tests run alone: what is there is left in the machine's Slurm state by an earlier run
    # (a fresh-ish CI machine kept a held job of a run it was imaged during), and `down` leaves job steps running.
    queued = [line.split() for line in slurm.run(["squeue", "-h", "-o", "%i %T %r"]).splitlines() if line.strip()]
    running = [job_id for job_id, state, _ in queued if state != "PENDING"]
    if running and not os.environ.get("CI"):
        pytest.skip(f"jobs {running} are running: not stopping a cluster others use")
    held_before = [job_id for job_id, state, reason in queued if state == "PENDING" and reason.startswith("JobHeld")]
    held = slurm.submit(write_script(tmp_path / "held.sh", "true\n"), ["--hold", f"--output={tmp_path}/held.out"])
    jobs.append(held)
    before = local_slurm("status")
    assert before.returncode == 0, before.stdout + before.stderr
    pids = [int(line.split("pid ")[1].split(",")[0]) for line in before.stdout.splitlines() if "started by" in line]
    assert pids, before.stdout  # slurmctld and slurmd, at least, were started by local-slurm
    try:
        down = local_slurm("down")
        assert down.returncode == 0 and down.stdout.startswith("local-slurm: stopped "), down
        assert "slurmctld" in down.stdout and "slurmd" in down.stdout and "job state kept" in down.stdout
        deadline = time.monotonic() + DAEMON_EXIT_S  # a SIGKILLed daemon lingers until init reaps it
        while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
            time.sleep(POLL_S / 5)
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids), pids
        status = local_slurm("status")
        assert status.returncode == 1 and "not answering" in status.stdout and "HINT: run" in status.stdout
        assert not slurm.available()
        again = local_slurm("down")
        assert again.returncode == 0 and "nothing to stop" in again.stdout, again
    finally:
        up = local_slurm("up")
    assert up.returncode == 0 and slurm.available(), up.stdout + up.stderr
    assert slurm.show_job(held)["JobState"] == "PENDING"  # the job state survived the restart
    assert all(slurm.show_job(job_id)["JobState"] == "PENDING" for job_id in held_before)  # and so did theirs
