"""grace-calc counts steps, not steps x ranks: every rank writes its own record of a step, and the sample counts
(and the step the stop waits for, the slowest rank's) are per step."""

from __future__ import annotations

import json
from pathlib import Path

from grace_helpers import grace_calc

from slurm_jit import timing


def _two_rank_run(out: Path, steps: int) -> None:
    """The real writer, as a 2-rank run writes it: one file per rank, one record per rank per step."""
    for rank in (0, 1):
        log = timing.TimingLog(out, rank=rank, world_size=2, run_id="r1")
        for step in range(1, steps + 1):
            log.step(step, 0.5 + 0.25 * rank)  # rank 1 is the slower one
        log.evaluation(steps, 1.0, aborted=False)
        log.save(steps, "jit", 2.0, 1000)
        log.close()


def test_a_400_step_2_rank_run_is_398_steps_not_796(tmp_path: Path) -> None:
    _two_rank_run(tmp_path, 400)
    proc = grace_calc("--from", str(tmp_path), "--no-slurm", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    step = next(t for t in out["terms"] if t["name"] == "step")
    measured = 400 - timing.WARMUP_STEPS
    assert f"max of {measured} steps over 1 run" in step["source"], step["source"]
    assert step["seconds"] == 0.75  # the slowest rank's step
    assert out["samples"]["steps"] == measured and out["samples"]["evals"] == 1


def test_the_summary_counts_each_step_once_per_run(tmp_path: Path) -> None:
    _two_rank_run(tmp_path, 10)
    summary = timing.load_summary(tmp_path)
    assert summary.n_steps == 10 - timing.WARMUP_STEPS and summary.n_evals == 1
    (stats,) = summary.steps_by_mode.values()
    assert (stats.n, stats.max_s) == (10 - timing.WARMUP_STEPS, 0.75)
