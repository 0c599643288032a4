"""after_step: the facts it gathers (stop record of this job and restart only, the job's state through the
gateway, the progress file) and that it calls scontrol requeue only when the policy says so. The Slurm gateway
is swapped for a fake at its one boundary here; tests/test_launch_slurm.py runs the same path on the real
cluster."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from slurm_jit import slurm
from slurm_jit.launch import after_step, progress
from slurm_jit.train import stop_record

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
