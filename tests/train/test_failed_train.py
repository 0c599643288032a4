"""A failed train() closes the side group, and a second train() starts clean. Real ranks (2 CPU ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jit_helpers import run_logged, run_to_end

from slurm_jit.train import stop_record, stop_summary

pytestmark = pytest.mark.deepspeed

def test_failed_train_closes_the_side_group_and_a_second_train_starts_clean(tmp_path: Path) -> None:
    """Item 14: train() raises at step 3 on both ranks; the side group is closed; train() again runs to the end
    (without DeepSpeed: accelerate cannot train() a DeepSpeed engine twice in one process)."""
    out = tmp_path / "out"
    assert run_to_end(out, ["--zero-stage", "0", "--max-steps", "6", "--fail-at-step", "3", "--train-again"]) == [0, 0]
    log = (tmp_path / "logs-out" / "rank0.log").read_text(errors="replace")
    assert "side group closed: True" in log, log[-3000:]
    assert "terminate called" not in log
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished" and record["step"] == 6, record


def test_rank0_failing_on_its_own_error_stays_a_crash_when_the_survivor_rewrites_the_record(tmp_path: Path) -> None:
    """Rank 0 raises alone at step 3 (as a DataLoader worker's death raises there); rank 1 then finds it gone in a
    collective and, as the lowest survivor, writes ``failed`` with ``lost_peer``. That record must still say why
    rank 0 ended: without it a crash read as a lost peer, which the launcher requeues under --retry-on-hang (seen
    in CI: rank 0's "DataLoader worker ... killed by signal" became "peer rank 0 lost")."""
    out = tmp_path / "out"
    run = run_logged(out, ["--max-steps", "40", "--step-sleep", "0.2", "--fail-at-step", "3", "--fail-rank", "0"])
    assert run.codes[0] not in (None, 0) and run.codes[1] not in (None, 0), (run.codes, run.log[-3000:])
    record = stop_record.read(out)
    assert record is not None and record["state"] == "failed", record
    own = "RuntimeError: demo_train: failure injected at step 3"
    assert own in record["error"], record  # whichever rank wrote it last
    assert stop_summary.lost_peer(record) is None, record  # the launcher's policy: a crash, never retry-on-hang
