"""Reading ``OUT_DIR/slurm-jit/launch-progress.json`` (the launcher's history, read at each requeue decision and by
``status``) whatever lies there: a FIFO is never waited on, a file nested past the recursion limit is one
warning, and an unusable record is moved aside, never read. Real files and FIFOs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_jit.launch import progress

NESTING_DEPTH = 100_000  # deeper than CPython's recursion limit


@pytest.mark.timeout(60)  # before: open() of the FIFO blocked the requeue decision forever
@pytest.mark.parametrize("what", ["fifo", "nested", "oversized"])
def test_an_unusable_progress_record_is_reported_and_moved_aside(tmp_path: Path, what: str) -> None:
    # Before: a FIFO blocked read(), problem() and keep_copy(); nesting raised RecursionError out of both.
    record = progress.path(tmp_path)
    record.parent.mkdir(parents=True)
    if what == "fifo":
        os.mkfifo(record)
    elif what == "nested":
        record.write_text("[" * NESTING_DEPTH + "]" * NESTING_DEPTH)
    else:
        with open(record, "wb") as handle:  # sparse: no disk taken
            handle.write(b'{"job_id": "41"}')
            handle.truncate(progress.PROGRESS_MAX_BYTES + 1)
    assert progress.read(tmp_path) == {}
    trouble = progress.problem(tmp_path)
    assert trouble is not None and f"{record} is unreadable" in trouble and "\n" not in trouble, trouble
    kept = progress.keep_copy(tmp_path)
    assert kept == record.with_name("launch-progress.json.unreadable") and os.path.lexists(kept)
    assert not os.path.lexists(record) and progress.problem(tmp_path) is None
    progress.write(tmp_path, {"job_id": "42", "history": []})
    assert progress.read(tmp_path) == {"job_id": "42", "history": []}
