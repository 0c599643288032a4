"""One chain of jobs replayed step by step under a given fault schedule: where its allocation time went.

The same rules as the expectation in :mod:`~.goodput` (its docstring), on exact steps instead of expectations:
each job starts with the restart, runs steps, and after every ``save_steps``-th step (counted from the training's
start, so a resume after a warned stop keeps the schedule) blocks for the save (after waiting for the previous
async write, if it still runs); the save counts once complete, ``save_s`` after it began. A job ends at

* the time limit: (a) at the limit, keeping its last complete save; (b), (c) at the signal ``stop_s`` before it,
  keeping every step done, the one the signal lands in included, the job ending ``stop_s`` later;
* a fault of the schedule (wall time from the chain's start): a crash or a hang keeps the last complete save and
  the job ends ``crash_detect_s`` / ``hang_detect_s`` later (at the limit at most; for (b), (c), whose ranks catch
  SIGTERM, at the limit + ``limit_overrun_s``: until Slurm's SIGKILL); a preemption ends (a) at once
  (its last save), and stops (b), (c) as the time limit's signal does.

A fault that lands while a job is already ending (its stop, its detection) hits nothing. The next job starts when
the last one ended; the chain ends with the last step (no final save counted). For the costs that
``tools/goodput`` measures and its schedule, this gives the wall time to set against the measured one.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slurm_jit.grace.goodput import Costs, System
from slurm_jit.grace.rules import GraceError

CRASH, HANG, PREEMPT = "crash", "hang", "preempt"
FAULT_KINDS = (CRASH, HANG, PREEMPT)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault of a schedule."""

    at_s: float  # wall time from the chain's start
    kind: str  # crash (unwarned, a rank or node lost), hang (unwarned, a rank stuck), preempt (warned)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise GraceError(f"fault kind {self.kind!r}. HINT: one of {', '.join(FAULT_KINDS)}")
        if not (isinstance(self.at_s, int | float) and math.isfinite(self.at_s) and self.at_s >= 0):
            raise GraceError(f"fault at {self.at_s!r} s. HINT: seconds from the chain's start, 0 or more")


@dataclass(frozen=True, kw_only=True)
class Replay:
    """Where the chain's wall time went: ``wall_s`` = compute + blocked + restart + detection + stop."""

    work_s: float  # the training's compute: its steps x the step time
    wall_s: float  # from the first job's start until the last step
    jobs: int  # allocations the chain used
    faults_hit: int  # faults of the schedule that ended a job
    compute_s: float  # every step run, redone ones and a cut one's part included
    redone_s: float  # of compute_s, the steps lost and run again (a cut step's part included)
    blocked_s: float  # periodic saves (and waits for an earlier async write)
    restart_s: float
    detection_s: float  # from an unwarned fault until its job ended
    stop_s: float  # warned stops, from the signal until the job ended

    @property
    def goodput(self) -> float:
        return self.work_s / self.wall_s if self.wall_s > 0 else 1.0


@dataclass(kw_only=True)
class _Run:
    """The replay's running state (one chain)."""

    costs: Costs
    system: System
    work_steps: int
    faults: list[Fault]
    t: float = 0.0  # the current wall time
    durable: int = 0  # steps in the newest complete checkpoint (or kept by a warned stop)
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("compute", "redone", "blocked", "restart", "detection", "stop"), 0.0))
    jobs: int = 0
    faults_hit: int = 0

    def advance(self, seconds: float, bucket: str, event_t: float) -> bool:
        """Spend ``seconds`` in ``bucket`` unless the event at ``event_t`` comes first (True: it did)."""
        if self.t + seconds <= event_t:
            self.t += seconds
            self.totals[bucket] += seconds
            return False
        self.totals[bucket] += max(0.0, event_t - self.t)
        self.t = max(self.t, event_t)
        return True


def _next_event(run: _Run, cutoff: float) -> tuple[float, Fault | None]:
    """The first fault before the job's time-limit end (dropping those that hit an ending job), else the end."""
    while run.faults and run.faults[0].at_s < run.t:
        run.faults.pop(0)
    if run.faults and run.faults[0].at_s < cutoff:
        return run.faults[0].at_s, run.faults[0]
    return cutoff, None


def _steps(run: _Run, event_t: float) -> tuple[int, bool, list[tuple[float, int]], bool]:
    """Run steps and saves until the work is done or the event: (steps done, a step was cut, (complete at, steps)
    of each save, the event came first)."""
    c, steps, written_until = run.costs, run.durable, -math.inf
    saves: list[tuple[float, int]] = []
    while steps < run.work_steps:
        started = run.t
        if run.advance(c.step_s, "compute", event_t):
            return steps, run.t > started, saves, True
        steps += 1
        if steps == run.work_steps or steps % c.save_steps:
            continue
        if run.advance(max(0.0, written_until - run.t), "blocked", event_t):
            return steps, False, saves, True
        if run.advance(c.save_blocked_s, "blocked", event_t):
            return steps, False, saves, True
        written_until = run.t + c.background_s
        saves.append((written_until, steps))
    return steps, False, saves, False


def _job(run: _Run) -> None:
    """One job from its start to its end; updates the run."""
    c, kept_before, compute_before, start = run.costs, run.durable, run.totals["compute"], run.t
    limit = start + c.time_limit_s
    cutoff = limit - c.stop_s if run.system.saves_when_warned else limit
    event_t, fault = _next_event(run, cutoff)
    run.jobs += 1
    saves: list[tuple[float, int]] = []
    steps, cut, hit = kept_before, False, True
    if not run.advance(c.restart_s, "restart", event_t):
        steps, cut, saves, hit = _steps(run, event_t)
    if not hit:
        run.durable = steps  # the work is done
        return
    warned = fault is None or fault.kind == PREEMPT
    if warned and run.system.saves_when_warned:
        kept, end = steps + cut, run.t + c.stop_s
        run.totals["stop"] += c.stop_s
    else:
        kept = max([kept_before, *(s for at, s in saves if at <= run.t)])
        delay = 0.0 if fault is None or fault.kind == PREEMPT else (
            c.hang_detect_s if fault.kind == HANG else c.crash_detect_s)
        end = min(run.t + delay, start + c.stuck_end_s(run.system))
        run.totals["detection"] += end - run.t
    run.faults_hit += fault is not None
    if fault is not None:
        run.faults.pop(0)
    run.totals["redone"] += max(0.0, run.totals["compute"] - compute_before - (kept - kept_before) * c.step_s)
    if fault is None and kept == kept_before:
        raise GraceError(f"a job of {c.time_limit_s:g} s keeps no step: the chain never ends. HINT: a longer time "
                         "limit, a shorter restart, or more frequent saves")
    run.durable, run.t = min(kept, run.work_steps), end


def replay(costs: Costs, system: System, *, work_steps: int, faults: tuple[Fault, ...] = ()) -> Replay:
    """Replay a training of ``work_steps`` steps under ``faults``: its wall time and where it went."""
    if isinstance(work_steps, bool) or not isinstance(work_steps, int) or work_steps < 1:
        raise GraceError(f"work_steps {work_steps!r}: must be a whole number >= 1. HINT: the training's steps")
    run = _Run(costs=costs, system=system, work_steps=work_steps, faults=sorted(faults, key=lambda f: f.at_s))
    while run.durable < work_steps:
        _job(run)
    t = run.totals
    return Replay(work_s=work_steps * costs.step_s, wall_s=run.t, jobs=run.jobs, faults_hit=run.faults_hit,
                  compute_s=t["compute"], redone_s=t["redone"], blocked_s=t["blocked"], restart_s=t["restart"],
                  detection_s=t["detection"], stop_s=t["stop"])
