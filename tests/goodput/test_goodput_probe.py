"""The probe in the ranks: its events carry the run (job id, restart), a fault fires once per chain (the marker),
the kill is a real SIGKILL of the rank's process with its event written first."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_jit.goodput import probe

FIRE_KILL = """
import sys, types
from slurm_jit.goodput import probe
log = probe.EventLog(sys.argv[1], 1)
cb = probe.callback(sys.argv[1], log)
state = types.SimpleNamespace(global_step=5)
cb.on_step_begin(None, state, None)
cb.on_step_end(None, state, None)
print("survived", flush=True)
"""


def test_events_carry_the_run_and_every_line_is_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    log = probe.EventLog(tmp_path, 0)
    log.write("imports")
    log.write("step", step=7)
    records = [json.loads(line) for line in probe.events_path(tmp_path, 0).read_text().splitlines()]
    assert [(r["event"], r["job"], r["restart"], r["rank"]) for r in records] == [("imports", "42", 3, 0),
                                                                                   ("step", "42", 3, 0)]
    assert records[1]["step"] == 7 and records[0]["t"] <= records[1]["t"]


def test_no_faults_file_means_no_faults(tmp_path: Path) -> None:
    assert probe.read_faults(tmp_path) == {}


def test_the_kill_fires_once_per_chain_with_its_event_written_first(tmp_path: Path) -> None:
    (tmp_path / probe.FAULTS_FILE).write_text(json.dumps({"kill": {"step": 4, "rank": 1},
                                                          "hang": {"step": 900, "rank": 1}}))
    first = subprocess.run([sys.executable, "-c", FIRE_KILL, str(tmp_path)], capture_output=True, text=True,
                           timeout=120, check=False)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert (tmp_path / "fired-kill").exists()
    events = [json.loads(line)["event"] for line in probe.events_path(tmp_path, 1).read_text().splitlines()]
    assert events == ["first_step", "kill"]
    again = subprocess.run([sys.executable, "-c", FIRE_KILL, str(tmp_path)], capture_output=True, text=True,
                           timeout=120, check=False)
    assert again.returncode == 0 and "survived" in again.stdout, again.stderr[-2000:]  # a later run: no second kill
