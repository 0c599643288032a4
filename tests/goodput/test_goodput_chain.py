"""The watcher's allocations from what ``scontrol show job`` says poll by poll (Slurm faked at its one gateway;
tests/integration/test_goodput_run.py runs the real cluster): a requeue opens a new run of the same job id, the
run ends at the poll that no longer finds it holding the node, an ended job settles before a resubmission."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from slurm_jit import slurm
from slurm_jit.goodput import chain, systems
from slurm_jit.goodput.schedule import make_schedule

START = "2026-12-06T03:00:00"


def _job(state: str, restarts: int, start: str) -> str:
    return (f"JobId=5 JobName=goodput-a\n   JobState={state} Reason=None Dependency=(null)\n"
            f"   Requeue=1 Restarts={restarts} BatchFlag=1\n   StartTime={start} EndTime=Unknown\n")


def _watch(tmp_path: Path, answers: list[str], monkeypatch: pytest.MonkeyPatch) -> chain.Watch:
    def fake(argv: Sequence[str], timeout_s: float) -> str:
        assert list(argv[:3]) == ["scontrol", "show", "job"]
        return answers.pop(0)

    monkeypatch.setattr(slurm, "runner", fake)
    paths = systems.Paths.under(tmp_path, "a", reference=True)
    return chain.Watch(chain=chain.Chain(key="a", reference=True, started=0.0), paths=paths,
                       schedule=make_schedule(1), submit=lambda: "5", budget_s=100.0, job="5")


def test_a_requeue_is_a_new_run_of_the_same_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = chain.slurm_time(START)
    assert t0 is not None
    answers = [_job("RUNNING", 0, START), _job("COMPLETING", 0, START), _job("PENDING", 1, "Unknown"),
               _job("RUNNING", 1, "2026-12-06T03:02:00"), _job("COMPLETED", 1, "2026-12-06T03:02:00")]
    w = _watch(tmp_path, answers, monkeypatch)
    for now in (t0 + 1, t0 + 100, t0 + 101, t0 + 121, t0 + 150):
        w.poll(now)
    runs = w.chain.runs
    assert [(r.job, r.restart, r.start, r.end, r.state) for r in runs] == [
        ("5", 0, t0, t0 + 101 - chain.POLL_S / 2, "PENDING"),
        ("5", 1, t0 + 120, t0 + 150 - chain.POLL_S / 2, "COMPLETED")]
    assert w.ended_since == t0 + 150


def test_two_runs_seen_back_to_back_end_the_first_where_the_second_began(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = chain.slurm_time(START)
    assert t0 is not None
    w = _watch(tmp_path, [_job("RUNNING", 0, START), _job("RUNNING", 1, "2026-12-06T03:01:00")], monkeypatch)
    w.poll(t0 + 1)
    w.poll(t0 + 70)
    assert [r.end for r in w.chain.runs] == [t0 + 60, None]  # not later than the next allocation began


def test_slurm_times_unknown_are_none() -> None:
    assert chain.slurm_time("Unknown") is None and chain.slurm_time("None") is None
    assert chain.slurm_time(START) == pytest.approx(chain.slurm_time("2026-12-06T03:00:01") - 1)  # type: ignore[operator]


def test_a_chain_round_trips_through_json(tmp_path: Path) -> None:
    c = chain.Chain(key="b", reference=False, started=1.0, ended=9.0, runs=[chain.Run(job="7", restart=0, start=1.0,
                                                                                      end=5.0, state="FAILED")],
                    submits=[(1.0, "7")], preempt=(3.0, "8"), finished=True, outcome="finished")
    chain.save(c, tmp_path / "chain.json")
    assert chain.load(tmp_path / "chain.json") == c


def test_completing_after_a_requeue_is_the_old_runs_tail_not_a_new_run(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # seen on the local cluster (system a's trap requeue): COMPLETING already with Restarts=1, then PENDING
    t0 = chain.slurm_time(START)
    assert t0 is not None
    answers = [_job("RUNNING", 0, START), _job("COMPLETING", 1, "2026-12-06T03:02:21"), _job("PENDING", 1, "Unknown"),
               _job("RUNNING", 1, "2026-12-06T03:02:33"), _job("COMPLETED", 1, "2026-12-06T03:02:33")]
    w = _watch(tmp_path, answers, monkeypatch)
    for now in (t0 + 1, t0 + 141, t0 + 142, t0 + 154, t0 + 180):
        w.poll(now)
    assert [(r.restart, r.start, r.end) for r in w.chain.runs] == [
        (0, t0, t0 + 142 - chain.POLL_S / 2), (1, t0 + 153, t0 + 180 - chain.POLL_S / 2)]
