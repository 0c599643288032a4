"""Row 8: a resume, from process start to the first resumed step, against a fresh start of the same training;
the difference is the load, whose bandwidth is held against the disk's read limit."""

from __future__ import annotations

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
    load_s = resume_s - fresh_s
    cache = "page cache dropped" if dropped else "page cache NOT dropped (not root)"
    rows_ = [measured("resume_over_fresh_start", resume_s / fresh_s, "ratio", NO_TARGET, f"{compares} ({cache})",
                      resume_to_first_step_s=round(resume_s, 3), fresh_to_first_step_s=round(fresh_s, 3))]
    if load_s <= 0:
        rows_.append(skipped("resume_load_over_disk_read", "ratio", LOAD_TARGET, "load bandwidth",
                             f"the resume reached its first step no later than the fresh start ({load_s:.2f} s): "
                             "the load is lost in the noise"))
        return rows_
    load_bps = save.total_bytes / load_s
    rows_.append(measured(
        "resume_load_over_disk_read", load_bps / disk.read_bps, "ratio", LOAD_TARGET,
        f"checkpoint bytes / (resume's time to first step - fresh start's) over the disk read limit ({cache})",
        load_s=round(load_s, 3), load_mb_s=round(load_bps / MB, 1), disk_read_mb_s=round(disk.read_bps / MB, 1)))
    return rows_
