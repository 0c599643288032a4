"""Row 8: a resume, from process start to the first resumed step, against a fresh start of the same training;
and the load's bandwidth against the disk's read limit. The load is the difference of the two runs' times from
``train()``'s start (the timing log's ``start`` record, rank 0) to the end of their first step: imports and the
model's construction, which a fresh start spends more on (random initialisation) and which swing with the page
cache, are left out; DeepSpeed's initialisation and one step are in both."""

from __future__ import annotations

import time
from pathlib import Path

from slurm_jit import timing
from slurm_jit.bench import runs
from slurm_jit.bench.disk import MB, DiskLimits, drop_page_cache
from slurm_jit.bench.rows import NO_TARGET, Row, failed, measured, skipped
from slurm_jit.bench.save import JitSave, train_args

LOAD_TARGET = ">= 0.8"  # as --deep: reading a checkpoint back should run near the disk's read limit


def rows(save: JitSave, model: runs.Model, disk: DiskLimits) -> list[Row]:
    compares = ("ZeRO-2: process start to the first resumed step (page cache dropped) over process start to the "
                "first step of the fresh run that wrote the checkpoint")
    fresh = save.outcome
    if fresh.first_step_at is None:
        return [failed("resume_over_fresh_start", "ratio", NO_TARGET, compares, "the fresh run logged no step")]
    step = int(save.ckpt.name.rsplit("-", 1)[1])
    dropped = drop_page_cache()
    args = [*train_args(model, 2), "--resume", "--max-steps", str(step + 1)]
    outcome = runs.run(save.outcome.out, args, plan=None)
    if not outcome.clean or outcome.first_step_at is None:
        return [failed("resume_over_fresh_start", "ratio", NO_TARGET, compares, f"resume ended {outcome.codes}")]
    resume_s = outcome.first_step_at - outcome.started
    fresh_s = fresh.first_step_at - fresh.started
    cache = "page cache dropped" if dropped else "page cache NOT dropped (not root)"
    rows_ = [measured("resume_over_fresh_start", resume_s / fresh_s, "ratio", NO_TARGET, f"{compares} ({cache})",
                      resume_to_first_step_s=round(resume_s, 3), fresh_to_first_step_s=round(fresh_s, 3))]
    starts = _train_starts(save.outcome.out)
    if len(starts) < 2:
        rows_.append(failed("resume_load_over_disk_read", "ratio", LOAD_TARGET, "load bandwidth",
                            f"the timing log has {len(starts)} start record(s) of rank 0, not the fresh run's and "
                            "the resume's"))
        return rows_
    load_s = (outcome.first_step_at - starts[-1]) - (fresh.first_step_at - starts[0])
    if load_s <= 0:
        rows_.append(skipped("resume_load_over_disk_read", "ratio", LOAD_TARGET, "load bandwidth",
                             f"from train()'s start, the resume reached its first step no later than the fresh run "
                             f"({load_s:.2f} s): the load is lost in the noise"))
        return rows_
    load_bps = save.total_bytes / load_s
    rows_.append(measured(
        "resume_load_over_disk_read", load_bps / disk.read_bps, "ratio", LOAD_TARGET,
        "checkpoint bytes / (resume's time from train()'s start to its first step - the fresh run's) over the disk "
        f"read limit ({cache})",
        load_s=round(load_s, 3), load_mb_s=round(load_bps / MB, 1), disk_read_mb_s=round(disk.read_bps / MB, 1),
        resume_train_to_first_step_s=round(outcome.first_step_at - starts[-1], 3),
        fresh_train_to_first_step_s=round(fresh.first_step_at - starts[0], 3)))
    return rows_


def _train_starts(out: Path) -> list[float]:
    """When rank 0's ``train()`` started in ``out``, oldest first (the log is appended per run), on this host's
    monotonic clock, as the step times (the log records wall time: converted with this host's offset between the
    two clocks, the same for every process)."""
    try:
        records = timing.read_records(out)
    except timing.TimingLogError:
        return []
    wall_minus_monotonic_s = time.time() - time.monotonic()
    return [float(r["time"]) - wall_minus_monotonic_s for r in records
            if r["event"] == "start" and r.get("rank") == 0 and isinstance(r.get("time"), int | float)]
