"""A failed train() closes the side group, and a second train() starts clean. Real ranks (2 CPU ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jit_helpers import run_to_end

from slurm_jit.train import stop_record

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
