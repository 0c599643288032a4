"""The goodput calculator (slurm_jit.grace.goodput) and its replay (goodput_replay): timelines computed by hand,
closed forms, the expectation against many replayed random schedules, properties, and Young's interval."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from slurm_jit.grace import goodput as gp
from slurm_jit.grace.goodput_replay import CRASH, HANG, PREEMPT, Fault, replay
from slurm_jit.grace.rules import GraceError


def costs(**kw: float) -> gp.Costs:
    base: dict[str, float] = {"step_s": 1.0, "save_steps": 2, "save_blocked_s": 1.0, "save_s": 1.0, "restart_s": 2.0,
                              "stop_s": 1.5, "crash_detect_s": 3.0, "hang_detect_s": math.inf, "time_limit_s": 100.0}
    return gp.Costs(**{**base, **kw})  # type: ignore[arg-type]


def parts(r: object) -> float:
    return sum(getattr(r, k) for k in ("compute_s", "blocked_s", "restart_s", "detection_s", "stop_s"))


# --- replays computed by hand ---------------------------------------------------------------------------


def test_no_fault_is_restart_steps_and_saves() -> None:
    # restart [0,3); steps 1-2 -> 5; save -> 5.5; steps 3-4 -> 7.5; save -> 8; step 5 -> 9 (no save after the last)
    r = replay(costs(save_blocked_s=0.5, save_s=0.5, restart_s=3.0), gp.PLAIN, work_steps=5)
    assert (r.wall_s, r.jobs, r.compute_s, r.blocked_s, r.restart_s, r.redone_s) == (9.0, 1, 5.0, 1.0, 3.0, 0.0)
    assert r.goodput == 5 / 9


def test_time_limit_plain_loses_the_steps_since_its_last_save() -> None:
    # job 1: restart -> 2; steps 1-2 -> 4; save -> 5 (kept 2); steps 3-4 -> 7; save [7, 7.5) cut by the limit 7.5
    # job 2 from 7.5: restart -> 9.5; steps 3-4 -> 11.5; save -> 12.5; steps 5-6 -> 14.5
    r = replay(costs(time_limit_s=7.5), gp.PLAIN, work_steps=6)
    assert (r.wall_s, r.jobs, r.compute_s, r.redone_s, r.blocked_s, r.restart_s) == (14.5, 2, 8.0, 2.0, 2.5, 4.0)
    assert parts(r) == r.wall_s


def test_time_limit_jit_keeps_every_step_at_its_signal() -> None:
    # (b): the signal at 7.5 - 1.5 = 6: steps 1-2 -> 4, save -> 5, step 3 -> 6: kept 3, the job ends at 7.5
    # job 2 from 7.5: restart -> 9.5; step 4 -> 10.5; save (step 4 of every 2) -> 11.5; steps 5-6 -> 13.5
    r = replay(costs(time_limit_s=7.5), gp.UPSTREAM_JIT, work_steps=6)
    assert (r.wall_s, r.jobs, r.compute_s, r.redone_s, r.stop_s, r.blocked_s) == (13.5, 2, 6.0, 0.0, 1.5, 2.0)
    assert parts(r) == r.wall_s


def test_crash_keeps_the_last_save_and_costs_its_detection() -> None:
    # steps 1-4 -> 6; save -> 7 (kept 4); steps 5, 6 -> 9; step 7 cut at 9.5; detected 3 s later: 12.5
    # job 2: restart -> 14.5; steps 5-8 -> 18.5
    c = costs(save_steps=4)
    for system in gp.SYSTEMS:  # a crash: no system is warned
        r = replay(c, system, work_steps=8, faults=(Fault(at_s=9.5, kind=CRASH),))
        assert (r.wall_s, r.redone_s, r.detection_s, r.faults_hit) == (18.5, 2.5, 3.0, 1)
        assert parts(r) == r.wall_s


def test_preemption_plain_redoes_jit_keeps_the_step_in_flight() -> None:
    c, fault = costs(save_steps=4, stop_s=2.0), (Fault(at_s=9.5, kind=PREEMPT),)
    plain = replay(c, gp.PLAIN, work_steps=8, faults=fault)  # killed at 9.5, kept 4: restart -> 11.5; 5-8 -> 15.5
    assert (plain.wall_s, plain.redone_s, plain.detection_s) == (15.5, 2.5, 0.0)
    jit = replay(c, gp.JIT_TRAINER, work_steps=8, faults=fault)  # step 7 completes in the stop: 11.5; 13.5; 14.5
    assert (jit.wall_s, jit.redone_s, jit.stop_s) == (14.5, 0.0, 2.0)
    assert parts(jit) == jit.wall_s


def test_hang_runs_to_the_time_limit_unless_a_watchdog_ends_it() -> None:
    c, fault = costs(save_steps=4, time_limit_s=20.0), (Fault(at_s=9.5, kind=HANG),)
    plain = replay(c, gp.PLAIN, work_steps=8, faults=fault)  # the hung job holds its allocation until 20
    assert (plain.wall_s, plain.detection_s) == (26.0, 10.5)
    watched = replay(replace(c, hang_detect_s=3.0), gp.JIT_TRAINER, work_steps=8, faults=fault)
    assert (watched.wall_s, watched.detection_s) == (18.5, 3.0)


def test_a_stuck_job_that_catches_sigterm_outlives_the_limit_until_slurms_sigkill() -> None:
    """(b), (c) catch SIGTERM to stop at a step boundary: ranks stuck at the limit live on until Slurm's SIGKILL,
    after its time-limit check and KillWait (here 30 s in all); (a)'s ranks die of the SIGTERM at the limit."""
    c, fault = costs(save_steps=4, time_limit_s=20.0, limit_overrun_s=30.0), (Fault(at_s=9.5, kind=HANG),)
    plain = replay(c, gp.PLAIN, work_steps=8, faults=fault)  # as without KillWait: the job ends at 20
    assert (plain.wall_s, plain.detection_s) == (26.0, 10.5)
    upstream = replay(c, gp.UPSTREAM_JIT, work_steps=8, faults=fault)  # ends at 50; 2 + 4 steps + 1 save kept
    assert (upstream.wall_s, upstream.detection_s, upstream.jobs) == (56.0, 40.5, 2)
    watched = replay(replace(c, hang_detect_s=3.0), gp.JIT_TRAINER, work_steps=8, faults=fault)
    assert (watched.wall_s, watched.detection_s) == (18.5, 3.0)  # its watchdog ends it before the limit
    crash = replay(replace(c, crash_detect_s=15.0), gp.UPSTREAM_JIT, work_steps=8,
                   faults=(Fault(at_s=9.5, kind=CRASH),))  # survivors stuck in a collective: until 24.5, not 20
    assert crash.detection_s == 15.0
    failures = gp.Failures(gpus=1, mtbf_gpu_h=0.01, hang_fraction=1.0)
    with_kw = gp.expected(c, gp.UPSTREAM_JIT, failures)
    without = gp.expected(replace(c, limit_overrun_s=0.0), gp.UPSTREAM_JIT, failures)
    assert with_kw.kept_s == without.kept_s and with_kw.attempt_s > without.attempt_s
    assert gp.expected(c, gp.PLAIN, failures) == gp.expected(replace(c, limit_overrun_s=0.0), gp.PLAIN, failures)


def test_async_save_counts_only_once_written() -> None:
    # steps 1-2 -> 2; stage [2, 2.5), written 5.0; steps 3-4 -> 4.5; wait for the write [4.5, 5.0), stage -> 5.5,
    # written 8.0; step 5 cut by the crash at 5.9: the save of step 4 is not written yet, step 2's is kept; +1 s
    # job 2 at 6.9: steps 3-4 -> 8.9; stage -> 9.4; steps 5-6 -> 11.4
    c = costs(save_blocked_s=0.5, save_s=3.0, restart_s=0.0, crash_detect_s=1.0)
    r = replay(c, gp.JIT_TRAINER, work_steps=6, faults=(Fault(at_s=5.9, kind=CRASH),))
    assert r.wall_s == pytest.approx(11.4) and r.blocked_s == pytest.approx(2.0)
    assert r.redone_s == pytest.approx(2.4) and parts(r) == pytest.approx(r.wall_s)


def test_a_job_that_can_keep_nothing_is_one_line() -> None:
    with pytest.raises(GraceError, match="keeps no step.*HINT"):
        replay(costs(restart_s=99.0), gp.PLAIN, work_steps=5)
    with pytest.raises(GraceError, match="fault kind 'oom'. HINT"):
        Fault(at_s=1.0, kind="oom")


# --- the expectation: closed forms ----------------------------------------------------------------------


def test_no_failures_plain_keeps_its_complete_saves_jit_its_steps() -> None:
    # saves complete at 5 + 10 + 2 = 17, then every 12: 17 ... 89 (7 saves); the JIT stop at 96 has done 77
    c = costs(step_s=1.0, save_steps=10, save_blocked_s=2.0, save_s=2.0, restart_s=5.0, stop_s=4.0)
    none = gp.Failures(gpus=1, mtbf_gpu_h=math.inf)
    assert gp.expected(c, gp.PLAIN, none).goodput == pytest.approx(0.70)
    assert gp.expected(c, gp.UPSTREAM_JIT, none).goodput == pytest.approx(0.77)
    assert replay(c, gp.UPSTREAM_JIT, work_steps=77).jobs == 1  # the replay keeps the same 77 steps in one job
    assert replay(c, gp.UPSTREAM_JIT, work_steps=78).jobs == 2


def test_unwarned_failures_with_a_save_every_step() -> None:
    # step 1 s saved at once, no restart, no detection: E[kept] = sum_i P(X >= i), E[wall] = E[min(X, T)], so
    # goodput = rate / (e^rate - 1), whatever the time limit
    rate = 0.1
    c = costs(save_steps=1, save_blocked_s=0.0, save_s=0.0, restart_s=0.0, crash_detect_s=0.0, time_limit_s=50.0)
    failures = gp.Failures(gpus=1, mtbf_gpu_h=1 / rate / gp.HOUR_S)
    assert gp.expected(c, gp.PLAIN, failures).goodput == pytest.approx(rate / math.expm1(rate), rel=1e-12)


def test_warned_stops_lose_only_the_restart() -> None:
    # no save costs, every stop warned and free: E[(min(X, T) - R)+] / E[min(X, T)]
    rate, restart, limit = 0.01, 10.0, 1000.0
    c = costs(save_steps=1, save_blocked_s=0.0, save_s=0.0, restart_s=restart, stop_s=0.0, time_limit_s=limit)
    failures = gp.Failures(gpus=1, mtbf_gpu_h=math.inf, preemptions_per_day=rate * gp.DAY_S)
    want = math.exp(-rate * restart) * -math.expm1(-rate * (limit - restart)) / -math.expm1(-rate * limit)
    assert gp.expected(c, gp.JIT_TRAINER, failures).goodput == pytest.approx(want, rel=1e-12)


def _random_faults(failures: gp.Failures, horizon_s: float, seed: int) -> tuple[Fault, ...]:
    rng, faults, t = random.Random(seed), [], 0.0
    unwarned, warned = failures.unwarned_per_s, failures.warned_per_s
    while t < horizon_s:
        t += rng.expovariate(unwarned + warned)
        if rng.random() * (unwarned + warned) < warned:
            faults.append(Fault(at_s=t, kind=PREEMPT))
        else:
            faults.append(Fault(at_s=t, kind=HANG if rng.random() < failures.hang_fraction else CRASH))
    return tuple(faults)


@pytest.mark.parametrize(("system", "background_s", "kill_wait_s"), [
    (gp.PLAIN, 0.0, 0.0), (gp.UPSTREAM_JIT, 0.0, 0.0), (gp.UPSTREAM_JIT, 0.0, 30.0), (gp.JIT_TRAINER, 5.0, 0.0),
    (gp.JIT_TRAINER, 40.0, 0.0)])
def test_expectation_matches_replayed_random_schedules(system: gp.System, background_s: float,
                                                       kill_wait_s: float) -> None:
    """A failure every 3 min (30 % of them hangs), a preemption every 500 s, 400 s jobs: the closed form against
    thousands of replayed jobs, within 3 % (sampling noise; (b), (c) resume off their save phase after a warned
    stop, which the closed form leaves out); (b) also with hung jobs held past the limit by KillWait."""
    hang = 40.0 if system is gp.JIT_TRAINER else math.inf
    c = costs(save_steps=20, save_blocked_s=2.0, save_s=2.0 + background_s, restart_s=15.0, stop_s=8.0,
              crash_detect_s=30.0, hang_detect_s=hang, time_limit_s=400.0, limit_overrun_s=kill_wait_s)
    failures = gp.Failures(gpus=1, mtbf_gpu_h=0.05, hang_fraction=0.3, preemptions_per_day=gp.DAY_S / 500)
    work = 400_000
    r = replay(c, system, work_steps=work, faults=_random_faults(failures, 20 * work, seed=7))
    assert r.jobs > 3000
    assert r.goodput == pytest.approx(gp.expected(c, system, failures).goodput, rel=0.03)


# --- properties -----------------------------------------------------------------------------------------

seconds = st.floats(min_value=0.0, max_value=5000.0, allow_nan=False)


@st.composite
def cases(draw: st.DrawFn) -> tuple[gp.Costs, gp.Failures, gp.System]:
    blocked = draw(seconds)
    c = gp.Costs(step_s=draw(st.floats(min_value=0.01, max_value=100.0)), save_steps=draw(st.integers(1, 5000)),
                 save_blocked_s=blocked, save_s=blocked + draw(seconds), restart_s=draw(seconds),
                 stop_s=draw(seconds), crash_detect_s=draw(seconds),
                 hang_detect_s=draw(st.one_of(seconds, st.just(math.inf))),
                 time_limit_s=draw(st.floats(min_value=5001.0, max_value=1e6)))
    f = gp.Failures(gpus=draw(st.integers(1, 100_000)), mtbf_gpu_h=draw(st.floats(min_value=1.0, max_value=1e7)),
                    hang_fraction=draw(st.floats(min_value=0.0, max_value=1.0)),
                    preemptions_per_day=draw(st.floats(min_value=0.0, max_value=100.0)))
    return c, f, draw(st.sampled_from(gp.SYSTEMS))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_goodput_is_a_share(case: tuple[gp.Costs, gp.Failures, gp.System]) -> None:
    c, f, system = case
    e = gp.expected(c, system, f)
    assert 0.0 <= e.goodput <= 1.0 and e.kept_s <= e.attempt_s * (1 + 1e-9)


@settings(max_examples=300, deadline=None)
@given(cases(), st.floats(min_value=1.01, max_value=100.0))
def test_more_mtbf_never_less_goodput(case: tuple[gp.Costs, gp.Failures, gp.System], factor: float) -> None:
    c, f, system = case
    # Only where a failure costs at least a warned stop at the limit: else fewer failures can rightly cost more
    # (found by hypothesis: free restart and detection, saves every 0.5 s step, a 1 s stop at the limit; a crash
    # then costs half a step and the limit's stop 1 s, so MTBF 1 h -> 2 h took goodput 0.999838 -> 0.999827)
    assume(min(c.crash_detect_s, c.hang_detect_s) >= c.stop_s)
    better = replace(f, mtbf_gpu_h=f.mtbf_gpu_h * factor)
    assert gp.expected(c, system, better).goodput >= gp.expected(c, system, f).goodput - 1e-9


@settings(max_examples=300, deadline=None)
@given(cases(), st.floats(min_value=0.0, max_value=5000.0))
def test_costlier_restart_or_detection_never_more_goodput(case: tuple[gp.Costs, gp.Failures, gp.System],
                                                          more: float) -> None:
    c, f, system = case
    base = gp.expected(c, system, f).goodput
    assert gp.expected(replace(c, restart_s=c.restart_s + more), system, f).goodput <= base + 1e-9
    assert gp.expected(replace(c, crash_detect_s=c.crash_detect_s + more), system, f).goodput <= base + 1e-9


@settings(max_examples=200, deadline=None)
@given(step=st.floats(min_value=0.1, max_value=30.0), save=st.floats(min_value=1.0, max_value=300.0),
       mtbf_h=st.floats(min_value=1.0, max_value=1000.0), limit=st.floats(min_value=1e4, max_value=1e6),
       restart=st.floats(min_value=0.0, max_value=0.1), system=st.sampled_from((gp.UPSTREAM_JIT, gp.JIT_TRAINER)))
def test_young_interval_minimises_the_models_loss(step: float, save: float, mtbf_h: float, limit: float,
                                                  restart: float, system: gp.System) -> None:
    """Where Young's first-order assumptions hold (save under 1 % of the MTBF, the interval 20 steps to 1/20 of
    the job): its save_steps loses at most 2 % more than the best of a grid around it, and less than a quarter
    or four times it."""
    failures = gp.Failures(gpus=1, mtbf_gpu_h=mtbf_h)
    c = costs(step_s=step, save_steps=1, save_blocked_s=save, save_s=save, restart_s=restart * limit,
              stop_s=min(save + step + 3, limit / 10), crash_detect_s=60.0, time_limit_s=limit)
    interval = gp.young_interval_s(c, system, failures)
    assert interval is not None and interval == pytest.approx(math.sqrt(2 * save * mtbf_h * gp.HOUR_S))
    assume(save <= mtbf_h * gp.HOUR_S / 100 and 20 * step <= interval <= limit / 20)
    k = gp.advised_save_steps(c, system, failures)
    assert k is not None

    def loss(steps: int) -> float:
        return 1 - gp.expected(replace(c, save_steps=max(1, steps)), system, failures).goodput

    grid = [loss(round(k * x)) for x in (0.5, 0.7, 0.85, 1.2, 1.5, 2.0)]
    assert loss(k) <= min(grid) * 1.02
    assert loss(k) < loss(k // 4 or 1) and loss(k) < loss(4 * k)


def test_advice_for_async_saves_at_least_the_background_write() -> None:
    c = costs(step_s=1.0, save_blocked_s=0.5, save_s=600.5)  # the write takes 10 min after a 0.5 s staging
    failures = gp.Failures(gpus=16_384)
    assert gp.young_interval_s(c, gp.JIT_TRAINER, failures) == 600.0
    assert gp.advised_save_steps(c, gp.JIT_TRAINER, failures) == 600
    assert gp.young_interval_s(c, gp.JIT_TRAINER, gp.Failures(gpus=1, mtbf_gpu_h=math.inf)) is None


def test_llama3_failure_rate() -> None:
    """419 unexpected interruptions in 54 days on 16,384 GPUs: one every ~3.09 h at that scale."""
    at_scale = gp.Failures(gpus=16_384)
    assert 1 / at_scale.unwarned_per_s / gp.HOUR_S == pytest.approx(54 * 24 / 419)
    per_node = gp.Failures(gpus=16_384, mtbf_node_h=gp.LLAMA3_MTBF_GPU_H / 8)  # a node of 8 fails 8x as often
    assert per_node.unwarned_per_s == pytest.approx(at_scale.unwarned_per_s)


def test_watchdog_numbers_agree_with_the_trainer() -> None:
    from slurm_jit.train import watchdog

    assert (gp.WATCHDOG_STEP_FACTOR, gp.WATCHDOG_MIN_S, gp.WATCHDOG_FIRING_S) == (
        watchdog.AUTO_STEP_FACTOR, watchdog.AUTO_MIN_S, watchdog.FIRING_MAX_S)


@pytest.mark.parametrize(("kw", "match"), [
    ({"step_s": 0.0}, "step time 0.0: must be a number > 0"), ({"restart_s": -1.0}, "restart -1.0"),
    ({"time_limit_s": math.nan}, "time limit nan"), ({"crash_detect_s": math.inf}, "crash detect inf"),
    ({"save_steps": 0}, "save_steps 0"), ({"save_s": 0.5}, "save time 0.5 s < its blocked time"),
    ({"stop_s": 100.0}, "does not fit in the time limit"), ({"limit_overrun_s": -30.0}, "limit overrun -30.0"),
])
def test_bad_costs_say_how_to_fix_them(kw: dict[str, float], match: str) -> None:
    with pytest.raises(GraceError, match=match) as err:
        costs(**kw)
    assert "HINT:" in str(err.value) and "\n" not in str(err.value)
