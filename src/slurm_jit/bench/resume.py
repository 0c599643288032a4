"""Row 8: a resume, from process start to the first resumed step, against a fresh start of the same training;
and the load against the disk's read limit (reported) and against the raw read floor on tmpfs (issue #34's
target). The load is the difference of the two runs' times from ``train()``'s start (the timing log's ``start``
record, rank 0) to the end of their first step: imports and the model's construction, which a fresh start spends
more on (random initialisation) and which swing with the page cache, are left out; DeepSpeed's initialisation and
one step are in both."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_jit import timing
from slurm_jit.bench import floors, runs
from slurm_jit.bench.disk import MB, DiskLimits, drop_page_cache
from slurm_jit.bench.rows import NO_TARGET, Row, failed, measured, skipped
from slurm_jit.bench.save import JitSave, train_args

# Issue 10 held the load to 0.8 of the disk's read limit; issue #34 dropped that target (the disk here is a host
# cache): reported, and the read floor on tmpfs is the target.
LOAD_TARGET = NO_TARGET


@dataclass(frozen=True, kw_only=True)
class Resumed:
    """One resume of a JIT save's output directory, beside the fresh run that wrote it."""

    outcome: runs.Outcome
    resume_s: float  # process start to the first resumed step
    fresh_s: float  # process start to the fresh run's first step
    train_starts: list[float]  # rank 0's train() starts in the directory, oldest first (monotonic clock)
    first_step_s: list[float | None]  # the first step's own seconds after each of those starts (timing log)

    def load_s(self, fresh: runs.Outcome) -> float | None:
        """The resume's train() start to its first step less the fresh run's; None without both start records."""
        if len(self.train_starts) < 2 or self.outcome.first_step_at is None or fresh.first_step_at is None:
            return None
        return load_time_s(self.outcome.first_step_at - self.train_starts[-1],
                           fresh.first_step_at - self.train_starts[0])


def load_time_s(resume_train_to_first_step_s: float, fresh_train_to_first_step_s: float) -> float:
    """What a resume spends loading: its time from train()'s start to its first step over the fresh run's."""
    return resume_train_to_first_step_s - fresh_train_to_first_step_s


def resume(save: JitSave, model: runs.Model) -> Resumed | str:
    """Resume ``save``'s directory for one step; the resume, or why there is none to measure."""
    fresh = save.outcome
    if fresh.first_step_at is None:
        return "the fresh run logged no step"
    step = int(save.ckpt.name.rsplit("-", 1)[1])
    args = [*train_args(model, 2), "--resume", "--max-steps", str(step + 1)]
    outcome = runs.run(save.outcome.out, args, plan=None)
    if not outcome.clean or outcome.first_step_at is None:
        return f"resume ended {outcome.codes}"
    starts = _train_starts(save.outcome.out)
    return Resumed(outcome=outcome, resume_s=outcome.first_step_at - outcome.started,
                   fresh_s=fresh.first_step_at - fresh.started, train_starts=[t for t, _ in starts],
                   first_step_s=[s for _, s in starts])


def rows(save: JitSave, model: runs.Model, disk: DiskLimits) -> list[Row]:
    compares = ("ZeRO-2: process start to the first resumed step (page cache dropped) over process start to the "
                "first step of the fresh run that wrote the checkpoint")
    dropped = drop_page_cache()
    resumed = resume(save, model)
    if isinstance(resumed, str):
        return [failed("resume_over_fresh_start", "ratio", NO_TARGET, compares, resumed)]
    outcome, fresh = resumed.outcome, save.outcome
    cache = "page cache dropped" if dropped else "page cache NOT dropped (not root)"
    rows_ = [measured("resume_over_fresh_start", resumed.resume_s / resumed.fresh_s, "ratio", NO_TARGET,
                      f"{compares} ({cache})", resume_to_first_step_s=round(resumed.resume_s, 3),
                      fresh_to_first_step_s=round(resumed.fresh_s, 3))]
    load = resumed.load_s(fresh)
    if load is None:
        rows_.append(failed("resume_load_over_disk_read", "ratio", LOAD_TARGET, "load bandwidth",
                            f"the timing log has {len(resumed.train_starts)} start record(s) of rank 0, not the "
                            "fresh run's and the resume's"))
        return rows_
    if load <= 0:
        rows_.append(skipped("resume_load_over_disk_read", "ratio", LOAD_TARGET, "load bandwidth",
                             f"from train()'s start, the resume reached its first step no later than the fresh run "
                             f"({load:.2f} s): the load is lost in the noise"))
        return rows_
    assert outcome.first_step_at is not None and fresh.first_step_at is not None  # load_s said so
    load_bps = save.total_bytes / load
    rows_.append(measured(
        "resume_load_over_disk_read", load_bps / disk.read_bps, "ratio", LOAD_TARGET,
        "checkpoint bytes / (resume's time from train()'s start to its first step - the fresh run's) over the disk "
        f"read limit ({cache})",
        load_s=round(load, 3), load_mb_s=round(load_bps / MB, 1), disk_read_mb_s=round(disk.read_bps / MB, 1),
        resume_train_to_first_step_s=round(outcome.first_step_at - resumed.train_starts[-1], 3),
        fresh_train_to_first_step_s=round(fresh.first_step_at - resumed.train_starts[0], 3)))
    return rows_


def read_floor_row(save: JitSave, resumed: Resumed | str, floor_trials_s: list[float]) -> Row:
    """The load from tmpfs (op cache and imports warm in both runs: no page cache dropped) over the best of the
    raw read floor of the same files on tmpfs (issue #34's target)."""
    name = "resume_over_read_floor"
    compares = (f"ZeRO-2, output directory on tmpfs ({floors.TMPFS}): the resume's load (its time from train()'s "
                "start to its first step less the fresh run's, nothing dropped from the page cache) over the raw "
                f"floor: each rank's files of the checkpoint read by {save.world_size} threads at once, "
                f"best of {len(floor_trials_s)}")
    if isinstance(resumed, str):
        return failed(name, "ratio", floors.FLOOR_TARGET, compares, resumed)
    load = resumed.load_s(save.outcome)
    if load is None:
        return failed(name, "ratio", floors.FLOOR_TARGET, compares,
                      f"the timing log has {len(resumed.train_starts)} start record(s) of rank 0, not 2")
    assert resumed.outcome.first_step_at is not None and save.outcome.first_step_at is not None  # load_s said so
    floor_s = floors.best_of(floor_trials_s)
    details: dict[str, Any] = {
        "load_s": round(load, 4), "floor_s": round(floor_s, 4), "floor_trials_s": [round(t, 4) for t in floor_trials_s],
        "bytes": save.total_bytes,
        "resume_train_to_first_step_s": round(resumed.outcome.first_step_at - resumed.train_starts[-1], 4),
        "fresh_train_to_first_step_s": round(save.outcome.first_step_at - resumed.train_starts[0], 4),
        # the first step's own time: a fresh run's allocates Adam's moments, a resume's has them loaded
        "resume_first_step_s": _rounded(resumed.first_step_s[-1]),
        "fresh_first_step_s": _rounded(resumed.first_step_s[0]),
        "resume_to_first_step_s": round(resumed.resume_s, 3), "fresh_to_first_step_s": round(resumed.fresh_s, 3)}
    if load <= 0:
        return skipped(name, "ratio", floors.FLOOR_TARGET, compares,
                       f"the resume reached its first step no later than the fresh run ({load:.3f} s): the load is "
                       "lost in the noise", **details)
    return measured(name, floors.over_floor(load, floor_s), "ratio", floors.FLOOR_TARGET, compares, **details)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _train_starts(out: Path) -> list[tuple[float, float | None]]:
    """When rank 0's ``train()`` started in ``out``, oldest first (the log is appended per run), on this host's
    monotonic clock, as the step times (the log records wall time: converted with this host's offset between the
    two clocks, the same for every process); beside each, its first step's own seconds (None: no step logged)."""
    try:
        records = timing.read_records(out)
    except timing.TimingLogError:
        return []
    wall_minus_monotonic_s = time.time() - time.monotonic()
    starts: list[tuple[float, float | None]] = []
    for r in (r for r in records if r.get("rank") == 0):
        if r["event"] == "start" and isinstance(r.get("time"), int | float):
            starts.append((float(r["time"]) - wall_minus_monotonic_s, None))
        elif r["event"] == "step" and starts and starts[-1][1] is None and isinstance(r.get("dur_s"), int | float):
            starts[-1] = (starts[-1][0], float(r["dur_s"]))
    return starts
