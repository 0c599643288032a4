"""Reading the stop record and the ranks' reports under OUT_DIR/slurm-jit/: whatever lies there (a FIFO, a file
nested past the recursion limit, one over the size bound, a report whose rank is no number, a hard link to the
held output lock), ``python -m slurm_jit.stop_record`` answers 2 (no readable record) in one line, and the
reports that are there are read without an exception. Real files, real FIFOs, the real command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jit_helpers import LOCK_BUSY

from slurm_jit.train import output_lock, stop_record

CLI_TIMEOUT_S = 60  # the command answers in under a second; before, a FIFO held it forever
NESTING_DEPTH = 100_000  # deeper than CPython's recursion limit, far under the size bound


def _stop_record_cli(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_jit.stop_record", str(out)], capture_output=True,
                          text=True, timeout=CLI_TIMEOUT_S, check=False)


def _plant(target: Path, what: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if what == "fifo":
        os.mkfifo(target)
    elif what == "nested":
        target.write_text("[" * NESTING_DEPTH + "]" * NESTING_DEPTH)
    elif what == "nested-in-a-field":
        target.write_text('{"state": "finished", "step": ' + "[" * NESTING_DEPTH + "]" * NESTING_DEPTH + "}")
    elif what == "oversized":
        with open(target, "wb") as handle:  # sparse: no disk taken
            handle.write(b'{"state": "finished"}')
            handle.truncate(stop_record.STOP_RECORD_MAX_BYTES + 1)
    else:
        target.mkdir()


@pytest.mark.timeout(120)  # before: the FIFO held the command (and this test) forever; the subprocess has its own
@pytest.mark.parametrize("what", ["fifo", "nested", "nested-in-a-field", "oversized", "directory"])
def test_an_unreadable_stop_record_is_exit_2_in_one_line(tmp_path: Path, what: str) -> None:
    # Before: nesting raised RecursionError (exit 1, "crashed": the requeue loop read a crash), a FIFO blocked
    # open() forever (the requeue decision hung), a directory was a traceback.
    _plant(stop_record.path(tmp_path), what)
    ran = _stop_record_cli(tmp_path)
    assert ran.returncode == stop_record.EXIT_NO_RECORD, ran.stderr[-2000:]
    assert ran.stdout == "" and "Traceback" not in ran.stderr, ran.stderr[-2000:]
    (line,) = ran.stderr.splitlines()
    assert str(stop_record.path(tmp_path)) in line and "HINT:" in line, line
    assert stop_record.read(tmp_path) is None


def test_a_missing_stop_record_is_exit_2_and_a_good_one_its_state(tmp_path: Path) -> None:
    missing = _stop_record_cli(tmp_path)
    assert missing.returncode == stop_record.EXIT_NO_RECORD and "did the job reach train()?" in missing.stderr
    stop_record.write(tmp_path, "jit_stop", step=4, checkpoint=str(tmp_path / "checkpoint-4"))
    ran = _stop_record_cli(tmp_path)
    assert ran.returncode == stop_record.EXIT_REQUEUE, ran.stderr
    assert ran.stdout.strip() == f"jit_stop step=4 {tmp_path / 'checkpoint-4'}"


@pytest.mark.parametrize("name", ["run\udcff", "run\nnext"])
def test_a_record_of_an_output_dir_with_an_odd_name_is_its_state_in_one_line(tmp_path: Path, name: str) -> None:
    # An output_dir whose name holds a byte that is not UTF-8 (Python's path is then a lone surrogate, written by
    # json as "\udcff") or a line break. Before: under a UTF-8 locale (stdout strict) print() raised
    # UnicodeEncodeError, exit 1 ("crashed": no requeue of a JIT stop); a line break made the one line two.
    out = tmp_path / name
    out.mkdir()
    stop_record.write(out, "jit_stop", step=4, checkpoint=str(out / "checkpoint-4"))
    ran = subprocess.run([sys.executable, "-m", "slurm_jit.stop_record", str(out)], capture_output=True,
                         timeout=CLI_TIMEOUT_S, check=False, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert ran.returncode == stop_record.EXIT_REQUEUE, ran.stderr[-2000:]
    (line,) = ran.stdout.decode().splitlines()
    assert line.startswith("jit_stop step=4 ") and line.endswith("/checkpoint-4"), line


@pytest.mark.timeout(60)  # before: the FIFO report was waited on forever
def test_reports_are_read_whatever_else_lies_beside_them(tmp_path: Path) -> None:
    # Before: a report with "rank": null (or "x", or [1]) raised out of reports(), so the ``failed``/``hung``
    # record was never written; a FIFO blocked it forever, a nested report raised RecursionError.
    good = {"rank": 1, "step": 7, "phase": "step", "since_s": 31.0, "node": "n2", "frame": "x"}
    stop_record.write_hang_report(tmp_path, 1, good)
    stop_record.write_hang_report(tmp_path, 0, {**good, "rank": 0})
    for rank, odd in ((2, None), (3, "x"), (4, [1]), (5, True), (6, 1e400)):
        stop_record.hang_report_path(tmp_path, rank).write_text(json.dumps({**good, "rank": odd}))
    _plant(stop_record.hang_report_path(tmp_path, 7), "fifo")
    _plant(stop_record.hang_report_path(tmp_path, 8), "nested")
    stop_record.hang_report_path(tmp_path, 9).write_text("[1, 2]")
    assert [r["rank"] for r in stop_record.hang_reports(tmp_path)] == [0, 1]
    found = stop_record.wait_for_reports(tmp_path, stop_record.HANG_REPORT_GLOB, 9, wait_s=0.3)
    assert [r["rank"] for r in found] == [0, 1]


def test_a_report_that_is_a_link_to_the_held_lock_is_not_read_and_the_lock_stays(tmp_path: Path) -> None:
    lock, why = output_lock.acquire(tmp_path)
    assert lock is not None and lock.locked, why
    try:
        os.link(output_lock.lock_path(tmp_path), stop_record.failed_report_path(tmp_path, 1))
        os.link(output_lock.lock_path(tmp_path), stop_record.path(tmp_path))
        assert stop_record.reports(tmp_path, stop_record.FAILED_GLOB) == []
        assert stop_record.read(tmp_path) is None
        probe = subprocess.run([sys.executable, "-c", LOCK_BUSY, str(output_lock.lock_path(tmp_path))],
                               capture_output=True, text=True, timeout=60, check=True)
        assert probe.stdout.strip() == "busy", "reading the reports dropped the output lock"
    finally:
        output_lock.release(lock)
