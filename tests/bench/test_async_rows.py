"""The arithmetic of the async-save rows of tools/bench (bench/async_saves.py) on exact timelines: what a SIGKILL at
an instant loses, the seeded instants, the blocked-time ratio from timing logs. The runs themselves are the smoke
run's (test_bench.py); their numbers are reported, never asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_jit import timing
from slurm_jit.bench import async_saves
from slurm_jit.bench.async_saves import Settings, Watched, kill_offsets, steps_lost


def test_steps_lost_counts_from_the_newest_checkpoint_complete_by_then() -> None:
    step_ends = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # step n ends at n s
    complete_at = {2: 2.5, 4: 6.5}  # step 2's checkpoint committed at 2.5 s; step 4's only after step 6 ended
    instants = [0.5, 1.0, 2.4, 2.5, 4.9, 6.0, 6.5, 7.0]
    assert steps_lost(step_ends, complete_at, instants) == [0, 1, 2, 0, 2, 4, 2, 2]


def test_a_commit_out_of_order_never_lowers_the_newest_step() -> None:
    # step 6's async commit lands before step 3's (another writer): the resume takes the newest complete, 6
    assert steps_lost([1.0 * n for n in range(1, 9)], {6: 6.5, 3: 7.0}, [7.5]) == [1]


def test_the_kill_instants_are_seeded_and_span_the_window() -> None:
    offsets = kill_offsets(10.0)
    assert offsets == kill_offsets(10.0) and len(offsets) == async_saves.KILL_INSTANTS
    assert 0.0 <= min(offsets) < 0.5 and 9.5 < max(offsets) <= 10.0
    assert Settings(save_steps=30, wall_s=1.0).async_save_steps == 3
    assert Settings(save_steps=5, wall_s=1.0).async_save_steps == 1


def _log(out: Path, event: str, per_rank: dict[int, list[float]]) -> None:
    for rank, durations in per_rank.items():
        log = timing.TimingLog(out, rank=rank, world_size=2, run_id="r")
        for i, dur_s in enumerate(durations, start=1):
            if event == "save":
                log.save(10 * i, "periodic", dur_s, 1000)
            else:
                log.save_blocked(i, "periodic", dur_s, 4096, {"stage": dur_s})
        log.close()


def test_the_blocked_ratio_is_the_mean_of_each_saves_slowest_rank(tmp_path: Path) -> None:
    sync, background = Watched(out=tmp_path / "sync"), Watched(out=tmp_path / "async")
    _log(sync.out, "save", {0: [2.0, 4.0], 1: [3.0, 1.0]})  # slowest ranks 3 and 4: mean 3.5
    _log(background.out, "save_blocked", {0: [0.1, 0.5, 0.2], 1: [0.3, 0.2, 0.1]})  # 0.3, 0.5, 0.2: mean 1/3
    row = async_saves.blocked_row(sync, background, Settings(save_steps=30, wall_s=1.0))
    assert row.value == pytest.approx(round((1 / 3) / 3.5, 4)) and row.met is True and row.target == "<= 0.1"
    assert row.details["async_saves"] == 3 and row.details["sync_saves"] == 2
    with pytest.raises(RuntimeError, match="saves synchronously"):  # an async run that staged nothing
        async_saves.blocked_row(sync, Watched(out=sync.out), Settings(save_steps=30, wall_s=1.0))


def test_step_time_lost_is_the_interval_holding_a_save_less_the_calm_median() -> None:
    """Steps of 1 s; the saves of steps 3 and 6 make steps 4 and 7 take 1.5 s and 2.5 s: 1 s lost on average."""
    durations = [1.0, 1.0, 1.0, 1.5, 1.0, 1.0, 2.5, 1.0, 1.0, 1.0]  # step n's duration at index n - 1
    step_ends = [sum(durations[:n]) for n in range(1, len(durations) + 1)]
    lost, calm = async_saves.step_time_lost(step_ends, [3, 6])
    assert calm == pytest.approx(1.0) and lost == pytest.approx(1.0)
    assert async_saves.step_time_lost(step_ends, [3, 6], calm_s=0.5) == (pytest.approx(1.5), 0.5)  # another's
    with pytest.raises(RuntimeError, match="too short"):
        async_saves.step_time_lost(step_ends[:2], [1])
