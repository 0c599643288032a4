"""``tools/faults --quick`` (the CI subset of the fault-injection suite): every row passes with 0 false "complete"
and 0 lost steps, and writes results.json as documented. Real DeepSpeed ranks on 2 CPU ranks, real mounts (root):
about 4-6 minutes on 2 cores under load (8-9 two-rank launches), one test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_jit.faults import common, runner

ROOT = Path(__file__).resolve().parents[2]
QUICK_TIMEOUT_S = 1500  # a hang detector: the quick run takes 4-6 min on a loaded 2-core host
QUICK_ROWS = {"random SIGKILL mid-save", "disk full during a save", "read-only output directory",
              "corruption of a complete checkpoint", "races: lock and requeue after durability",
              "security: no unpickling to check"}


@pytest.mark.deepspeed
@pytest.mark.timeout(QUICK_TIMEOUT_S)
@pytest.mark.skipif(os.geteuid() != 0, reason="the disk-full and read-only rows mount tmpfs: root only")
def test_tools_faults_quick_passes_every_row(tmp_path: Path) -> None:
    proc = subprocess.Popen([str(ROOT / "tools" / "faults"), "--quick", "--out", str(tmp_path / "results")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=QUICK_TIMEOUT_S - 120)
    finally:  # a hang: SIGTERM first, so that the harness unmounts its tmpfs and kills its ranks (SIGKILL cannot)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            finally:
                proc.kill()
                proc.wait()
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    rows = results["rows"]
    assert {r["name"] for r in rows} == QUICK_ROWS, stdout[-3000:] + stderr[-3000:]
    for row in rows:
        assert set(row) >= {"name", "trials", "false_complete", "lost_steps", "passed", "detail"}, row
        assert row["passed"] and row["false_complete"] == 0 and row["lost_steps"] == 0, row
        assert row["trials"] >= 1, row
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "| fault | trials |" in stdout


def test_a_false_complete_or_a_lost_step_fails_the_row() -> None:
    assert common.Tally(trials=3).row("x", "fine", 1.0).passed
    assert not common.Tally(trials=3, false_complete=1).row("x", "", 1.0).passed
    assert not common.Tally(trials=3, lost_steps=2).row("x", "", 1.0).passed
    failed = common.Tally(trials=1)
    failed.fail("why")
    row = failed.row("x", "what was done", 1.0)
    assert not row.passed and row.detail.startswith("FAILED: why")


def test_the_table_escapes_pipes() -> None:
    row = common.Row(name="n", trials=1, false_complete=0, lost_steps=0, passed=True, detail="a | b")
    assert "a \\| b" in runner.table([row])


HOLD_A_MOUNT = """\
import sys, time
from pathlib import Path
from slurm_jit.faults import common
with common.tmpfs(Path(sys.argv[1]), 1 << 20):
    print("mounted", flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_sigterm_to_the_harness_leaves_no_mount_behind(tmp_path: Path) -> None:
    # CI cancelling the job (or timeout(1)) sends SIGTERM: its default action ended tools/faults with its tmpfs
    # still mounted (the finally that unmounts never ran). ~2 s.
    mount = tmp_path / "m"
    proc = subprocess.Popen([sys.executable, "-c", HOLD_A_MOUNT, str(mount)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "mounted"
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        assert not mount.is_mount(), "tools/faults ended by SIGTERM left its tmpfs mounted"
    finally:
        proc.kill()
        proc.wait(60)
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False, timeout=60)
