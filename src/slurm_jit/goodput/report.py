"""Where one system's allocation time went: goodput, and every end of a run split into its costs (pure).

Inputs: the chain's runs (:class:`~.chain.Chain`: Slurm's allocations), the probe's events (:mod:`.probe`), the
uninterrupted reference's allocation, the final weights' digests. Definitions:

* **goodput** = the uninterrupted run's allocation (its own start-up, saves and end included) over the chain's
  allocations summed (the queue between them is not allocated: it is reported, not counted);
* each run that did not end the training ends at an **event**: the kill, the hang, the preemption (the urgent
  job's submission), else its last step (the time limit's warning, a crash). Its cost is split into
  **redone** (the steps after the one the next run resumed from: from that step's end, or from the run's first
  step when it kept nothing, until the event), **detection** (the event until the allocation ended: a dead or hung
  rank noticed, a warned stop's save and exit, the requeue's kill) and the next run's **restart**: the queue (not
  allocated), launch (allocation start until the rank's process exists: prolog, batch script, srun), imports,
  engine (model, Trainer, DeepSpeed initialised: ``on_train_begin``), load (the checkpoint, until the first step
  begins) and the first step's excess over a typical step;
* the split is checked against the measured loss, the chain's allocations minus the uninterrupted one: they differ
  by the noise of step and start-up times between runs. The **matched loss** takes out the part of that noise the
  faults do not touch: the uninterrupted run's start-up (allocation start until its first step begins) and end
  (its last step until the allocation ended), which are not a fault's cost, are swapped for the chain's first
  run's start-up and last run's end (a reference started on a busier host than the chain, or the reverse, moves
  the loss, not the split).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from slurm_jit.goodput.chain import Chain, Run

KILL, HANG, PREEMPT, TIME_LIMIT, CRASH, FINISHED, CANCELLED = (
    "kill", "hang", "preempt", "time limit", "crash", "finished", "cancelled")
SLURM_SIGNAL_EARLY_S = 60  # sbatch(1): --signal "may be sent up to 60 seconds earlier than specified"
RESTART_PARTS = ("launch", "imports", "engine", "load", "first_step")


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """One run's allocation and what its ranks recorded (wall times)."""

    run: Run
    milestones: dict[str, float]  # rank 0's: start (process), imports, train_begin, first_step
    resumed_at: int | None  # the step the run resumed after (0: a fresh start), from its first step's begin
    steps: list[tuple[int, float]]  # rank 0's step ends
    faults: dict[str, tuple[int, float]]  # kill / hang fired in this run: (step, time)

    @property
    def alloc_s(self) -> float:
        return (self.run.end or self.run.start) - self.run.start

    @property
    def last_step(self) -> int | None:
        return self.steps[-1][0] if self.steps else None

    @property
    def startup_s(self) -> float | None:
        """The allocation's start until the first step began (None: no step began)."""
        first = self.milestones.get("first_step")
        return None if first is None or not self.steps else first - self.run.start

    @property
    def end_s(self) -> float | None:
        """The last step's end until the allocation ended (None: no step, or the run has not ended)."""
        return None if not self.steps or self.run.end is None else self.run.end - self.steps[-1][1]


@dataclass(frozen=True, kw_only=True)
class EndCost:
    """One run's end before the training's end, and what it cost."""

    run: int  # index in the chain
    kind: str
    last_step: int | None  # the newest step this run finished
    kept_step: int | None  # the step the next run resumed after (None: no next run)
    redone_steps: int
    redone_s: float
    detection_s: float
    restart: dict[str, float]  # the next run's RESTART_PARTS, seconds in its allocation (missing: not reached)
    queue_s: float | None  # the next run's wait for its allocation (not allocated)

    @property
    def restart_s(self) -> float:
        return sum(self.restart.values())

    @property
    def total_s(self) -> float:
        """In the allocation: redone, detection, the next run's restart."""
        return self.redone_s + self.detection_s + self.restart_s


@dataclass(frozen=True, kw_only=True)
class SystemReport:
    key: str
    finished: bool
    outcome: str
    uninterrupted_s: float
    allocation_s: float
    wall_s: float  # the first allocation's start until the last one's end (queues included)
    queue_s: float
    jobs: int  # job ids submitted
    runs: int
    steps_done: int  # the newest step reached
    steps_computed: int  # every step run, redone ones included
    steps_redone: int
    step_s: float  # the median step
    ends: list[EndCost] = field(default_factory=list)
    weights_equal: bool | None = None  # final weights == the uninterrupted run's (sha256); None: no final state

    work_steps: int = 0  # the training's length
    # (chain's, reference's) first run's start-up and last run's end, where both are known (see matched_loss_s)
    startup_s: tuple[float, float] | None = None
    end_s: tuple[float, float] | None = None
    step_pace_s: tuple[float, float] | None = None  # (chain's, reference's) mean step gap (see paced_goodput)
    kept_steps: int | None = None  # a chain that did not finish: the step its next run would resume after

    @property
    def goodput(self) -> float:
        """Uninterrupted allocation over the chain's; a chain that did not finish counts the share of the work it
        kept (the step its next run would resume after; where unknown, the newest step it reached)."""
        achieved = self.steps_done if self.kept_steps is None else self.kept_steps
        share = 1.0 if self.finished else min(1.0, achieved / max(1, self.work_steps))
        return min(1.0, self.uninterrupted_s * share / self.allocation_s) if self.allocation_s > 0 else 0.0

    @property
    def paced_goodput(self) -> float | None:
        """The goodput with the uninterrupted run put at the chain's own pace: its start-up and end swapped for the
        chain's (as :attr:`matched_loss_s`) and each of its steps after the first at the chain's mean step gap; None
        where a pair is unknown (a chain that did not finish has no last end). A reference that ran on a busier (or
        calmer) host than its chain moves :attr:`goodput`, not this: the two side by side show how much of a goodput
        is the host. Not clamped: above 1 says the pace's noise outweighs the faults."""
        if self.startup_s is None or self.end_s is None or self.step_pace_s is None or self.allocation_s <= 0:
            return None
        (start, ref_start), (end, ref_end), (step, ref_step) = self.startup_s, self.end_s, self.step_pace_s
        paced = self.uninterrupted_s + (start - ref_start) + (end - ref_end) + max(0, self.work_steps - 1) * (
            step - ref_step)
        return paced / self.allocation_s

    @property
    def loss_s(self) -> float:
        return self.allocation_s - self.uninterrupted_s

    @property
    def split_s(self) -> float:
        return sum(e.total_s for e in self.ends)

    @property
    def matched_loss_s(self) -> float:
        """The loss with the uninterrupted run's start-up and end swapped for the chain's first start-up and last
        end (no fault's cost; where unknown, as measured): the figure the split should match."""
        if self.startup_s is None or self.end_s is None:
            return self.loss_s
        (start, ref_start), (end, ref_end) = self.startup_s, self.end_s
        return self.loss_s + (ref_start - start) + (ref_end - end)


def run_facts(run: Run, events: Iterable[dict[str, Any]]) -> RunFacts:
    """``events`` (every rank's) narrowed to ``run``'s job id and restart."""
    mine = [e for e in events if str(e.get("job")) == run.job and int(e.get("restart", -1)) == run.restart]
    milestones: dict[str, float] = {}
    resumed_at, steps, faults = None, [], {}
    for e in sorted(mine, key=lambda e: float(e["t"])):
        kind, t = e.get("event"), float(e["t"])
        if e.get("rank") == 0 and kind in ("start", "imports", "train_begin", "first_step"):
            milestones.setdefault(str(kind), float(e.get("t_process", t)) if kind == "start" else t)
            if kind == "first_step" and resumed_at is None:
                resumed_at = int(e["step"])
        elif kind == "step" and e.get("rank") == 0:
            steps.append((int(e["step"]), t))
        elif kind in (KILL, HANG):
            faults[str(kind)] = (int(e["step"]), t)
    return RunFacts(run=run, milestones=milestones, resumed_at=resumed_at, steps=steps, faults=faults)


def _step_gaps(runs: Sequence[RunFacts]) -> list[float]:
    return [b[1] - a[1] for r in runs for a, b in pairwise(r.steps) if b[0] == a[0] + 1]


def median_step_s(runs: Sequence[RunFacts]) -> float:
    gaps = _step_gaps(runs)
    return statistics.median(gaps) if gaps else 0.0


def mean_step_s(runs: Sequence[RunFacts]) -> float:
    """The pace: a step's mean gap, the saves' blocked time included (a busy host slows them too)."""
    gaps = _step_gaps(runs)
    return statistics.fmean(gaps) if gaps else 0.0


def end_kind(facts: RunFacts, chain: Chain, limit_s: float, lead_s: float) -> str:
    if HANG in facts.faults:
        return HANG
    if KILL in facts.faults:
        return KILL
    end = facts.run.end or facts.run.start
    if chain.preempt is not None and facts.run.start <= chain.preempt[0] <= end:
        return PREEMPT
    if facts.run.state == "CANCELLED":
        return CANCELLED
    return TIME_LIMIT if facts.alloc_s >= limit_s - lead_s - SLURM_SIGNAL_EARLY_S else CRASH


def event_time(facts: RunFacts, kind: str, chain: Chain) -> float:
    """When the run's end began: the fault, the preemption, else its last step's end (or its start)."""
    if kind in facts.faults:
        return facts.faults[kind][1]
    if kind == PREEMPT and chain.preempt is not None:
        return chain.preempt[0]
    return facts.steps[-1][1] if facts.steps else facts.run.start


def restart_parts(facts: RunFacts, step_s: float, cut_at: float | None = None) -> dict[str, float]:
    """The run's start-up, part by part, each ended at ``cut_at`` at the latest (a run preempted in it)."""
    m, parts, previous = facts.milestones, {}, facts.run.start
    cut = cut_at if cut_at is not None else float("inf")
    for part, milestone in zip(RESTART_PARTS[:-1], ("start", "imports", "train_begin", "first_step"), strict=True):
        if milestone not in m or previous >= cut:
            break
        parts[part] = max(0.0, min(m[milestone], cut) - previous)
        previous = m[milestone]
    if "first_step" in m and facts.steps and facts.steps[0][1] <= cut:
        parts["first_step"] = max(0.0, facts.steps[0][1] - m["first_step"] - step_s)
    elif previous < cut < float("inf"):  # cut in the middle of a part: the rest of the start-up until the event
        parts[RESTART_PARTS[len(parts)]] = cut - previous
    return parts


def redone(facts: RunFacts, kept: int | None, event_t: float) -> tuple[int, float]:
    """(steps, seconds) this run computed that the next one does again."""
    last = facts.last_step
    if last is None or kept is None or last <= kept:
        return 0, 0.0
    lost_from = next((t for s, t in facts.steps if s == kept), None)
    if lost_from is None:  # nothing of this run was kept: from its first step's begin
        lost_from = facts.milestones.get("first_step", facts.steps[0][1])
    return last - kept, max(0.0, event_t - lost_from)


def analyse(chain: Chain, events: Sequence[dict[str, Any]], *, uninterrupted_s: float, work_steps: int,
            limit_s: float, lead_s: float, weights_equal: bool | None,
            reference: RunFacts | None = None, kept_steps: int | None = None) -> SystemReport:
    """The report of one system's chain (``reference``: the uninterrupted run's facts, for the matched loss;
    ``kept_steps``: for a chain that did not finish, the step its checkpoints would resume it after)."""
    runs = [run_facts(r, events) for r in chain.runs if r.end is not None]
    step_s = median_step_s(runs)
    ends: list[EndCost] = []
    last = len(runs) - 1 if chain.finished else len(runs)
    for i in range(last):
        ends.append(_end_cost(i, runs, chain, step_s, limit_s, lead_s))
    done = max((s for r in runs for s, _ in r.steps), default=0)
    allocation = sum(r.alloc_s for r in runs)
    queue = sum(b.run.start - (a.run.end or a.run.start) for a, b in pairwise(runs))
    return SystemReport(
        key=chain.key, finished=chain.finished, outcome=chain.outcome, uninterrupted_s=uninterrupted_s,
        allocation_s=allocation, wall_s=(runs[-1].run.end or 0.0) - runs[0].run.start if runs else 0.0,
        queue_s=queue, jobs=len(chain.submits), runs=len(runs), steps_done=done,
        steps_computed=sum(len(r.steps) for r in runs), steps_redone=sum(e.redone_steps for e in ends),
        step_s=step_s, ends=ends, weights_equal=weights_equal, work_steps=work_steps,
        startup_s=_pair(runs[0].startup_s if runs else None, reference.startup_s if reference else None),
        end_s=_pair(runs[-1].end_s if runs and chain.finished else None, reference.end_s if reference else None),
        step_pace_s=_pair(mean_step_s(runs) or None, (mean_step_s([reference]) or None) if reference else None),
        kept_steps=None if chain.finished else kept_steps)


def _pair(mine: float | None, ref: float | None) -> tuple[float, float] | None:
    return None if mine is None or ref is None else (mine, ref)


def _end_cost(i: int, runs: Sequence[RunFacts], chain: Chain, step_s: float, limit_s: float,
              lead_s: float) -> EndCost:
    facts = runs[i]
    kind = end_kind(facts, chain, limit_s, lead_s)
    event_t = event_time(facts, kind, chain)
    following = runs[i + 1] if i + 1 < len(runs) else None
    kept = next((r.resumed_at for r in runs[i + 1:] if r.resumed_at is not None), None)
    steps_redone, redone_s = redone(facts, kept, event_t)
    restart: dict[str, float] = {}
    if following is not None:  # a next run ended in its start-up: its restart until that end's event
        cut = None if following.steps else event_time(following, end_kind(following, chain, limit_s, lead_s), chain)
        restart = restart_parts(following, step_s, cut)
    detection = (facts.run.end or event_t) - event_t
    return EndCost(run=i, kind=kind, last_step=facts.last_step, kept_step=kept, redone_steps=steps_redone,
                   redone_s=redone_s, detection_s=max(0.0, detection), restart=restart,
                   queue_s=None if following is None else following.run.start - (facts.run.end or facts.run.start))
