"""The CI smoke run of the benchmarks: `tools/bench --quick` works and writes every row with its keys. Never a
time: benchmark numbers are reported, not asserted (STYLE.md: a benchmark asserted as a timed test is a defect)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

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
