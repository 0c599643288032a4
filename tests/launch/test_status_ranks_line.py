"""``python launch/submit.py status OUT_DIR`` shows the world size of each restart, from the real timing log the
JitTrainer's :class:`TimingLog` writes (rank 0's start records); no job recorded, so no Slurm call."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_jit import timing
from slurm_jit.launch import status


def _start(out: Path, monkeypatch: pytest.MonkeyPatch, job: str, restart: str, world_size: int) -> None:
    """One run's start, as the JitTrainer's ranks write it (every rank; status reads rank 0's). Slurm sets
    SLURM_RESTART_COUNT from the first restart on: a job's first run has none."""
    monkeypatch.setenv("SLURM_JOB_ID", job)
    if restart == "0":
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
    for rank in range(world_size):
        timing.TimingLog(out, rank=rank, world_size=world_size, run_id=f"{job}-{restart}").close()


def test_status_shows_the_world_size_of_each_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _start(tmp_path, monkeypatch, "7", "0", 2)
    _start(tmp_path, monkeypatch, "7", "1", 1)
    _start(tmp_path, monkeypatch, "9", "0", 2)
    assert "ranks:    job 7: restart 0 on 2 ranks, restart 1 on 1 rank; job 9: restart 0 on 2 ranks" \
        in status.report(str(tmp_path), None)


def test_status_shows_the_accumulation_the_trainer_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _start(tmp_path, monkeypatch, "7", "0", 2)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    log = timing.TimingLog(tmp_path, rank=0, world_size=1, run_id="7-1")
    log.kept_batch({"from_world_size": 2, "to_world_size": 1, "accumulation_from": 2, "accumulation_to": 4,
                    "samples_per_step": 8})  # as train/keep_batch.py records it
    log.close()
    assert "ranks:    job 7: restart 0 on 2 ranks, restart 1 on 1 rank (accumulation 2 -> 4)" \
        in status.report(str(tmp_path), None)


def test_a_long_chain_shows_its_newest_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for restart in range(status.MAX_RUNS_SHOWN + 2):
        _start(tmp_path, monkeypatch, "7", str(restart), 1)
    line = next(line for line in status.report(str(tmp_path), None) if line.startswith("ranks:"))
    assert line.startswith("ranks:    2 older run(s); job 7: restart 2 on 1 rank,") and "restart 1 " not in line


def test_a_run_outside_slurm_is_counted_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    timing.TimingLog(tmp_path, rank=0, world_size=2, run_id="a").close()
    assert "ranks:    outside Slurm: run 1 on 2 ranks" in status.report(str(tmp_path), None)


def test_no_timing_log_no_ranks_line(tmp_path: Path) -> None:
    assert not [line for line in status.report(str(tmp_path), None) if line.startswith("ranks:")]
