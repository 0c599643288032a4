"""The floor rows of tools/bench (issue #34) from exact numbers: the save over the best write-floor trial, the disk's
save over its median, the resume's load over the best read-floor trial, with the verdict against 1.25 and the
save's phases above the floor. The runs behind them are tools/bench's (test_bench.py), never timed here."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_jit import timing
from slurm_jit.bench import floors, resume, runs
from slurm_jit.bench.rows import NO_TARGET
from slurm_jit.bench.save import JitSave, disk_floor_row, write_floor_row

PHASES = {"begin": 0.01, "write": 0.25, "callbacks": 0.0, "fsync": 0.02, "barrier": 0.01, "manifest": 0.04,
          "rotate": 0.01}


def _save(tmp_path: Path, save_s: float, *, first_step_at: float | None = 110.0) -> JitSave:
    outcome = runs.Outcome(out=tmp_path, codes=[0, 0], started=100.0, first_step_at=first_step_at)
    files = {"global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt": 400, "rng_state_0.pth": 10,
             "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt": 400, "rng_state_1.pth": 10,
             "trainer_state.json": 5}
    return JitSave(outcome=outcome, ckpt=tmp_path / "checkpoint-4", save_s=save_s, phases=PHASES,
                   total_bytes=825, needed_bytes=825, files=files, world_size=2)


def test_the_save_is_held_to_the_best_write_floor_trial(tmp_path: Path) -> None:
    row = write_floor_row("save_over_write_floor_zero2", _save(tmp_path, 0.34), [0.25, 0.21, 0.30], "ZeRO-2")
    assert row.value == pytest.approx(round(0.34 / 0.21, 4)) and row.target == floors.FLOOR_TARGET
    assert row.met is False  # 1.62 > 1.25
    assert row.details["floor_s"] == 0.21 and row.details["bytes_per_rank"] == [415, 410]
    assert row.details["above_floor_s"]["write"] == pytest.approx(0.04)
    assert row.details["phases_s"] == PHASES
    at_target = write_floor_row("save_over_write_floor_zero3", _save(tmp_path, 0.25), [0.2], "ZeRO-3")
    assert at_target.value == 1.25 and at_target.met is True


def test_the_disk_save_is_reported_beside_the_floors_median(tmp_path: Path) -> None:
    row = disk_floor_row(_save(tmp_path, 2.0), [6.61, 0.46, 2.08, 0.50, 1.0], tmp_path)
    assert row.value == 2.0 and row.target == NO_TARGET and row.met is None
    assert row.details["floor"] == {"min_s": 0.46, "median_s": 1.0, "max_s": 6.61}


def _resumed(first_step_at: float, train_starts: list[float]) -> resume.Resumed:
    outcome = runs.Outcome(out=Path("."), codes=[0, 0], started=200.0, first_step_at=first_step_at)
    first_step_s: list[float | None] = [0.7, 0.5]  # the fresh run's first step, the resume's
    return resume.Resumed(outcome=outcome, resume_s=first_step_at - 200.0, fresh_s=10.0, train_starts=train_starts,
                          first_step_s=first_step_s[:len(train_starts)])


def test_the_load_is_the_resumes_train_to_first_step_less_the_fresh_runs(tmp_path: Path) -> None:
    save = _save(tmp_path, 0.3)  # the fresh run: train() at 105, its first step ended at 110 (5 s)
    resumed = _resumed(212.5, [105.0, 206.0])  # the resume: train() at 206, first step at 212.5 (6.5 s)
    assert resumed.load_s(save.outcome) == pytest.approx(1.5)
    row = resume.read_floor_row(save, resumed, [1.3, 1.25, 1.4])
    assert row.value == pytest.approx(1.2) and row.met is True
    assert row.details["load_s"] == 1.5 and row.details["floor_s"] == 1.25
    assert resume.read_floor_row(save, _resumed(212.5, [105.0, 205.0]), [1.25]).met is False  # 2.5 s: 2x


def test_a_resume_without_a_load_to_measure_is_not_judged(tmp_path: Path) -> None:
    save = _save(tmp_path, 0.3)
    faster = resume.read_floor_row(save, _resumed(210.0, [105.0, 206.0]), [0.1])  # 4 s: sooner than the fresh 5 s
    assert faster.met is None and faster.note.startswith("skipped:") and "lost in the noise" in faster.note
    assert faster.details["load_s"] == -1.0 and faster.details["fresh_first_step_s"] == 0.7  # what was measured
    one_start = resume.read_floor_row(save, _resumed(212.5, [206.0]), [0.1])
    assert one_start.met is None and "1 start record(s)" in one_start.note
    broken = resume.read_floor_row(save, "resume ended [1, 0]", [0.1])
    assert broken.value is None and broken.note == "not measured: resume ended [1, 0]"


def test_each_train_start_is_read_with_its_first_steps_time(tmp_path: Path) -> None:
    for durations in ([0.7, 0.6], [], [0.5]):  # a fresh run, a run that logged no step, a resume
        log = timing.TimingLog(tmp_path, rank=0, world_size=2, run_id="r")
        for step, dur_s in enumerate(durations, start=1):
            log.step(step, dur_s)
        log.close()
        timing.TimingLog(tmp_path, rank=1, world_size=2, run_id="r").close()  # rank 1's start: not rank 0's
    starts = resume._train_starts(tmp_path)
    assert [s for _, s in starts] == [0.7, None, 0.5]
    assert [t for t, _ in starts] == sorted(t for t, _ in starts)
