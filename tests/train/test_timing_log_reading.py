"""Reading OUT_DIR/slurm-jit/timing-rank*.jsonl on rank 0 while it trains (the runtime grace check): whatever lies
there, the output lock stays held and the training is not held up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jit_helpers import LOCK_BUSY

from slurm_jit import timing
from slurm_jit.grace import calc as grace
from slurm_jit.train import output_lock, runtime_grace


@pytest.mark.timeout(60)  # before: the FIFO was waited on forever
@pytest.mark.parametrize("planted", ["symbolic-link-to-the-lock", "hard-link-to-the-lock", "fifo"])
def test_the_grace_check_skips_a_timing_log_that_is_not_a_file_and_keeps_the_lock(
        tmp_path: Path, planted: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: open() followed the link to output.lock, and closing it dropped rank 0's POSIX lock (a second
    # training could take the output_dir); a FIFO held rank 0 at a step boundary forever.
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # the check runs inside a Slurm job only
    out = tmp_path / "out"
    lock, why = output_lock.acquire(out)
    assert lock is not None and lock.locked, why
    try:
        log = timing.TimingLog(out, rank=0, world_size=2, run_id="r1")
        for step in range(1, 10):
            log.step(step, 1.0)
        log.close()
        path = output_lock.lock_path(out)
        planted_log = timing.timing_path(out, 9)
        if planted == "symbolic-link-to-the-lock":
            planted_log.symlink_to(path.name)
        elif planted == "hard-link-to-the-lock":
            os.link(path, planted_log)
        else:
            os.mkfifo(planted_log)
        with caplog.at_level("INFO", logger=runtime_grace.__name__):
            assert runtime_grace.check_and_warn(str(out), 1.0, "start") == []
        probe = subprocess.run([sys.executable, "-c", LOCK_BUSY, str(path)], capture_output=True, text=True,
                               timeout=60, check=True)
        assert probe.stdout.strip() == "busy", "reading the timing logs dropped the output lock"
        skipped = [r.getMessage() for r in caplog.records if "grace check skipped" in r.getMessage()]
        assert len(skipped) == 1 and str(planted_log) in skipped[0] and "HINT:" in skipped[0], skipped
    finally:
        output_lock.release(lock)


NESTING_DEPTH = 100_000  # deeper than CPython's recursion limit
# JSON-valid records no writer of ours produces, each beside a healthy log
ODD_RECORDS = {
    "save-bytes-text": {"event": "save", "kind": "jit", "step": 9, "dur_s": 2.0, "bytes": "abc"},
    "save-bytes-infinite": {"event": "save", "kind": "jit", "step": 9, "dur_s": 2.0, "bytes": 1e400},
    "save-bytes-list": {"event": "save", "kind": "jit", "step": 9, "dur_s": 2.0, "bytes": [1]},
    "step-list": {"event": "step", "step": [5], "dur_s": 1.0, "warmup": False},
    "eval-step-object": {"event": "eval", "step": {"a": 1}, "dur_s": 1.0, "aborted": False},
    "save-step-list": {"event": "save", "kind": "jit", "step": [5], "dur_s": 2.0, "bytes": 10},
    "save-run-id-list": {"event": "save", "kind": "jit", "run_id": [1], "step": 9, "dur_s": 2.0, "bytes": 10},
    "world-size-true": {"event": "step", "world_size": True, "step": 11, "dur_s": 1.0, "warmup": False},
    "world-size-list": {"event": "step", "world_size": [5], "step": 11, "dur_s": 1.0, "warmup": False},
    "stop-teardown-huge-integer": {"event": "stop", "step": 9, "dur_s": 1.0, "teardown_s": 10**400},
    "agreement-kill-wait-huge-integer": {"event": "agreement", "dur_s": 0.1, "mode": "x", "kill_wait_s": 10**400},
}


def _healthy_log(out: Path, step_s: float = 1.0) -> Path:
    log = timing.TimingLog(out, rank=0, world_size=2, run_id="r1")
    for step in range(1, 10):
        log.step(step, step_s)
    log.save(9, "jit", 3.0, 1000)
    log.close()
    return log.path


def _append(path: Path, record: dict[str, object]) -> None:
    line = json.dumps({"v": 1, "rank": 0, "world_size": 2, "run_id": "r1", **record})
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")


@pytest.mark.parametrize("odd", sorted(ODD_RECORDS))
def test_an_odd_record_neither_stops_the_grace_check_nor_the_summary(
        tmp_path: Path, odd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: int("abc"), int(inf), int([1]) and a list as a set key raised out of timing.summarize, inside rank
    # 0's training loop (the grace check is "warnings only, never an error"): a healthy run died.
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv(grace.LEAD_ENV_VAR, "1")  # far too short: the check has something to say
    _append(_healthy_log(tmp_path), ODD_RECORDS[odd])
    summary = timing.summarize(timing.read_records(tmp_path))
    assert summary.n_steps >= 7 and summary.step_max_s == 1.0 and summary.world_sizes == {2}, summary
    assert summary.saves["jit"].max_bytes == 1000 and summary.saves["jit"].count >= 1, summary.saves
    warnings = runtime_grace.check_and_warn(str(tmp_path), 1.0, "start")
    assert len(warnings) == 1 and "signal lead 1 s < needed" in warnings[0], warnings


def test_a_duration_too_large_for_a_float_is_a_bad_record_not_an_overflow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: math.isfinite(10**400) raised OverflowError (a JSON integer of 401 digits is valid JSON, under
    # Python's 4300-digit limit) out of read_records: out of rank 0's training loop through the grace check.
    path = _healthy_log(tmp_path)
    _append(path, {"event": "step", "step": 12, "dur_s": 10**400, "warmup": False})
    with pytest.raises(timing.TimingLogError, match=f"{path}:12: bad dur_s"):
        timing.read_records(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert runtime_grace.check_and_warn(str(tmp_path), 1.0, "start", world_size=2) == []


def test_a_need_beyond_slurms_largest_lead_is_a_warning_not_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: compute_grace's GraceError (no --signal lead can cover 70 000 s steps) came out of the check.
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv(grace.LEAD_ENV_VAR, "300")
    _healthy_log(tmp_path, step_s=70_000.0)
    with caplog.at_level("WARNING", logger=runtime_grace.__name__):
        warnings = runtime_grace.check_and_warn(str(tmp_path), 1.0, "start")
    assert len(warnings) == 1 and "largest --signal lead" in warnings[0] and "HINT:" in warnings[0], warnings
    assert any("largest --signal lead" in r.getMessage() for r in caplog.records)


def test_a_line_nested_past_the_recursion_limit_is_one_line_everywhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: RecursionError out of read_records: a traceback from grace-calc --from, and out of rank 0's loop.
    path = _healthy_log(tmp_path)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("[" * NESTING_DEPTH + "]" * NESTING_DEPTH + "\n")
    _append(path, {"event": "step", "step": 12, "dur_s": 1.0, "warmup": False})  # not the last line: not cut short
    with pytest.raises(timing.TimingLogError, match=f"{path}:12: not JSON"):
        timing.read_records(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert runtime_grace.check_and_warn(str(tmp_path), 1.0, "start") == []
    ran = subprocess.run([sys.executable, "-m", "slurm_jit.grace.cli", "--from", str(tmp_path), "--no-slurm"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode != 0 and "Traceback" not in ran.stderr, ran.stderr[-2000:]
    (line,) = ran.stderr.splitlines()
    assert f"{path}:12: not JSON" in line and "HINT:" in line, line
