"""The hang watchdog's bounds, its firing (a real thread, a real faulthandler dump), its JitConfig field and the
``hung`` stop record's exit code: fast, no DeepSpeed."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from slurm_jit.timing import WARMUP_STEPS
from slurm_jit.train import stop_record, watchdog
from slurm_jit.train.jit_config import JitConfig


def test_auto_is_generous_before_warm_up_and_ten_longest_steps_after() -> None:
    assert watchdog.bound_s(watchdog.AUTO, 0.0, WARMUP_STEPS) == watchdog.AUTO_WARMUP_S
    assert watchdog.bound_s(watchdog.AUTO, 1.0, WARMUP_STEPS + 1) == watchdog.AUTO_MIN_S  # 10 s < the floor
    assert watchdog.bound_s(watchdog.AUTO, 60.0, WARMUP_STEPS + 1) == 600.0
    assert watchdog.bound_s(12.5, 60.0, 0) == 12.5  # an explicit bound is what it says


def test_long_phases_get_ten_step_bounds_and_at_least_ten_minutes() -> None:
    assert watchdog.long_bound_s(10.0) == watchdog.LONG_PHASE_MIN_S
    assert watchdog.long_bound_s(300.0) == 3000.0


def _fired(dog: watchdog.Watchdog, codes: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not codes and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(codes)


def test_a_step_past_its_bound_fires_with_the_stack_and_the_hung_exit_code(capfd: pytest.CaptureFixture[str]) -> None:
    codes: list[int] = []
    hangs: list[watchdog.Hang] = []
    dog = watchdog.Watchdog(0.3, rank=1, on_hang=hangs.append, exit_fn=codes.append)
    dog.start(step=4)
    dog.step_done(0.01, step=5)  # out of the first step's long bound: 0.3 s from here
    try:
        assert _fired(dog, codes, within_s=3.0)
    finally:
        dog.stop()
    assert codes == [watchdog.HUNG_EXIT_CODE]
    hang = hangs[0]
    assert (hang.rank, hang.step, hang.phase) == (1, 5, "step") and hang.since_s >= 0.3, hang
    assert "test_watchdog_bounds.py" in hang.frame or "_fired" in hang.frame or "sleep" in hang.frame, hang.frame
    err = capfd.readouterr().err
    assert "slurm_jit: hang on rank 1" in err and "HINT:" in err and "most recent call first" in err, err


def test_feeding_keeps_it_quiet_and_a_save_gets_the_long_bound() -> None:
    codes: list[int] = []
    dog = watchdog.Watchdog(0.3, rank=0, on_hang=lambda hang: None, exit_fn=codes.append)
    dog.start(step=0)
    try:
        dog.step_done(0.01, step=1)
        for _ in range(10):  # 1 s of boundaries 0.1 s apart
            time.sleep(0.1)
            dog.feed("evaluation", step=1)
        dog.feed("save", step=1)
        time.sleep(1.0)  # over the step bound, far under the save's
        assert codes == []
    finally:
        dog.stop()
    assert not any(t.name == "slurm-jit-watchdog" for t in threading.enumerate())


@pytest.mark.parametrize("value", [0, -1, float("nan"), "soon", True])
def test_a_bad_hang_timeout_is_one_line_with_a_hint(value: object) -> None:
    with pytest.raises(ValueError, match="hang_timeout_s=.*HINT"):
        JitConfig(hang_timeout_s=value)  # type: ignore[arg-type]


def test_hang_timeout_takes_seconds_auto_or_none() -> None:
    assert JitConfig().hang_timeout_s == watchdog.AUTO
    assert JitConfig(hang_timeout_s=None).hang_timeout_s is None
    assert JitConfig(hang_timeout_s=20).hang_timeout_s == 20


def test_the_hung_record_has_its_own_exit_code_and_names_the_stuck_rank(tmp_path: Path) -> None:
    report = {"rank": 1, "step": 7, "phase": "step", "since_s": 31.0, "bound_s": 30.0, "node": "n2",
              "frame": "train.py:12 in on_step_begin"}
    stop_record.write_hang_report(tmp_path, 1, report)
    assert stop_record.hang_reports(tmp_path) == [report]
    stop_record.write(tmp_path, "hung", step=7, ranks=stop_record.hang_reports(tmp_path))
    cli = subprocess.run([sys.executable, "-m", "slurm_jit.stop_record", str(tmp_path)], capture_output=True,
                         text=True, check=False)
    assert cli.returncode == stop_record.EXIT_HUNG == 11
    assert cli.stdout.startswith("hung step=7 hang: rank 1 (node n2)") and "on_step_begin" in cli.stdout
    assert len(set(stop_record.EXIT_BY_STATE.values())) == 4  # hung is told apart from a crash and a requeue


def test_a_bound_shorter_than_a_step_says_so_in_its_hint(capfd: pytest.CaptureFixture[str]) -> None:
    codes: list[int] = []
    dog = watchdog.Watchdog(0.3, rank=0, on_hang=lambda hang: None, exit_fn=codes.append)
    dog.start(step=0)
    dog.step_done(5.0, step=1)  # the first step (compilation): not what the bound is to fit
    dog.step_done(0.5, step=2)  # a step longer than hang_timeout_s=0.3: the next one is called a hang
    try:
        assert _fired(dog, codes, within_s=3.0)
    finally:
        dog.stop()
    err = capfd.readouterr().err
    assert "HINT: hang_timeout_s=0.3 is shorter than a step this run took (0.5 s)" in err, err


def test_a_hang_after_steps_within_the_bound_points_at_the_frame(capfd: pytest.CaptureFixture[str]) -> None:
    codes: list[int] = []
    dog = watchdog.Watchdog(0.3, rank=0, on_hang=lambda hang: None, exit_fn=codes.append)
    dog.start(step=0)
    dog.step_done(5.0, step=1)  # a slow first step says nothing about the bound
    dog.step_done(0.01, step=2)
    try:
        assert _fired(dog, codes, within_s=3.0)
    finally:
        dog.stop()
    err = capfd.readouterr().err
    assert "HINT: the frame that waits is where it hangs" in err and "shorter than a step" not in err, err


def test_rank0_waits_for_a_peer_whose_thread_wakes_up_to_one_interval_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks fed at the same boundary see the same deadline, but each thread wakes on its own clock: the peer
    may fire a whole poll interval after rank 0. Rank 0's wait for its report must cover that (it did not: with
    auto bounds, a 5 s interval against a 3 s wait, the stuck rank's report was missing from the record)."""
    monkeypatch.setattr(watchdog, "PEER_REPORT_WAIT_S", 0.5)  # the fixed wait, cut below a 2 s interval
    fired: dict[int, float] = {}

    def rank(number: int) -> watchdog.Watchdog:
        return watchdog.Watchdog(8.0, number, on_hang=lambda hang: fired.setdefault(number, time.monotonic()),
                                 exit_fn=lambda code: None)  # 8 s bound: the threads wake every 2 s

    first = rank(0)
    first.start(0)  # wakes at 2, 4, ... 10 s
    time.sleep(1.0)
    second = rank(1)
    second.start(0)  # wakes at 3, 5, ... 9, 11 s
    time.sleep(0.5)
    first.feed("step", 1)
    second.feed("step", 1)  # the same boundary on both ranks: the deadline is 9.5 s
    deadline = time.monotonic() + 20
    while len(fired) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    first.stop()
    second.stop()
    assert len(fired) == 2, fired
    lag_s = fired[1] - fired[0]  # rank 0 at 10 s, the peer at 11 s
    assert watchdog.PEER_REPORT_WAIT_S < lag_s < first.report_wait_s(), (lag_s, first.report_wait_s())


def test_a_record_of_many_hung_ranks_prints_one_short_line(tmp_path: Path) -> None:
    ranks = [{"rank": r, "step": 7, "phase": "step", "since_s": 31.0, "node": f"n{r}", "frame": "comm.py:9 in wait"}
             for r in range(1024)]
    stop_record.write(tmp_path, "hung", step=7, ranks=ranks, unreported=[{"rank": 1024, "node": "n1024"}])
    cli = subprocess.run([sys.executable, "-m", "slurm_jit.stop_record", str(tmp_path)], capture_output=True,
                         text=True, check=False)
    assert cli.returncode == stop_record.EXIT_HUNG and len(cli.stdout.splitlines()) == 1, cli.stdout[:300]
    assert len(cli.stdout) < 1000 and "; 1017 more in stop.json; stacks in the job log" in cli.stdout, cli.stdout
