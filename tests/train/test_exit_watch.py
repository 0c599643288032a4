"""The exit watcher (train/exit_watch.py): after a JIT stop it times the rank's process from train() returning to its
end and appends one ``exit`` record; grace-calc adds the longest to the teardown (grace/estimates.py). Real
processes and signals; the end-to-end check against real DeepSpeed ranks is in test_stop_latency.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from slurm_jit import timing
from slurm_jit.grace import calc

SRC = Path(__file__).resolve().parents[2] / "src"
RANK = """
import signal, sys, time
sys.path.insert(0, {src!r})
from slurm_jit.train import exit_watch
watcher = exit_watch.start(__import__("pathlib").Path({log!r}), {{"v": 1, "event": "exit", "rank": 0, "step": 7}})
print(watcher.pid if watcher else "none", flush=True)
time.sleep({linger_s})
"""


def _rank(log: Path, linger_s: float) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", RANK.format(src=str(SRC), log=str(log), linger_s=linger_s)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def test_the_record_comes_once_the_process_has_ended_and_times_its_exit(tmp_path: Path) -> None:
    log = tmp_path / "timing-rank0.jsonl"
    log.write_text("")
    proc, watcher = _rank(log, linger_s=0.5)
    time.sleep(0.2)
    assert log.read_text() == ""  # the rank still runs: nothing yet
    os.kill(watcher, signal.SIGTERM)  # Slurm's signal reaches every process of the step: the watcher stays
    proc.wait(timeout=30)
    assert _gone(watcher)
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["event"] == "exit" and record["step"] == 7 and record["rank"] == 0
    assert 0.5 <= record["dur_s"] < 30 and record["time"] <= time.time()


def test_no_log_to_append_to_writes_nothing_and_ends(tmp_path: Path) -> None:
    log = tmp_path / "gone" / "timing-rank0.jsonl"  # the output directory removed meanwhile
    proc, watcher = _rank(log, linger_s=0.0)
    proc.wait(timeout=30)
    assert _gone(watcher) and not log.parent.exists()


def test_a_symlinked_log_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    log = tmp_path / "timing-rank0.jsonl"
    log.symlink_to(target)
    proc, watcher = _rank(log, linger_s=0.0)
    proc.wait(timeout=30)
    assert _gone(watcher) and target.read_text() == ""


def _log(tmp_path: Path, *records: dict) -> timing.TimingSummary:
    path = timing.timing_path(tmp_path, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    base = {"v": 1, "rank": 0, "world_size": 2, "run_id": "r"}
    path.write_text("".join(json.dumps({**base, **r}) + "\n" for r in records))
    return timing.load_summary(tmp_path)


STOP = {"event": "stop", "step": 7, "dur_s": 4.0, "teardown_s": 0.3, "kill_wait_s": 3.0}


def test_grace_calc_adds_the_longest_exit_to_the_teardown(tmp_path: Path) -> None:
    summary = _log(tmp_path, STOP, {"event": "exit", "step": 7, "dur_s": 1.2, "time": 1.0},
                   {**STOP, "rank": 1, "teardown_s": 0.1}, {"event": "exit", "rank": 1, "step": 7, "dur_s": 0.8})
    terms = calc.measured_terms(summary)
    assert terms.teardown_s == 0.3 + 1.2
    assert "process's exit 1.2 s (longest of 2)" in terms.teardown_source


def test_without_an_exit_record_the_teardown_is_train_returning_and_says_so(tmp_path: Path) -> None:
    terms = calc.measured_terms(_log(tmp_path, STOP))
    assert terms.teardown_s == 0.3
    assert "exit after it not recorded" in terms.teardown_source
