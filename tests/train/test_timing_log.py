"""The timing log (slurm_jit.timing): the summary across ranks and restarts, and its errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_jit import timing


def test_timing_log_summary_across_ranks_and_restarts(tmp_path: Path) -> None:
    for run_id in ("a", "b"):
        for rank in (0, 1):
            log = timing.TimingLog(tmp_path, rank, 2, run_id)
            for step in range(1, 11):
                log.step(step, 0.1 * step + rank)  # the first WARMUP_STEPS of each run are left out
            log.save(10, "jit", 2.0 + rank, 1000 * (rank + 1))
            log.evaluation(10, 1.5, aborted=False)
            log.close()
    summary = timing.load_summary(tmp_path)
    assert summary.n_runs == 2 and summary.world_sizes == frozenset({2})
    assert summary.n_steps == 2 * (10 - timing.WARMUP_STEPS)  # 2 runs; each step once, not once per rank
    assert summary.step_max_s == pytest.approx(2.0)
    assert summary.saves["jit"].max_dur_s == 3.0 and summary.saves["jit"].max_bytes == 2000
    assert summary.eval_max_s == 1.5


def test_timing_log_errors(tmp_path: Path) -> None:
    with pytest.raises(timing.TimingLogError, match="HINT"):
        timing.load_summary(tmp_path)
    path = timing.timing_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    good = json.dumps({"v": 1, "event": "step", "dur_s": 1.0, "rank": 0, "world_size": 1, "run_id": "x"})
    path.write_text(good + "\n" + good[:10])  # a last line cut short by a kill is tolerated
    assert timing.load_summary(tmp_path).n_steps == 1
    path.write_text("not json\n" + good + "\n")
    with pytest.raises(timing.TimingLogError, match=":1: not JSON"):
        timing.load_summary(tmp_path)
    path.write_text(json.dumps({"event": "step", "dur_s": -1}) + "\n")
    with pytest.raises(timing.TimingLogError, match="bad dur_s"):
        timing.load_summary(tmp_path)


def test_a_conversion_and_a_kept_batch_are_on_disk_before_the_first_step(tmp_path: Path) -> None:
    """Once per run, before its first step: a run SIGKILLed in its first steps (a time limit eaten by the
    conversion) must still leave them, for grace-calc's conversion estimate and status's accumulation line.
    Measured: a 2 -> 1 resume killed after its first step left neither (buffered); its rerun reused the
    conversion, so the timing log held no conversion at all."""
    log = timing.TimingLog(tmp_path, 0, 1, "run")
    log.conversion(step=5, dur_s=4.0, bytes=1176933, from_world_size=2)
    log.kept_batch({"from_world_size": 2, "to_world_size": 1, "accumulation_from": 1, "accumulation_to": 2,
                    "samples_per_step": 4})
    on_disk = [r["event"] for r in timing.read_records(tmp_path)]  # not closed: as a killed process leaves it
    assert on_disk == ["start", "convert", "batch"], on_disk
    log.close()
