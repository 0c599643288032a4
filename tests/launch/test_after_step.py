"""after_step: the facts it gathers (stop record of this job and restart only, the job's state through the
gateway, the progress file) and that it calls scontrol requeue only when the policy says so. The Slurm gateway
is swapped for a fake at its one boundary here; tests/integration/test_launch_slurm.py runs the same path on the real
cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import ckpt_factory
import pytest

from slurm_jit import slurm
from slurm_jit.launch import after_step, progress
from slurm_jit.train import stop_record

ROOT = Path(__file__).resolve().parents[2]

SHOW_JOB = ("JobId=42 JobName=x\n   JobState={state} Reason=None Dependency=(null)\n   Requeue=1 Restarts={restarts} "
            "BatchFlag=1\n   RunTime=00:02:10 TimeLimit=00:03:00 TimeMin=N/A\n"
            "   PreemptEligibleTime=2026-01-01T00:00:00 "
            "PreemptTime={preempt}\n")


@pytest.fixture
def fake_slurm(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, object]]:
    cluster: dict[str, object] = {"state": "RUNNING", "preempt": "None", "calls": []}

    def runner(argv: Sequence[str], timeout_s: float) -> str:
        calls = cluster["calls"]
        assert isinstance(calls, list)
        calls.append(list(argv))
        if argv[:3] == ["scontrol", "show", "job"]:
            return SHOW_JOB.format(state=cluster["state"], restarts=0, preempt=cluster["preempt"])
        return ""

    monkeypatch.setattr(slurm, "runner", runner)
    yield cluster


def _record(out: Path, monkeypatch: pytest.MonkeyPatch, state: str, step: int, job_id: str = "42",
            restart: str | None = None) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", job_id)
    if restart is None:
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
    stop_record.write(out, state, step=step, checkpoint=str(out / f"checkpoint-{step}"))


def _run(out: Path, env: dict[str, str], *extra: str) -> int:
    return after_step.main([str(out), "--srun-exit", "0", "--max-requeues", "3", *extra], env=env)


def test_stale_record_of_another_job_is_a_crash_not_a_requeue(tmp_path: Path, fake_slurm: dict[str, object],
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _record(tmp_path, monkeypatch, "jit_stop", 10, job_id="41")  # an earlier job's record
    code = _run(tmp_path, {"SLURM_JOB_ID": "42"})
    line = capsys.readouterr().out
    assert "stopped by crash" in line and "from an earlier run" in line and code == 1
    assert ["scontrol", "requeue", "42"] not in fake_slurm["calls"]  # type: ignore[operator]


def test_record_of_the_previous_restart_is_not_trusted(tmp_path: Path, fake_slurm: dict[str, object],
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    _record(tmp_path, monkeypatch, "jit_stop", 10, restart=None)  # restart 0 wrote it; this is restart 1
    _run(tmp_path, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"})
    assert "stopped by crash" in capsys.readouterr().out


def test_cancelled_job_is_not_requeued_even_with_a_jit_stop(tmp_path: Path, fake_slurm: dict[str, object],
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _record(tmp_path, monkeypatch, "jit_stop", 10)
    fake_slurm["state"] = "CANCELLED"
    _run(tmp_path, {"SLURM_JOB_ID": "42"})
    assert "stopped by user cancel" in capsys.readouterr().out
    assert ["scontrol", "requeue", "42"] not in fake_slurm["calls"]  # type: ignore[operator]


def test_missing_job_id_is_one_line_with_a_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(tmp_path, {}) == after_step.EXIT_ERROR
    assert "HINT" in capsys.readouterr().err


def test_failure_retries_are_remembered_per_job(tmp_path: Path, fake_slurm: dict[str, object],
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _record(tmp_path, monkeypatch, "failed", 3)
    assert _run(tmp_path, {"SLURM_JOB_ID": "42"}, "--retry-on-failure", "1") == 0
    assert "failure retry 1 of 1" in capsys.readouterr().out
    assert ["scontrol", "requeue", "42"] in fake_slurm["calls"]  # type: ignore[operator]
    assert progress.failure_retries(progress.read(tmp_path), "42") == 1
    _record(tmp_path, monkeypatch, "failed", 3, restart="1")
    assert _run(tmp_path, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}, "--retry-on-failure", "1") == 1
    assert "(--retry-on-failure 1, 1 used)" in capsys.readouterr().out


@pytest.mark.parametrize(("line", "expected"), [
    ("OUT_DIR=out/run", "/home/u/proj/out/run"),
    ("OUT_DIR='/abs/a b$(x)'", "/abs/a b$(x)"),
    ('OUT_DIR="${OUT:?set OUT}"', None),
    ("echo no out dir", None),
])
def test_status_finds_the_output_directory_of_a_job(monkeypatch: pytest.MonkeyPatch, line: str,
                                                    expected: str | None) -> None:
    from slurm_jit.launch import status

    def runner(argv: Sequence[str], timeout_s: float) -> str:
        if argv[:2] == ["scontrol", "write"]:
            return f"#!/bin/bash\n#SBATCH --time=3\n{line}\n"
        return "JobId=42 JobState=RUNNING WorkDir=/home/u/proj\n"

    monkeypatch.setattr(slurm, "runner", runner)
    assert status.out_dir_of_job("42") == expected


def test_compare_says_equal_only_when_every_step_is_bitwise_equal(tmp_path: Path) -> None:
    from slurm_jit.launch import compare

    run, reference = tmp_path / "run", tmp_path / "reference"
    for d in (run, reference):
        d.mkdir()
    steps = [(1, 4.5), (2, 4.25), (3, 4.125)]
    (reference / "losses-rank0.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in steps))
    # the requeued run logged step 3 twice (its stop was after the last checkpoint): the last one counts
    logged = [*steps[:3], (3, 4.125)]
    (run / "losses-rank0.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in logged))
    same, lines = compare.compare(str(run), str(reference))
    assert same and lines[-1].startswith("equal") and "restarts after step(s) 3" in lines[0]
    (run / "losses-rank0.jsonl").write_text(json.dumps({"step": 1, "loss": 4.5000001}) + "\n")
    same, lines = compare.compare(str(run), str(reference))
    assert not same and lines[-1] == "DIFFERENT at 3 step(s), first 1"


# --- hostile cases: odd environment, broken files, a failing gateway, a scancel racing the requeue ---------


class ScriptedSlurm:
    """A gateway whose ``scontrol show job`` answers the given states one after another (the last repeats),
    or fails; ``scontrol requeue`` fails when told to. Records every argv."""

    def __init__(self, states: list[str], fail_show: str | None = None, fail_requeue: bool = False) -> None:
        self.states, self.fail_show, self.fail_requeue = list(states), fail_show, fail_requeue
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout_s: float) -> str:
        self.calls.append(list(argv))
        if argv[:3] == ["scontrol", "show", "job"]:
            if self.fail_show is not None:
                raise slurm.SlurmError(self.fail_show)
            state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
            return SHOW_JOB.format(state=state, restarts=0, preempt="None")
        if argv[:2] == ["scontrol", "requeue"] and self.fail_requeue:
            raise slurm.SlurmError("scontrol requeue 42 failed (exit 1): Job is not running")
        return ""

    @property
    def requeued(self) -> bool:
        return ["scontrol", "requeue", "42"] in self.calls


def _failure_retry(out: Path, monkeypatch: pytest.MonkeyPatch, gateway: ScriptedSlurm) -> int:
    """A run that failed, with one failure retry allowed: the policy says requeue (no checkpoint needed)."""
    monkeypatch.setattr(slurm, "runner", gateway)
    _record(out, monkeypatch, "failed", 3)
    return _run(out, {"SLURM_JOB_ID": "42"}, "--retry-on-failure", "1")


def test_a_scancel_between_the_policy_and_the_requeue_withdraws_the_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Slurm accepts ``scontrol requeue`` of a cancelled job: the state is read again right before it."""
    gateway = ScriptedSlurm(["RUNNING", "CANCELLED"])
    assert _failure_retry(tmp_path, monkeypatch, gateway) == 1
    assert not gateway.requeued
    assert "requeue withdrawn: the job is now CANCELLED; never requeued after a cancel" in capsys.readouterr().out


SIGTERM_DURING_AFTER_STEP = """\
import os, signal, sys
from slurm_jit import slurm
from slurm_jit.launch import after_step
calls = []
def runner(argv, timeout_s):
    calls.append(list(argv))
    if argv[:3] == ["scontrol", "show", "job"]:
        os.kill(os.getpid(), signal.SIGTERM)  # scancel reaches the batch shell while the helper runs
        return "JobId=42 JobState=RUNNING RunTime=00:01:00 TimeLimit=00:03:00 PreemptTime=None"
    return ""
slurm.runner = runner
code = after_step.main([sys.argv[1], "--srun-exit", "1", "--max-requeues", "3", "--retry-on-failure", "1"],
                       env={"SLURM_JOB_ID": "42"})
print("REQUEUED" if ["scontrol", "requeue", "42"] in calls else "NOT REQUEUED", code)
"""


def test_sigterm_to_the_helper_is_never_followed_by_a_requeue(tmp_path: Path) -> None:
    """A separate process: before the fix the SIGTERM killed the helper mid-decision, without a word."""
    proc = subprocess.run([sys.executable, "-c", SIGTERM_DURING_AFTER_STEP, str(tmp_path)], capture_output=True,
                          text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "requeue withdrawn: this helper got SIGTERM" in proc.stdout and "NOT REQUEUED 1" in proc.stdout


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "2x"])
def test_a_restart_count_that_is_not_a_count_is_one_line_and_no_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    gateway = ScriptedSlurm(["RUNNING"])
    monkeypatch.setattr(slurm, "runner", gateway)
    _record(tmp_path, monkeypatch, "failed", 3)
    code = _run(tmp_path, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": value}, "--retry-on-failure", "1")
    err = capsys.readouterr().err
    assert code == after_step.EXIT_ERROR and not gateway.requeued  # "abc" was taken for restart 0 before
    assert f"SLURM_RESTART_COUNT={value!r} is not a count" in err and "HINT" in err


def test_restart_count_unset_or_empty_is_the_first_run() -> None:
    assert after_step.restart_count_of({}) == after_step.restart_count_of({"SLURM_RESTART_COUNT": ""}) == 0
    assert after_step.restart_count_of({"SLURM_RESTART_COUNT": "3"}) == 3


def test_a_corrupted_progress_record_is_kept_aside_and_the_decision_still_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = b'{"job_id": "41", "last_step": 12, "hist'
    progress.path(tmp_path).parent.mkdir(parents=True)
    progress.path(tmp_path).write_bytes(broken)
    gateway = ScriptedSlurm(["RUNNING"])
    assert _failure_retry(tmp_path, monkeypatch, gateway) == 0
    captured = capsys.readouterr()
    kept = progress.path(tmp_path).with_name("launch-progress.json.unreadable")
    assert kept.read_bytes() == broken  # nothing saved is lost
    assert f"kept as {kept}" in captured.err and "HINT" in captured.err
    assert gateway.requeued and progress.read(tmp_path)["history"][-1]["requeue"] is True


def test_history_entries_that_are_not_objects_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    progress.write(tmp_path, {"job_id": "41", "last_step": None, "history": [1, "x", {"cause": "crash"}]})
    _failure_retry(tmp_path, monkeypatch, ScriptedSlurm(["RUNNING"]))
    history = progress.read(tmp_path)["history"]
    assert [h["cause"] for h in history] == ["crash", "crash"]


@pytest.mark.parametrize("failure", [
    "scontrol show job 42 failed (exit 1): Unable to contact slurm controller (connect failure)",
    "scontrol show job 42 did not answer within 60 s",  # the gateway's timeout
])
def test_a_failing_or_silent_controller_means_no_requeue_with_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], failure: str
) -> None:
    gateway = ScriptedSlurm(["RUNNING"], fail_show=failure)
    assert _failure_retry(tmp_path, monkeypatch, gateway) == 1
    captured = capsys.readouterr()
    assert not gateway.requeued and failure in captured.err and "HINT" in captured.err
    assert "policy: no requeue: no stop record" not in captured.out  # the record was there: it says so
    assert "policy: no requeue: the job is UNKNOWN, not running" in captured.out


def test_a_failed_requeue_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    gateway = ScriptedSlurm(["RUNNING"], fail_requeue=True)
    assert _failure_retry(tmp_path, monkeypatch, gateway) == 1
    out = capsys.readouterr().out
    assert "requeue failed: scontrol requeue 42 failed" in out and "HINT: requeue it by hand" in out


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "launch" / "submit.py"), "status", *args],
                          capture_output=True, text=True, check=False, timeout=60)


def test_status_of_garbage_is_one_line_with_a_hint(tmp_path: Path) -> None:
    for args in [(), ("a", "b")]:  # was argparse's usage and error, without a hint
        wrong = _status(*args)
        assert wrong.returncode == 2 and "HINT: status OUT_DIR or status JOBID" in wrong.stderr, wrong.stderr
    missing = _status(str(tmp_path / "no-such-dir"))  # was: "fresh start", as if it were empty
    assert missing.returncode == 2 and "no directory" in missing.stderr and "HINT" in missing.stderr
    progress.path(tmp_path).parent.mkdir(parents=True)
    progress.path(tmp_path).write_text('{"history": [1], "job_id": "x; rm"}')  # was: AttributeError traceback
    odd = _status(str(tmp_path))
    assert odd.returncode == 0 and "Traceback" not in odd.stderr, odd.stderr
    progress.path(tmp_path).write_text("{corrupt")  # was: silently "none recorded yet"
    corrupt = _status(str(tmp_path))
    assert corrupt.returncode == 0 and "launch-progress.json is unreadable" in corrupt.stdout, corrupt.stdout


def test_status_of_an_unknown_job_id_says_so(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``scontrol write batch_script`` of an unknown job exits 0 (Slurm 22.05): status asked it alone and said
    the script had no OUT_DIR line."""
    from slurm_jit.launch import status

    def runner(argv: Sequence[str], timeout_s: float) -> str:
        if argv[:3] == ["scontrol", "show", "job"]:
            raise slurm.SlurmError("scontrol show job 999999 failed (exit 1): Invalid job id specified")
        return ""

    monkeypatch.setattr(slurm, "runner", runner)
    assert status.status_main(["999999"]) == status.EXIT_ERROR
    err = capsys.readouterr().err
    assert "Invalid job id specified" in err and "HINT" in err


def test_a_jit_stop_whose_checkpoint_ckpt_check_calls_incomplete_is_not_requeued_and_nothing_is_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gateway = ScriptedSlurm(["RUNNING"])
    monkeypatch.setattr(slurm, "runner", gateway)
    checkpoint = tmp_path / "checkpoint-10"
    checkpoint.mkdir()
    (checkpoint / "checkpoint-is-incomplete.txt").write_text("x")  # the sentinel: the save never finished
    _record(tmp_path, monkeypatch, "jit_stop", 10)
    assert _run(tmp_path, {"SLURM_JOB_ID": "42"}) == 1
    assert "policy: no requeue: ckpt-check finds no resumable checkpoint" in capsys.readouterr().out
    assert not gateway.requeued
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-10"]


def _complete_checkpoint(out: Path, step: int) -> Path:
    """A whole 2-rank DeepSpeed checkpoint that ckpt-check calls complete (written by the protocol's own writers)."""
    return ckpt_factory.checkpoint(out, step, world=2, deepspeed=True)


def test_a_new_job_into_the_same_directory_is_not_held_to_an_older_jobs_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Job 41 stopped at step 285; the user started over (new checkpoints) as job 42, which JIT-stops at step
    100: before, 100 <= 285 read as "crash loop" and job 42 was never requeued."""
    gateway = ScriptedSlurm(["RUNNING"])
    monkeypatch.setattr(slurm, "runner", gateway)
    progress.write(tmp_path, {"job_id": "41", "last_step": 285, "failure_retries": {}, "history": []})
    _complete_checkpoint(tmp_path, 100)
    _record(tmp_path, monkeypatch, "jit_stop", 100)
    assert _run(tmp_path, {"SLURM_JOB_ID": "42"}) == 0
    assert "policy: requeue: JIT checkpoint complete; requeue 1 of 3" in capsys.readouterr().out
    assert gateway.requeued
    # The same job, restarted, stopping at the same step again: that is the crash loop.
    _record(tmp_path, monkeypatch, "jit_stop", 100, restart="1")
    assert _run(tmp_path, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}) == 1
    assert "crash loop: no progress since the last restart (step 100)" in capsys.readouterr().out


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (ENOSPC on every write)")
def test_a_progress_record_that_cannot_be_written_is_one_warning_then_the_decision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The record's temporary file is /dev/full: a real ENOSPC (as on a full disk, or EDQUOT over quota). Before,
    a traceback ended the helper before any decision: no requeue, no word why."""
    progress.write(tmp_path, {"job_id": "41", "last_step": 7, "failure_retries": {}, "history": []})
    before = progress.path(tmp_path).read_bytes()
    progress.path(tmp_path).with_suffix(".tmp").symlink_to("/dev/full")
    gateway = ScriptedSlurm(["RUNNING"])
    assert _failure_retry(tmp_path, monkeypatch, gateway) == 0
    captured = capsys.readouterr()
    assert gateway.requeued and "Traceback" not in captured.err
    (warning,) = captured.err.splitlines()
    assert "cannot write" in warning and "No space left on device" in warning and "HINT" in warning
    assert "policy: requeue: no stop record" not in captured.out and "failure retry 1 of 1" in captured.out
    assert progress.path(tmp_path).read_bytes() == before  # nothing saved is lost


@pytest.mark.parametrize(("gateway", "outcome"), [
    (ScriptedSlurm(["RUNNING", "CANCELLED"]), "requeue withdrawn: the job is now CANCELLED"),
    (ScriptedSlurm(["RUNNING"], fail_requeue=True), "requeue failed: scontrol requeue 42 failed"),
])
def test_a_requeue_that_did_not_happen_is_not_recorded_or_counted_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], gateway: ScriptedSlurm,
    outcome: str
) -> None:
    """Before, the record said "requeue": true and spent a failure retry for a requeue that was withdrawn (a
    scancel meanwhile) or that Slurm refused; status then said "requeued". Status runs in this process, under the
    same fake: a ``status`` subprocess read the real cluster, whose own job 42 may have been cancelled."""
    from slurm_jit.launch import status

    assert _failure_retry(tmp_path, monkeypatch, gateway) == 1
    saved = progress.read(tmp_path)
    last = saved["history"][-1]
    assert last["requeue"] is False and last["outcome"].startswith(outcome), last
    assert progress.failure_retries(saved, "42") == 0
    capsys.readouterr()
    assert status.status_main([str(tmp_path)]) == status.EXIT_OK
    said = capsys.readouterr().out
    assert f"job:      42 {gateway.states[-1]}, restarts 0" in said, said  # the fake's job, now
    assert "not requeued" not in said and outcome in said, said
