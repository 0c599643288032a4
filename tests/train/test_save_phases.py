"""Each save's timing record says where its seconds went (train/save_path.py SAVE_PHASES): every phase, in order,
adding up to the save's duration; read from a real JitTrainer ZeRO-2 run's timing logs (both ranks, two saves)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from slurm_jit import timing
from slurm_jit.train.save_path import SAVE_PHASES


def test_every_save_record_has_its_phases_in_order(jit_zero2_run: Path) -> None:
    saves = [r for r in timing.read_records(jit_zero2_run) if r["event"] == "save"]
    assert sorted((r["rank"], r["step"]) for r in saves) == [(0, 3), (0, 6), (1, 3), (1, 6)], saves
    for record in saves:
        phases = record["phases"]
        assert list(phases) == list(SAVE_PHASES), record
        assert all(math.isfinite(s) and s >= 0 for s in phases.values()), record
        # the phases are the save's seconds from the sentinel on; only the watchdog's feed comes before
        assert sum(phases.values()) == pytest.approx(record["dur_s"], abs=0.01), record
        assert phases["write"] > 0, record  # torch.save of the shards cannot take no time


def test_a_record_without_phases_reads_as_before(tmp_path: Path) -> None:
    log = timing.TimingLog(tmp_path, rank=0, world_size=1, run_id="r")
    log.save(3, "periodic", 0.5, 100)
    log.close()
    (record,) = [r for r in timing.read_records(tmp_path) if r["event"] == "save"]
    assert "phases" not in record and record["dur_s"] == 0.5
