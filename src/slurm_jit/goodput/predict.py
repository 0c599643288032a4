"""The calculator (:mod:`slurm_jit.grace.goodput`) fed one system's measured costs (pure).

:func:`measured_costs` turns a :class:`~.report.SystemReport` and the step timeline into the calculator's
:class:`~slurm_jit.grace.goodput.Costs`: the median step; the save's blocked time (the median gap from a save
step's end to the next step's end, less a step: the same measure for a synchronous save and an async staging);
an async save's full time from the JitTrainer's timing log; the restart (mean of the in-allocation parts:
launch, imports, engine, load, first step's excess); the detections of the kill and the hang and the warned
stop as measured (the event until the allocation's end); the time limit as the mean allocation of the runs the
time limit ended; how long a (b) or (c) job stuck at the limit outlived it (their ranks catch SIGTERM: only
Slurm's SIGKILL ends them, after slurmctld's next time-limit check and KillWait; where no run was stuck at the limit,
:func:`default_overrun_s`). :func:`replayed_goodput` replays the chain under the run's
faults (at the allocation time they landed at, allocations laid end to end) and its uninterrupted twin: the
predicted goodput is their ratio, to set beside the measured one. :func:`at_scale` gives the expectation at N GPUs
with a 24-hour limit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

from slurm_jit.goodput.report import HANG, KILL, PREEMPT, TIME_LIMIT, EndCost, RunFacts, SystemReport
from slurm_jit.grace import goodput as gp
from slurm_jit.grace.goodput_replay import CRASH, Fault, replay

SYSTEM_OF = {s.key: s for s in gp.SYSTEMS}
DAY_S = 86_400.0
SCALES = (1_024, 16_384)
LIMIT_CHECK_S = 30.0  # slurmctld looks for jobs past their limit every PERIODIC_TIMEOUT (src/slurmctld/slurmctld.h)
HANG_FRACTION = 0.1  # docs/goodput.md's example mix: 10 % of unwarned failures hang, Llama 3's planned
# interruptions (47 in 54 days) as warned preemptions


@dataclass(frozen=True, kw_only=True)
class Prediction:
    measured: float
    predicted: float
    costs: gp.Costs

    @property
    def error(self) -> float:
        """Relative error of the prediction against the measurement."""
        return abs(self.predicted - self.measured) / self.measured if self.measured else math.inf


def save_blocked_s(runs: Sequence[RunFacts], save_steps: int, step_s: float) -> float:
    gaps = [b[1] - a[1] for r in runs for a, b in pairwise(r.steps)
            if b[0] == a[0] + 1 and a[0] % save_steps == 0]
    return max(0.0, statistics.median(gaps) - step_s) if gaps else 0.0


def _mean(values: Sequence[float], default: float) -> float:
    return statistics.fmean(values) if values else default


def _detection(ends: Sequence[EndCost], kind: str, default: float) -> float:
    return _mean([e.detection_s for e in ends if e.kind == kind], default)


def default_overrun_s(kill_wait_s: float) -> float:
    """A stuck job's allocation past its limit, unmeasured: half a time-limit check's interval, then KillWait."""
    return LIMIT_CHECK_S / 2 + kill_wait_s


def measured_costs(report: SystemReport, runs: Sequence[RunFacts], *, save_steps: int, limit_s: float,
                   background_s: float = 0.0, overrun_s: float = 0.0) -> gp.Costs:
    """The calculator's costs for this system, from its run (``overrun_s``: a stuck job's allocation past the
    limit where no run of the chain was stuck at it)."""
    step = max(report.step_s, 1e-3)
    blocked = save_blocked_s(runs, save_steps, step)
    restarts = [e.restart_s for e in report.ends if {"launch", "engine"} <= set(e.restart)]
    limited = [runs[e.run].alloc_s for e in report.ends if e.kind == TIME_LIMIT]
    limit = _mean(limited, limit_s)
    stop = min(_detection(report.ends, TIME_LIMIT, gp.default_stop_s(step, blocked)), limit / 2)
    stuck = [runs[e.run].alloc_s - limit for e in report.ends
             if e.kind in (HANG, KILL) and runs[e.run].alloc_s > limit_s]  # held past the limit by Slurm
    return gp.Costs(step_s=step, save_steps=save_steps, save_blocked_s=blocked, save_s=blocked + background_s,
                    restart_s=_mean(restarts, 0.0), stop_s=stop,
                    crash_detect_s=_detection(report.ends, KILL, gp.NCCL_TIMEOUT_S),
                    hang_detect_s=_detection(report.ends, HANG, math.inf), time_limit_s=limit,
                    limit_overrun_s=max(0.0, _mean(stuck, overrun_s)))


def faults_at(report: SystemReport, runs: Sequence[RunFacts], preempt_t: float | None) -> tuple[Fault, ...]:
    """The run's faults at the allocation time they landed at (allocations laid end to end)."""
    faults, before = [], 0.0
    for facts in runs:
        for kind, name in ((KILL, CRASH), (HANG, "hang")):
            if kind in facts.faults:
                faults.append(Fault(at_s=before + facts.faults[kind][1] - facts.run.start, kind=name))
        end = facts.run.end or facts.run.start
        if preempt_t is not None and facts.run.start <= preempt_t <= end:
            faults.append(Fault(at_s=before + preempt_t - facts.run.start, kind=PREEMPT))
        before += end - facts.run.start
    return tuple(faults)


def replayed_goodput(costs: gp.Costs, key: str, work_steps: int, faults: tuple[Fault, ...]) -> float:
    """The calculator's goodput of this schedule: the uninterrupted replay's wall over the faulted one's."""
    system = SYSTEM_OF[key]
    chain = replay(costs, system, work_steps=work_steps, faults=faults)
    alone = replay(replace(costs, time_limit_s=1e9), system, work_steps=work_steps)
    return alone.wall_s / chain.wall_s


def predict(report: SystemReport, runs: Sequence[RunFacts], *, save_steps: int, limit_s: float,
            preempt_t: float | None, background_s: float = 0.0, overrun_s: float = 0.0) -> Prediction:
    costs = measured_costs(report, runs, save_steps=save_steps, limit_s=limit_s, background_s=background_s,
                           overrun_s=overrun_s)
    predicted = replayed_goodput(costs, report.key, report.work_steps, faults_at(report, runs, preempt_t))
    return Prediction(measured=report.goodput, predicted=predicted, costs=costs)


def at_scale(costs: gp.Costs, key: str, gpus: int, *, hangs_and_preemptions: bool,
             time_limit_s: float = DAY_S) -> tuple[float, int | None]:
    """(expected goodput, advised save_steps) at ``gpus`` GPUs with a 24-hour limit, the system's measured costs
    (the detections measured here; (a) and (b) hold a hang until the limit), at its advised interval."""
    system = SYSTEM_OF[key]
    failures = gp.Failures(gpus=gpus, hang_fraction=HANG_FRACTION if hangs_and_preemptions else 0.0,
                           preemptions_per_day=gp.LLAMA3_PLANNED / gp.LLAMA3_DAYS if hangs_and_preemptions else 0.0)
    hang = costs.hang_detect_s if system.key == "c" else math.inf
    scaled = replace(costs, time_limit_s=time_limit_s, hang_detect_s=hang)
    advised = gp.advised_save_steps(scaled, system, failures)
    if advised is not None:
        scaled = replace(scaled, save_steps=advised)
    return gp.expected(scaled, system, failures).goodput, advised
