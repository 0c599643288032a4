"""A signal at the last step: no JIT stop, the run finishes normally and stop.json says finished. Real DeepSpeed
ranks (2 CPU ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jit_helpers import run_to_end
from run_outputs import eval_losses as _evals

from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record

pytestmark = pytest.mark.deepspeed

def test_signal_at_the_last_step_finishes_normally(tmp_path: Path) -> None:
    """Item 6 (and the README's "no JIT stop at the last step", stop.json reaching finished): max_steps=6,
    SIGTERM at step 5: the final evaluation runs once, the final save is written, the record says finished."""
    out = tmp_path / "out"
    args = ["--max-steps", "6", "--eval-steps", "2", "--save-steps", "2", "--metric-for-best", "loss",
            "--kill-wait", "0", "--signal-self-at-step", "5"]
    assert run_to_end(out, args) == [0, 0]
    assert [s for s, _ in _evals(out)] == [2, 4, 6]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished" and record["step"] == 6, record
    info = protocol.inspect(out / "checkpoint-6", 6, deep=True)
    assert info.status is protocol.Status.COMPLETE and info.kind == "final"
    assert "aborted" not in (tmp_path / "logs-out" / "rank0.log").read_text()
