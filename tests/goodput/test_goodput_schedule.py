"""The fault schedule: drawn from the seed, the same for every system, refused in one line when it cannot run."""

from __future__ import annotations

import json

import pytest

from slurm_jit.goodput.schedule import FULL, QUICK, Schedule, ScheduleError, make_schedule


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    assert make_schedule(3) == make_schedule(3)
    drawn = {(s.kill_at_step, s.hang_at_step, s.kill_rank, s.hang_rank) for s in map(make_schedule, range(20))}
    assert len(drawn) > 10


@pytest.mark.parametrize("quick", [False, True])
def test_the_faults_land_inside_their_spans_of_the_training(quick: bool) -> None:
    for seed in range(50):
        s = make_schedule(seed, quick=quick)
        work = (QUICK if quick else FULL)["work_steps"]
        assert s.work_steps == work
        assert 0.2 * work <= s.kill_at_step <= 0.4 * work < 0.55 * work <= s.hang_at_step <= 0.75 * work
        assert {s.kill_rank, s.hang_rank} <= {0, 1}


def test_a_kill_step_given_replaces_the_drawn_one_and_keeps_the_rest() -> None:
    drawn, given = make_schedule(5), make_schedule(5, kill_at_step=777)
    assert given.kill_at_step == 777 and given.hang_at_step == drawn.hang_at_step
    assert given.faults() == {"kill": {"step": 777, "rank": drawn.kill_rank},
                              "hang": {"step": drawn.hang_at_step, "rank": drawn.hang_rank}}


def test_the_snapshots_of_c_come_ten_times_as_often() -> None:
    assert make_schedule(1).snapshot_steps == FULL["save_steps"] // 10
    assert make_schedule(1, save_steps=5).snapshot_steps == 1


def test_the_schedule_round_trips_through_json() -> None:
    s = make_schedule(9)
    assert Schedule(**json.loads(s.to_json())) == s


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"kill_at_step": 0}, "kill_at_step 0"),
    ({"kill_at_step": 1800}, "not inside the training"),
    ({"kill_at_step": True}, "whole number"),
    ({"work_steps": 5}, "too short"),
])
def test_a_schedule_that_cannot_run_is_one_line_with_a_hint(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ScheduleError) as exc:
        make_schedule(1, **kwargs)  # type: ignore[arg-type]
    assert words in str(exc.value) and "HINT:" in str(exc.value) and "\n" not in str(exc.value)


def test_the_hang_may_not_share_the_kill_step() -> None:
    s = make_schedule(1)
    with pytest.raises(ScheduleError, match="not the kill's step"):
        make_schedule(1, kill_at_step=s.hang_at_step)


def test_a_signal_lead_past_the_limit_is_refused() -> None:
    with pytest.raises(ScheduleError, match="signal lead"):
        make_schedule(1, signal_lead_s=180)
