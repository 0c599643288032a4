"""Where a chain's allocation time went, on a timeline computed by hand: the kill's redone steps and detection, a
restart cut by a preemption, the split summing to the loss; the calculator fed the measured costs; the tables and
the timeline picture."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import replace
from typing import Any

import pytest

from slurm_jit.goodput import predict, render, report
from slurm_jit.goodput.chain import Chain, Run

STEP_S = 1.0


def _run_events(job: str, restart: int, *, t0: float, imports: float | None = None, begin: float | None = None,
                first: tuple[int, float] | None = None, steps: range = range(0), step_t0: float = 0.0,
                fault: tuple[str, int, float, int] | None = None) -> list[dict[str, Any]]:
    """One run's events on both ranks, as the probe writes them (rank 0 the steps)."""
    run = {"job": job, "restart": restart}
    events: list[dict[str, Any]] = []
    for rank in (0, 1):
        events.append({"event": "start", "rank": rank, **run, "t": t0 + 0.2, "t_process": t0})
        if imports is not None:
            events.append({"event": "imports", "rank": rank, **run, "t": imports})
        if begin is not None:
            events.append({"event": "train_begin", "rank": rank, **run, "t": begin})
        if first is not None:
            events.append({"event": "first_step", "rank": rank, **run, "t": first[1], "step": first[0]})
    events += [{"event": "step", "rank": 0, **run, "step": s, "t": step_t0 + (s - steps.start) * STEP_S}
               for s in steps]
    if fault is not None:
        kind, step, t, rank = fault
        events.append({"event": kind, "rank": rank, **run, "step": step, "t": t})
    return events


def kill_preempt_finish() -> tuple[Chain, list[dict[str, Any]]]:
    """Run 1: steps 1-40, killed after step 40 (t 46), allocation ends at 50. Run 2: preempted at 64 during its
    imports, allocation 60-75. Run 3: resumes after step 30 (the newest save), steps 31-80, ends the training."""
    chain = Chain(key="a", reference=False, started=0.0, finished=True, outcome="finished", preempt=(64.0, "99"),
                  submits=[(0.0, "10")], runs=[Run(job="10", restart=0, start=0.0, end=50.0, state="PENDING"),
                                               Run(job="10", restart=1, start=60.0, end=75.0, state="PENDING"),
                                               Run(job="10", restart=2, start=100.0, end=200.0, state="COMPLETED")])
    events = (_run_events("10", 0, t0=1.0, imports=3.0, begin=5.0, first=(0, 6.0), steps=range(1, 41), step_t0=7.0,
                          fault=("kill", 40, 46.0, 1))
              + _run_events("10", 1, t0=61.0, imports=65.0)
              + _run_events("10", 2, t0=101.0, imports=103.0, begin=105.0, first=(30, 106.0), steps=range(31, 81),
                            step_t0=107.0))
    return chain, events


def analysed(uninterrupted_s: float = 130.0) -> report.SystemReport:
    chain, events = kill_preempt_finish()
    return report.analyse(chain, events, uninterrupted_s=uninterrupted_s, work_steps=80, limit_s=180.0, lead_s=30.0,
                          weights_equal=True)


def test_the_kill_costs_the_steps_since_the_kept_save_its_detection_and_the_cut_restart() -> None:
    kill, preempted = analysed().ends
    assert (kill.kind, kill.last_step, kill.kept_step, kill.redone_steps) == ("kill", 40, 30, 10)
    assert kill.redone_s == pytest.approx(46.0 - 36.0)  # from step 30's end until the kill
    assert kill.detection_s == pytest.approx(50.0 - 46.0)
    # run 2's start-up, cut by the preemption at 64 in its imports: launch 1 s, imports 3 s (of 4)
    assert kill.restart == pytest.approx({"launch": 1.0, "imports": 3.0})
    assert kill.queue_s == pytest.approx(10.0)
    assert preempted.kind == "preempt" and preempted.redone_steps == 0 and preempted.redone_s == 0
    assert preempted.detection_s == pytest.approx(75.0 - 64.0)
    assert preempted.restart == pytest.approx({"launch": 1.0, "imports": 2.0, "engine": 2.0, "load": 1.0,
                                               "first_step": 0.0})
    assert preempted.queue_s == pytest.approx(25.0)


def test_the_split_sums_to_the_allocations_less_the_uninterrupted_run() -> None:
    r = analysed(uninterrupted_s=130.0)
    assert r.allocation_s == pytest.approx(50 + 15 + 100)
    assert r.split_s == pytest.approx(10 + 4 + 4 + 11 + 6)
    assert r.loss_s == pytest.approx(r.split_s)
    assert r.goodput == pytest.approx(130 / 165)
    assert (r.runs, r.jobs, r.steps_done, r.steps_computed, r.steps_redone) == (3, 1, 80, 90, 10)
    assert r.queue_s == pytest.approx(10 + 25)


def test_the_matched_loss_swaps_the_references_start_up_and_end_for_the_chains() -> None:
    """A reference whose start-up took 4 s more than the chain's first (10 s against 6) and whose end 2 s less (42
    against 44): the loss moves by 2 s, the split does not; the matched loss is the split again."""
    chain, events = kill_preempt_finish()
    ref_run = Run(job="1", restart=0, start=0.0, end=132.0, state="COMPLETED")
    ref = report.run_facts(ref_run, _run_events("1", 0, t0=1.0, imports=4.0, begin=9.0, first=(0, 10.0),
                                                steps=range(1, 81), step_t0=11.0))
    assert (ref.startup_s, ref.end_s) == (10.0, 42.0)
    r = report.analyse(chain, events, uninterrupted_s=132.0, work_steps=80, limit_s=180.0, lead_s=30.0,
                       weights_equal=True, reference=ref)
    assert r.startup_s == (6.0, 10.0) and r.end_s == (44.0, 42.0)
    assert r.loss_s == pytest.approx(33.0) and r.split_s == pytest.approx(35.0)
    assert r.matched_loss_s == pytest.approx(35.0)
    assert "matched, the uninterrupted run's start-up and end (10.0 s, 42.0 s) swapped for the chain's (6.0 s, " \
           "44.0 s): 35.0" in render.costs_table(r)
    assert analysed(uninterrupted_s=132.0).matched_loss_s == pytest.approx(33.0)  # no reference: the loss


def test_a_hung_job_held_past_the_limit_is_predicted_with_its_overrun() -> None:
    """(b) hangs at step 41 (t 46); upstream's SIGTERM handler keeps the hung ranks alive past the 180 s limit
    until Slurm's SIGKILL (allocation 0-210); the next run resumes after step 40's save. The replay that ends the
    hung job at the limit + the measured 30 s predicts the measured goodput; the one that ends it at the limit
    does not. Where no run was held past the limit, the given default is fed."""
    chain = Chain(key="b", reference=False, started=0.0, finished=True, outcome="finished",
                  submits=[(0.0, "10"), (212.0, "11")],
                  runs=[Run(job="10", restart=0, start=0.0, end=210.0, state="TIMEOUT"),
                        Run(job="11", restart=0, start=220.0, end=270.0, state="COMPLETED")])
    events = (_run_events("10", 0, t0=1.0, imports=3.0, begin=5.0, first=(0, 6.0), steps=range(1, 41), step_t0=7.0,
                          fault=("hang", 41, 46.0, 1))
              + _run_events("11", 0, t0=221.0, imports=223.0, begin=225.0, first=(40, 226.0), steps=range(41, 81),
                            step_t0=227.0))
    r = report.analyse(chain, events, uninterrupted_s=86.0, work_steps=80, limit_s=180.0, lead_s=30.0,
                       weights_equal=True)
    assert r.goodput == pytest.approx(86 / 260) and r.ends[0].detection_s == pytest.approx(164.0)
    runs = [report.run_facts(run, events) for run in chain.runs]
    pred = predict.predict(r, runs, save_steps=10, limit_s=180.0, preempt_t=None, overrun_s=99.0)
    assert pred.costs.limit_overrun_s == pytest.approx(30.0)  # measured: the default is not used
    assert pred.predicted == pytest.approx(86 / 256)  # restart 6 s, steps 1-40, end at 210, 6 + 40 s
    at_the_limit = predict.replayed_goodput(replace(pred.costs, limit_overrun_s=0.0), "b", 80,
                                            predict.faults_at(r, runs, None))
    assert at_the_limit == pytest.approx(86 / 226)
    assert pred.error < 0.02 < 0.1 < abs(at_the_limit - r.goodput) / r.goodput
    chain, events = kill_preempt_finish()  # nothing held past the limit: the default
    runs = [report.run_facts(run, events) for run in chain.runs]
    assert predict.measured_costs(analysed(), runs, save_steps=10, limit_s=180.0,
                                  overrun_s=predict.default_overrun_s(30.0)).limit_overrun_s == 45.0


def test_a_chain_that_did_not_finish_counts_the_share_of_the_work_it_did() -> None:
    chain, events = kill_preempt_finish()
    chain.finished = False
    r = report.analyse(chain, events, uninterrupted_s=130.0, work_steps=160, limit_s=180.0, lead_s=30.0,
                       weights_equal=None)
    assert r.goodput == pytest.approx(130 * 80 / 160 / 165)  # the kept step unknown: the newest reached, 80
    assert len(r.ends) == 3 and r.ends[-1].kind == "time limit"  # its last run lasted past limit - lead - 60 s
    kept = report.analyse(chain, events, uninterrupted_s=130.0, work_steps=160, limit_s=180.0, lead_s=30.0,
                          weights_equal=None, kept_steps=70)  # its newest checkpoint: step 70 (80 reached)
    assert kept.goodput == pytest.approx(130 * 70 / 160 / 165)
    chain.finished = True  # a finished chain kept everything, whatever is passed
    done = report.analyse(chain, events, uninterrupted_s=130.0, work_steps=80, limit_s=180.0, lead_s=30.0,
                          weights_equal=None, kept_steps=10)
    assert done.kept_steps is None and done.goodput == pytest.approx(130 / 165)


def test_a_run_that_lasted_to_the_warning_ended_by_the_time_limit() -> None:
    run = Run(job="5", restart=0, start=0.0, end=155.0)
    facts = report.run_facts(run, _run_events("5", 0, t0=1, imports=2, begin=3, first=(0, 4), steps=range(1, 100),
                                              step_t0=5))
    chain = Chain(key="c", reference=False, started=0.0)
    assert report.end_kind(facts, chain, 180.0, 30.0) == report.TIME_LIMIT
    short = report.run_facts(Run(job="5", restart=0, start=0.0, end=40.0), [])
    assert report.end_kind(short, chain, 180.0, 30.0) == report.CRASH


def test_the_calculator_is_fed_the_measured_costs_and_the_faults_where_they_landed() -> None:
    chain, events = kill_preempt_finish()
    r = analysed()
    runs = [report.run_facts(run, events) for run in chain.runs]
    costs = predict.measured_costs(r, runs, save_steps=10, limit_s=180.0)
    assert costs.step_s == pytest.approx(STEP_S)
    assert costs.crash_detect_s == pytest.approx(4.0)
    assert costs.restart_s == pytest.approx(6.0)  # only the restart that was not cut
    assert math.isinf(costs.hang_detect_s)  # no hang measured: the calculator's default
    faults = predict.faults_at(r, runs, chain.preempt[0] if chain.preempt else None)
    assert [(f.kind, round(f.at_s, 3)) for f in faults] == [("crash", 46.0), ("preempt", 50.0 + 4.0)]
    predicted = predict.replayed_goodput(costs, "a", 80, faults)
    assert 0 < predicted < 1


def test_at_scale_each_system_gets_a_goodput_and_its_advised_interval() -> None:
    chain, events = kill_preempt_finish()
    runs = [report.run_facts(run, events) for run in chain.runs]
    costs = predict.measured_costs(analysed(), runs, save_steps=10, limit_s=180.0)
    for key in "abc":
        for mixed in (False, True):
            goodput, advised = predict.at_scale(costs, key, 16_384, hangs_and_preemptions=mixed)
            assert 0 < goodput <= 1 and advised is not None and advised >= 1


def test_the_paced_goodput_puts_the_reference_at_the_chains_start_up_end_and_step_pace() -> None:
    """A reference on a busier host: start-up 10 s (the chain's 6), end 42 s (44), steps of 1.1 s (the chain's 1.0):
    its allocation (10 + 79 x 1.1 + 1.1 + 42 = 140 s) flatters the chain's goodput (140 / 165); at the chain's own
    pace it is 140 - 4 + 2 - 79 x 0.1 = 130.1 s, the goodput 130.1 / 165."""
    chain, events = kill_preempt_finish()
    ref_run = Run(job="1", restart=0, start=0.0, end=140.0, state="COMPLETED")
    ref_events = _run_events("1", 0, t0=1.0, imports=4.0, begin=9.0, first=(0, 10.0))
    ref_events += [{"event": "step", "rank": 0, "job": "1", "restart": 0, "step": s, "t": 10.0 + s * 1.1}
                   for s in range(1, 81)]
    ref = report.run_facts(ref_run, ref_events)
    assert ref.startup_s == pytest.approx(10.0) and ref.end_s == pytest.approx(140.0 - 98.0)
    r = report.analyse(chain, events, uninterrupted_s=140.0, work_steps=80, limit_s=180.0, lead_s=30.0,
                       weights_equal=True, reference=ref)
    assert r.step_pace_s == pytest.approx((1.0, 1.1))
    assert r.goodput == pytest.approx(140.0 / 165.0)
    assert r.paced_goodput == pytest.approx((140.0 - 4.0 + 2.0 - 79 * 0.1) / 165.0)
    assert "| **84.8 %** | 78.8 % |" in render.summary_table([r], {})
    assert analysed().paced_goodput is None  # no reference: not known
    assert "| **78.8 %** | - |" in render.summary_table([analysed()], {})


def test_the_tables_and_the_picture() -> None:
    chain, events = kill_preempt_finish()
    r = analysed()
    runs = [report.run_facts(run, events) for run in chain.runs]
    pred = predict.predict(r, runs, save_steps=10, limit_s=180.0, preempt_t=64.0)
    summary = render.summary_table([r], {"a": pred})
    assert "**78.8 %**" in summary and "3 / 1" not in summary and "1 / 3" in summary and "90 (10)" in summary
    costs = render.costs_table(r)
    assert "| 1 | kill | 40 | 30 | 10, 10.0 | 4.0 | 10.0 | 4.0: 1.0 / 3.0 / - / - / - | 18.0 |" in costs
    assert "**35.0** (measured loss: allocated - uninterrupted = 35.0)" in costs
    svg = ET.fromstring(render.timeline_svg(r, runs, chain, 80))
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "kill" in texts and "preempt" in texts
    assert len(list(svg.iter("{http://www.w3.org/2000/svg}polyline"))) == 2  # the runs with steps
