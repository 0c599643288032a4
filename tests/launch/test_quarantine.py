"""``--quarantine`` (in the gate, and in after_step) never renames a checkpoint while a live training holds the
output directory's ``output.lock``: that training may be writing it. The holder is a real process that took the
real lock (``slurm_jit.train.output_lock``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import ckpt_factory
import pytest

from slurm_jit import slurm
from slurm_jit.launch import after_step, gate
from slurm_jit.train import stop_record

HOLD = """\
import sys
from slurm_jit.train import output_lock
lock, why = output_lock.acquire(sys.argv[1])
print("held" if lock else why, flush=True)
sys.stdin.read()  # until the test closes it
output_lock.release(lock)
"""
HOLDER_START_S = 60


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A process holding ``tmp_path/out``'s output lock, as a training's rank 0 does, until the test ends."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "out")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=HOLDER_START_S)


def _being_written(out: Path) -> Path:
    """A complete checkpoint-5 and a checkpoint-10 still being saved (its sentinel is there)."""
    ckpt_factory.checkpoint(out, 5)
    saving = out / "checkpoint-10"
    saving.mkdir(parents=True)
    (saving / "checkpoint-is-incomplete.txt").write_text("saving")
    return saving


def _gate(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_jit.launch.gate", str(out), "--quarantine"],
                          capture_output=True, text=True, check=False, timeout=60)


def test_the_gate_does_not_quarantine_while_a_live_training_holds_the_lock(
        tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    out = tmp_path / "out"
    saving = _being_written(out)
    proc = _gate(out)
    assert proc.returncode == 0, proc.stderr
    assert saving.is_dir() and not (out / "checkpoint-10.incomplete").exists()
    assert f"resume from {out}/checkpoint-5" in proc.stdout and "not quarantined" in proc.stdout
    assert "in use by a process on host" in proc.stdout and f"pid {holder.pid}" in proc.stdout


def test_the_gate_refuses_instead_when_nothing_else_is_resumable(tmp_path: Path,
                                                                 holder: subprocess.Popen[str]) -> None:
    out = tmp_path / "out"
    saving = out / "checkpoint-10"
    saving.mkdir(parents=True)
    (saving / "checkpoint-is-incomplete.txt").write_text("saving")
    proc = _gate(out)
    assert proc.returncode == 1 and saving.is_dir(), proc
    assert "not quarantined" in proc.stderr and "HINT: wait for that training to end" in proc.stderr


def test_quarantine_goes_on_once_the_holder_has_ended(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _being_written(out)
    released = subprocess.run([sys.executable, "-c", HOLD, str(out)], input="", capture_output=True, text=True,
                              check=True, timeout=HOLDER_START_S)
    assert released.stdout.strip() == "held"
    proc = _gate(out)
    assert proc.returncode == 0 and "checkpoint-10 -> checkpoint-10.incomplete" in proc.stdout, proc
    assert gate.lock_holder(out) is None


def test_after_step_does_not_quarantine_while_a_live_training_holds_the_lock(
        tmp_path: Path, holder: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """after_step --quarantine of a job whose directory another live training holds (a second job on it)."""
    out = tmp_path / "out"
    saving = _being_written(out)

    def runner(argv: Sequence[str], timeout_s: float) -> str:
        return "JobId=42 JobName=x\n   JobState=RUNNING Reason=None\n   RunTime=00:01:00 TimeLimit=00:30:00\n"

    monkeypatch.setattr(slurm, "runner", runner)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    stop_record.write(out, "failed", step=3)
    after_step.main([str(out), "--srun-exit", "1", "--max-requeues", "3", "--quarantine"],
                    env={"SLURM_JOB_ID": "42"})
    assert saving.is_dir() and not (out / "checkpoint-10.incomplete").exists()
