"""The fault schedule of one ``tools/goodput`` run: the same instants, relative to the training's progress, for
every system.

One training of ``work_steps`` steps on ``world_size`` ranks, periodic saves every ``save_steps`` (the JitTrainer's
async snapshots every ``snapshot_steps``, a tenth), each job limited to ``time_limit_min`` with the warning
``signal_lead_s`` before it, and three faults besides the time limit:

* an unwarned SIGKILL of rank ``kill_rank`` at the end of step ``kill_at_step`` (an OOM, a lost node: no signal
  first), the first time a run reaches that step;
* a preemption (a job of the urgent partition) during the restart that follows the kill: the job is preempted
  while its ranks start, before their first step;
* a hang of rank ``hang_rank`` at the start of step ``hang_at_step`` (it blocks forever: only SIGKILL ends it),
  the first time a run reaches that step.

A fault fires once per chain (its marker file says it fired), whatever the steps a later run resumes from. The
steps and ranks are drawn from ``seed`` (:func:`make_schedule`) unless given. Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from typing import Any

WORLD_SIZE = 2  # two CPU ranks: the demo's training
SNAPSHOT_FRACTION = 10  # (c) snapshots every save_steps / 10 (issue #36: "every K/10 steps")
KILL_SPAN = (0.2, 0.4)  # the kill's step is drawn in this share of the training
HANG_SPAN = (0.55, 0.75)  # the hang's, later, so that the two land in different runs


class ScheduleError(ValueError):
    """A schedule that cannot run; the message says how to fix it."""


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """One run's training and faults; the same for every system."""

    seed: int  # draws the fault steps and ranks
    work_steps: int  # the training's length (max_steps)
    save_steps: int  # (a), (b): a periodic save every this many steps
    step_sleep_s: float  # demo_train --step-sleep: paces a step (the model alone takes ~25 ms here)
    time_limit_min: int  # every job's --time
    signal_lead_s: int  # N of --signal=...@N, the same for every system
    hang_timeout_s: float  # (c) JitConfig(hang_timeout_s=...): sized to the steps, as a careful user does
    kill_at_step: int  # rank kill_rank is SIGKILLed at the end of this step
    kill_rank: int
    hang_at_step: int  # rank hang_rank blocks forever at the start of this step (global_step == it)
    hang_rank: int
    preempt_after_kill: bool = True  # preempt the restart that follows the kill
    world_size: int = WORLD_SIZE

    def __post_init__(self) -> None:
        for name in ("work_steps", "save_steps", "time_limit_min", "signal_lead_s", "kill_at_step", "hang_at_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{name} {value!r}: must be a whole number >= 1. HINT: e.g. --kill-at-step 300")
        if not 0 < self.kill_at_step < self.work_steps:
            raise ScheduleError(f"kill at step {self.kill_at_step}: not inside the training's {self.work_steps} "
                                f"steps. HINT: --kill-at-step between 1 and {self.work_steps - 1}")
        if not 0 < self.hang_at_step < self.work_steps or self.hang_at_step == self.kill_at_step:
            raise ScheduleError(f"hang at step {self.hang_at_step}: must be inside the training's {self.work_steps} "
                                f"steps and not the kill's step ({self.kill_at_step}). HINT: another "
                                "--kill-at-step, or another --seed")
        for name in ("kill_rank", "hang_rank"):
            if not 0 <= getattr(self, name) < self.world_size:
                raise ScheduleError(f"{name} {getattr(self, name)!r}: not a rank of {self.world_size}. HINT: 0 to "
                                    f"{self.world_size - 1}")
        if self.signal_lead_s >= self.time_limit_min * 60:
            raise ScheduleError(f"signal lead {self.signal_lead_s} s >= the time limit. HINT: a longer time limit")
        if not self.step_sleep_s >= 0 or not self.hang_timeout_s > 0:
            raise ScheduleError("step sleep must be >= 0 and the hang timeout > 0. HINT: seconds, e.g. 0.1 and 20")

    @property
    def snapshot_steps(self) -> int:
        """(c)'s async snapshot interval."""
        return max(1, self.save_steps // SNAPSHOT_FRACTION)

    def faults(self) -> dict[str, Any]:
        """What the training's probe reads (``faults.json``): the in-process faults."""
        return {"kill": {"step": self.kill_at_step, "rank": self.kill_rank},
                "hang": {"step": self.hang_at_step, "rank": self.hang_rank}}

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def describe(self) -> str:
        """One line for the report."""
        return (f"seed {self.seed}: {self.work_steps} steps on {self.world_size} ranks, --time {self.time_limit_min} "
                f"(warning {self.signal_lead_s} s before), SIGKILL of rank {self.kill_rank} after step "
                f"{self.kill_at_step}, " + ("the restart after it preempted, " if self.preempt_after_kill else "")
                + f"rank {self.hang_rank} hangs at step {self.hang_at_step}")


# The full run: ~4 minutes uninterrupted here (1800 steps of ~0.125 s and the start), so that --time 3 cuts it;
# --quick: ~1 minute, the time limit never reached (its faults only).
FULL = {"work_steps": 1800, "save_steps": 100, "step_sleep_s": 0.1, "time_limit_min": 3, "signal_lead_s": 30,
        "hang_timeout_s": 20.0}
QUICK = {**FULL, "work_steps": 400}


def make_schedule(seed: int, *, quick: bool = False, kill_at_step: int | None = None,
                  **overrides: Any) -> Schedule:
    """The schedule of ``seed``: FULL's (or QUICK's) training, the fault steps and ranks drawn from the seed
    unless given (``kill_at_step``; ``overrides``: any other field)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ScheduleError(f"seed {seed!r}: must be a whole number. HINT: e.g. --seed 1")
    base = {**(QUICK if quick else FULL), **overrides}
    work = base["work_steps"]
    if isinstance(work, bool) or not isinstance(work, int) or work < 10:
        raise ScheduleError(f"work_steps {work!r}: too short for a schedule. HINT: 10 steps or more")
    rng = random.Random(seed)
    kill = rng.randint(round(KILL_SPAN[0] * work), round(KILL_SPAN[1] * work))
    hang = rng.randint(round(HANG_SPAN[0] * work), round(HANG_SPAN[1] * work))
    ranks = {"kill_rank": rng.randrange(WORLD_SIZE), "hang_rank": rng.randrange(WORLD_SIZE)}
    fields = {"kill_at_step": kill if kill_at_step is None else kill_at_step, "hang_at_step": hang, **ranks}
    return Schedule(seed=seed, **{**fields, **base})
