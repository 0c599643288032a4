"""The Slurm gateway (slurm_jit.slurm): argv in, stdout out, through one swappable ``runner``.

Unit tests fake the runner; the tests marked ``slurm`` run the real commands on the local cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from slurm_jit import slurm

# `scontrol show job` of Slurm 22.05.8 for a finished batch job (local cluster, paths shortened).
SHOW_JOB = """\
JobId=17 JobName=hi.sh
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   Priority=4294901750 Nice=0 Account=(null) QOS=(null)
   JobState=COMPLETED Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   RunTime=00:00:02 TimeLimit=UNLIMITED TimeMin=N/A
   SubmitTime=2026-11-29T07:54:20 EligibleTime=2026-11-29T07:54:20
   AccrueTime=2026-11-29T07:54:20
   StartTime=2026-11-29T07:54:45 EndTime=2026-11-29T07:54:47 Deadline=N/A
   SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-29T07:54:45 Scheduler=Main
   Partition=urgent AllocNode:Sid=localhost:2825
   ReqNodeList=(null) ExcNodeList=(null)
   NodeList=vm
   BatchHost=vm
   NumNodes=1 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=2,node=1,billing=2
   Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=*
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
   Features=(null) DelayBoot=00:00:00
   OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null)
   Command=/tmp/pe/hi.sh
   WorkDir=/tmp/pe
   StdErr=/tmp/pe/hi-17.out
   StdIn=/dev/null
   StdOut=/tmp/pe/hi-17.out
   Power=
"""

# An excerpt of `scontrol show config` (22.05.8): `Key = Value`, values with spaces.
SHOW_CONFIG = """\
Configuration data as of 2026-11-29T07:56:27
AuthInfo                = cred_expire=10
KillWait                = 30 sec
MinJobAge               = 300 sec
PreemptType             = preempt/partition_prio
SlurmctldParameters     = (null)
"""


class FakeRunner:
    """Records each argv and answers with canned stdout, or raises ``error``."""

    def __init__(self, stdout: str = "", error: Exception | None = None) -> None:
        self.stdout = stdout
        self.error = error
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv: Sequence[str], timeout_s: float) -> str:
        self.calls.append((list(argv), timeout_s))
        if self.error:
            raise self.error
        return self.stdout


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeRunner:
    runner = FakeRunner()
    monkeypatch.setattr(slurm, "runner", runner)
    return runner


def test_run_passes_the_argv_list_and_timeout_to_the_runner(fake: FakeRunner) -> None:
    fake.stdout = "out\n"
    assert slurm.run(["squeue", "-h", "-j", "7"], timeout_s=5) == "out\n"
    assert fake.calls == [(["squeue", "-h", "-j", "7"], 5)]


@pytest.mark.parametrize("argv", [[], ["bash", "-c", "sbatch x"], ["/usr/bin/sbatch", "x"], "sbatch job.sh"])
def test_run_rejects_what_is_not_a_slurm_argv(fake: FakeRunner, argv: Sequence[str]) -> None:
    with pytest.raises(ValueError, match="not a Slurm command"):
        slurm.run(argv)
    assert fake.calls == []


def test_submit_builds_sbatch_argv_and_returns_the_job_id(fake: FakeRunner, tmp_path: Path) -> None:
    fake.stdout = "4242;cluster-a\n"  # --parsable on a multi-cluster setup
    job_id = slurm.submit(tmp_path / "job.sh", ["--partition=urgent", "--time=1"])
    assert job_id == "4242"
    script = str(tmp_path / "job.sh")
    assert fake.calls[0][0] == ["sbatch", "--parsable", "--partition=urgent", "--time=1", script]


@pytest.mark.parametrize(("signal_name", "argv"), [
    (None, ["scancel", "12"]),
    ("USR1", ["scancel", "--signal=USR1", "12"]),
])
def test_cancel_argv(fake: FakeRunner, signal_name: str | None, argv: list[str]) -> None:
    slurm.cancel("12", signal_name)
    assert fake.calls[0][0] == argv


def test_show_job_parses_real_scontrol_text(fake: FakeRunner) -> None:
    fake.stdout = SHOW_JOB
    job = slurm.show_job("17")
    assert fake.calls[0][0] == ["scontrol", "show", "job", "17"]
    assert job["JobId"] == "17" and job["JobName"] == "hi.sh"
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0")
    assert (job["Restarts"], job["Requeue"]) == ("0", "1")
    assert job["TimeLimit"] == "UNLIMITED" and job["Partition"] == "urgent"
    assert job["TRES"] == "cpu=2,node=1,billing=2"  # a value holding '=' stays whole
    assert job["CPUs/Task"] == "1" and job["ReqB:S:C:T"] == "0:0:*:*"
    assert job["AllocNode:Sid"] == "localhost:2825"
    assert job["Command"] == "/tmp/pe/hi.sh" and job["Power"] == ""
    assert "cpu" not in job and "node" not in job


def test_parse_key_values_keeps_the_first_of_repeated_keys() -> None:
    pairs = slurm.parse_key_values("JobId=1 NodeList=a\n JobId=2 NodeList=b")
    assert pairs == {"JobId": "1", "NodeList": "a"}


def test_show_config_splits_on_the_first_equals(fake: FakeRunner) -> None:
    fake.stdout = SHOW_CONFIG
    config = slurm.show_config()
    assert config["AuthInfo"] == "cred_expire=10"
    assert slurm.seconds(config["KillWait"]) == 30 and slurm.seconds(config["MinJobAge"]) == 300
    assert config["PreemptType"] == "preempt/partition_prio"


@pytest.mark.parametrize(("value", "expected"), [
    ("30 sec", 30),
    ("30", 30),
    ("00:05:00", 300),
    ("05:00", 300),
    ("1-00:00:00", 86_400),
    ("2-03:04:05", ((2 * 24 + 3) * 60 + 4) * 60 + 5),
    ("UNLIMITED", None),
    ("INFINITE", None),
    ("NONE", None),
    ("", None),
])
def test_seconds(value: str, expected: int | None) -> None:
    assert slurm.seconds(value) == expected


def test_available_asks_scontrol_ping(fake: FakeRunner) -> None:
    assert slurm.available() is True
    assert fake.calls == [(["scontrol", "ping"], 10)]
    fake.error = slurm.SlurmError("scontrol ping failed (exit 1): Slurmctld(primary) at vm is DOWN")
    assert slurm.available() is False


def test_missing_command_says_how_to_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # the real runner, with no Slurm on PATH
    with pytest.raises(slurm.SlurmError, match="sinfo not found on PATH. HINT: .*tools/local-slurm up"):
        slurm.run(["sinfo"])
    assert slurm.available() is False


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_available_with_the_local_cluster_up() -> None:
    assert slurm.available() is True


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_failed_command_raises_with_slurms_message() -> None:
    expected = r"scontrol show job 999999999 failed \(exit 1\): .*Invalid job id"
    with pytest.raises(slurm.SlurmError, match=expected):
        slurm.show_job("999999999")


def test_a_job_name_holding_key_value_text_does_not_hide_the_real_fields(fake: FakeRunner) -> None:
    """scontrol prints the name unescaped, first: ``x JobState=RUNNING`` read as a RUNNING job after scancel."""
    fake.stdout = SHOW_JOB.replace("JobName=hi.sh", "JobName=x JobState=RUNNING Restarts=9 RunTime=9:99")
    job = slurm.show_job("17")
    assert job["JobName"] == "x JobState=RUNNING Restarts=9 RunTime=9:99"
    assert (slurm.job_state(job), job["Restarts"], job["RunTime"]) == ("COMPLETED", "0", "00:00:02")


@pytest.mark.parametrize(("answer", "expected"), [
    ("JobId=5 JobName=a\n   JobState=PENDING Reason=BeginTime\n", "PENDING"),
    ("JobId=5 JobName=a\n   JobState=REQUEUED Reason=None\n", "REQUEUED"),
    ("JobId=5 JobName=a\n   JobState=CANCELLED Reason=None\n", None),
    ("JobId=5 JobName=a\n   JobState=COMPLETED Reason=None\n", None),
    (slurm.SlurmError("scontrol show job 5 failed (exit 1): slurm_load_jobs error: Invalid job id specified"), None),
])
def test_live_state_is_none_once_a_job_can_never_run_again(fake: FakeRunner, answer: str | Exception,
                                                           expected: str | None) -> None:
    if isinstance(answer, Exception):
        fake.error = answer
    else:
        fake.stdout = answer
    assert slurm.live_state("5") == expected


def test_live_state_says_so_when_slurmctld_does_not_answer(fake: FakeRunner) -> None:
    fake.error = slurm.SlurmError("scontrol show job 5 did not answer within 60 s")
    with pytest.raises(slurm.SlurmError, match="did not answer"):
        slurm.live_state("5")


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_a_cancelled_job_named_like_a_running_one_reads_cancelled(tmp_path: Path) -> None:
    """On the real cluster: a held job (it never takes a CPU) named ``x JobState=RUNNING``, cancelled."""
    job_id = slurm.run(["sbatch", "--parsable", "--hold", "--job-name=x JobState=RUNNING", "--time=1",
                        f"--output={tmp_path}/%j.out", "--wrap=true"]).strip()
    try:
        slurm.cancel(job_id)
        job = slurm.show_job(job_id)
        assert job["JobName"] == "x JobState=RUNNING"
        assert slurm.job_state(job) == "CANCELLED" and slurm.live_state(job_id) is None
    finally:
        slurm.cancel(job_id)


def test_paths_with_spaces_are_read_whole(fake: FakeRunner) -> None:
    fake.stdout = SHOW_JOB.replace("/tmp/pe", "/tmp/run 50%x")
    job = slurm.show_job("17")
    assert job["Command"] == "/tmp/run 50%x/hi.sh" and job["WorkDir"] == "/tmp/run 50%x"
    assert job["StdOut"] == "/tmp/run 50%x/hi-17.out" and job["Power"] == ""
