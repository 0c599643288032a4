"""The CI smoke run of the benchmarks: `tools/bench --quick` works and writes every row with its keys. Never a
time: benchmark numbers are reported, not asserted (STYLE.md: a benchmark asserted as a timed test is a defect)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from slurm_jit.bench import floor_rows, floors
from slurm_jit.bench.cli import ROW_NAMES
from slurm_jit.bench.rows import NO_TARGET, REFERENCE, judge

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
QUICK_TIMEOUT_S = 600  # ~1-2 min on 2 idle cores (6 two-rank runs); a hang fails here, not the CI run
ROW_KEYS = {"name", "value", "unit", "target", "met", "compares"}


@pytest.mark.deepspeed
def test_bench_quick_writes_every_row(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run([str(BENCH), "--quick", "--out", str(out), "--work-dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=QUICK_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["name"] for r in rows] == list(ROW_NAMES)
    for row in rows:
        assert ROW_KEYS <= set(row), row
        assert row["met"] is None or isinstance(row["met"], bool), row
        if row["met"] is not None:  # a judged row: its verdict is its value against its target
            assert row["target"] not in (REFERENCE, NO_TARGET)
            assert row["met"] == judge(row["value"], row["target"]), row
    assert (out / "results.md").read_text().count("\n| `") == len(ROW_NAMES)
    assert not (tmp_path / "work").exists(), "the runs' directories are removed after the run"


@pytest.mark.deepspeed
def test_bench_only_save_resume_measures_the_floors_and_cleans_tmpfs(tmp_path: Path) -> None:
    """`--quick --only save,resume`: the floor rows measured (4 two-rank runs of the --quick model, ~1 min idle),
    every other row skipped, nothing left in tmpfs."""
    before = set(floors.TMPFS.glob("slurm-jit-bench-*"))
    out = tmp_path / "results"
    proc = subprocess.run([str(BENCH), "--quick", "--only", "save,resume", "--out", str(out)],
                          capture_output=True, text=True, timeout=QUICK_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert list(rows) == list(ROW_NAMES)
    assert not set(floors.TMPFS.glob("slurm-jit-bench-*")) - before, "tmpfs is cleaned up after each use"
    measured_rows = {floor_rows.ZERO2_SAVE_ROW, floor_rows.ZERO3_SAVE_ROW, floor_rows.DISK_SAVE_ROW,
                     floor_rows.DEEP_ROW, "disk_write", "save_bw_over_disk_zero2", "bytes_over_needed_zero2"}
    for name in measured_rows:
        assert rows[name]["value"] is not None and rows[name]["value"] > 0, rows[name]
    for name in (floor_rows.ZERO2_SAVE_ROW, floor_rows.ZERO3_SAVE_ROW):
        assert rows[name]["target"] == floors.FLOOR_TARGET and set(rows[name]["details"]["phases_s"]) >= {"write"}
    resumed = rows[floor_rows.RESUME_ROW]  # the --quick model's load can be below the noise: then said so
    assert resumed["value"] is not None or "lost in the noise" in resumed["note"], resumed
    not_run = set(ROW_NAMES) - measured_rows - {floor_rows.RESUME_ROW, "disk_read", "memory_peak_over_steady"}
    for name in not_run:
        assert rows[name]["note"] == "skipped: not run by `tools/bench --quick --only save,resume` (see --help)"
