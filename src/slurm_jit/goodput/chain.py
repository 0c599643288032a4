"""One system's chain of jobs on Slurm, watched until the training's end or the budget: its allocations.

The watcher polls ``scontrol show job`` (through :mod:`slurm_jit.slurm`; the local cluster keeps no accounting,
so there is no ``sacct``) every :data:`POLL_S`: a run is one allocation of a job id (a requeue starts another run
of the same id), from Slurm's ``StartTime`` until the first poll that finds the job no longer holding its node
(``RUNNING``, ``CONFIGURING``, ``COMPLETING``). It acts twice, as the schedule and an attentive user would:

* the preemption: once the kill has fired (the probe's marker), the first run that starts after it is preempted at
  once by a job of the urgent partition (:func:`~.systems.preempt`): it lands during that run's start-up;
* a resubmission: a job that has ended (settled for :data:`SETTLE_S`) before the training's end is submitted again
  on the same output directory (a crash that the recipe does not requeue, a time limit the job did not survive).

A chain that has not ended after its budget is cancelled (only its own jobs) and counted as what it achieved.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from slurm_jit import slurm
from slurm_jit.goodput import systems
from slurm_jit.goodput.schedule import Schedule

logger = logging.getLogger(__name__)

POLL_S = 0.5  # the precision of a run's end (Slurm's StartTime: 1 s)
SETTLE_S = 5.0  # an ended state must hold this long before a resubmission (a preempted job passes through states)
HOLDING = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "SIGNALING"})
STARTED = frozenset({"RUNNING", "CONFIGURING"})  # only these open a run (seen: COMPLETING with Restarts + 1)
CANCEL_WAIT_S = 120.0  # after scancel: KillWait 30 s and the epilog, on a loaded host
SLURM_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"


@dataclass(kw_only=True)
class Run:
    """One allocation: a job id's run (restart count) from its start to its end, wall times."""

    job: str
    restart: int
    start: float
    end: float | None = None
    state: str = ""  # the job's state when the run ended (PENDING after a requeue, FAILED, COMPLETED, ...)


@dataclass(kw_only=True)
class Chain:
    """What the watcher saw: every run, every submission, the preemption, how the chain ended."""

    key: str
    reference: bool
    started: float
    ended: float = 0.0
    runs: list[Run] = field(default_factory=list)
    submits: list[tuple[float, str]] = field(default_factory=list)  # (wall time, job id)
    preempt: tuple[float, str] | None = None  # (wall time of the urgent job's submission, its job id)
    finished: bool = False  # the training reached its last step (final-state.json says so)
    outcome: str = ""  # one line: finished, budget spent, resubmission refused

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Chain:
        runs = [Run(**r) for r in data.get("runs", [])]
        preempt = data.get("preempt")
        return cls(**{**data, "runs": runs, "submits": [tuple(s) for s in data.get("submits", [])],
                      "preempt": tuple(preempt) if preempt else None})


def slurm_time(value: str) -> float | None:
    """A ``scontrol show job`` time (local time, 1 s) as a wall time; None for Unknown/None."""
    try:
        return datetime.strptime(value, SLURM_TIME_FORMAT).timestamp()
    except ValueError:
        return None


def _look(job: str) -> tuple[str | None, int, float | None]:
    """(state or None when Slurm no longer knows the job, restart count, StartTime)."""
    try:
        info = slurm.show_job(job)
    except slurm.SlurmError as exc:
        if slurm.UNKNOWN_JOB in str(exc):
            return None, 0, None
        raise
    return slurm.job_state(info), int(info.get("Restarts", "0") or 0), slurm_time(info.get("StartTime", ""))


@dataclass(kw_only=True)
class Watch:
    """The watcher's state over one chain."""

    chain: Chain
    paths: systems.Paths
    schedule: Schedule
    submit: Callable[[], str]
    budget_s: float
    job: str = ""
    open_run: Run | None = None
    ended_since: float | None = None

    def close(self, now: float, state: str) -> None:
        if self.open_run is not None:
            self.open_run.end, self.open_run.state = now - POLL_S / 2, state
            self.open_run = None

    def poll(self, now: float) -> None:
        state, restart, start = _look(self.job)
        if state in HOLDING:
            run = self.open_run
            if state not in STARTED:  # COMPLETING after a requeue shows the next restart count: the old run's tail
                if run is None and self.chain.runs and self.chain.runs[-1].job == self.job:
                    self.chain.runs[-1].end = now - POLL_S / 2
            elif run is None or (run.job, run.restart) != (self.job, restart):
                begun = start if start and start <= now else now
                self.close(min(now, begun + POLL_S / 2), "REQUEUED")  # a gap between two polls: ended by then
                self.open_run = Run(job=self.job, restart=restart, start=begun)
                self.chain.runs.append(self.open_run)
                self.maybe_preempt(now)
            self.ended_since = None
            return
        self.close(now, state or "GONE")
        if state is None or state in slurm.ENDED_STATES:
            self.ended_since = self.ended_since or now
        else:
            self.ended_since = None

    def maybe_preempt(self, now: float) -> None:
        fired = self.paths.events / "fired-kill"
        if self.chain.reference or not self.schedule.preempt_after_kill or self.chain.preempt is not None:
            return
        if fired.exists() and self.open_run is not None and self.open_run.start >= fired.stat().st_mtime - 1:
            self.chain.preempt = (time.time(), systems.preempt(self.job))
            logger.info("goodput: run %s.%s preempted during its restart", self.job, self.open_run.restart)

    def resubmit(self, now: float) -> bool:
        try:
            self.job = self.submit()
        except systems.SubmitError as exc:
            self.chain.outcome = f"resubmission refused: {exc}"
            return False
        self.chain.submits.append((now, self.job))
        self.ended_since = None
        return True


def watch(key: str, schedule: Schedule, paths: systems.Paths, *, reference: bool, budget_s: float,
          submit: Callable[[], str] | None = None) -> Chain:
    """Submit system ``key`` and follow its chain until the training's end, a refusal, or ``budget_s``."""
    chain = Chain(key=key, reference=reference, started=time.time())
    w = Watch(chain=chain, paths=paths, schedule=schedule, budget_s=budget_s,
              submit=submit or (lambda: systems.submit(key, schedule, paths, reference=reference)))
    if not w.resubmit(chain.started):
        chain.ended = time.time()
        return chain
    while True:
        now = time.time()
        w.poll(now)
        settled = w.ended_since is not None and now - w.ended_since >= SETTLE_S
        if settled and systems.finished(paths, schedule.work_steps):
            chain.finished, chain.outcome = True, "finished"
            break
        if now - chain.started > budget_s:
            chain.outcome = f"budget of {budget_s:.0f} s spent: stopped, counted as what it achieved"
            _cancel(w, now)
            break
        if settled and not w.resubmit(now):
            break
        time.sleep(POLL_S)
    chain.ended = time.time()
    _cancel_preemptor(chain)
    return chain


def _cancel(w: Watch, now: float) -> None:
    """scancel this chain's job (ours) and wait until it no longer holds the node."""
    if slurm.live_state(w.job) is None:
        return
    slurm.cancel(w.job)
    deadline = time.time() + CANCEL_WAIT_S
    while time.time() < deadline and slurm.live_state(w.job) is not None:
        w.poll(time.time())
        time.sleep(POLL_S)
    w.close(time.time(), "CANCELLED")


def _cancel_preemptor(chain: Chain) -> None:
    if chain.preempt is not None and chain.preempt[1].isdigit() and slurm.live_state(chain.preempt[1]) is not None:
        slurm.cancel(chain.preempt[1])


def save(chain: Chain, path: Path) -> None:
    path.write_text(json.dumps(chain.to_json(), indent=1), encoding="utf-8")


def load(path: Path) -> Chain:
    return Chain.from_json(json.loads(path.read_text(encoding="utf-8")))
