"""``python launch/submit.py status OUT_DIR`` names the hung rank or the lost peer of the stop record (real files;
no job recorded, so no Slurm call)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_jit.launch import status
from slurm_jit.train import stop_record


@pytest.mark.parametrize(("state", "fields", "line"), [
    ("hung", {"ranks": [{"rank": 1, "node": "node2", "step": 6, "frame": "t.py:1 in f"}]},
     "stuck:    hang at step 6 on rank 1 (node node2), stack in the log"),
    ("failed", {"error": "x", "lost_peer": {"rank": 3, "step": 6, "node": "node4", "how": "gone"}},
     "stuck:    peer rank 3 lost at step 6 (node node4)"),
])
def test_status_says_which_rank_hung_or_was_lost(tmp_path: Path, state: str, fields: dict[str, object],
                                                 line: str) -> None:
    stop_record.write(tmp_path, state, step=6, job_id="42", **fields)
    assert line in status.report(str(tmp_path), None)


def test_status_of_a_plain_crash_has_no_stuck_line(tmp_path: Path) -> None:
    stop_record.write(tmp_path, "failed", step=6, job_id="42", error="ValueError: x")
    assert not [line for line in status.report(str(tmp_path), None) if line.startswith("stuck:")]
