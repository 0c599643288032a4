"""An error after an async save's share is published never removes its files (issue #42 item 2), on 2 real ZeRO-2
ranks: rank 1's directory fsync after its done marker's rename and rank 0's rotation after the manifest both fail
(``SLURM_JIT_FAULT_ASYNC``, an OSError at that instant) in the save of step 4, with ``save_total_limit=1`` (the
rotation has already deleted checkpoint-2). Training ends at the next save on every rank, with a line saying the
files are kept; ``ckpt-check --deep`` finds checkpoint-4 complete and names it, and the resume from it reaches the
end."""

from __future__ import annotations

from pathlib import Path

import pytest
from jit_helpers import ckpt_check, run_logged

from slurm_jit.checkpoint import protocol
from slurm_jit.train.async_save import commit, fault_points

ARGS = ["--max-steps", "6", "--save-steps", "2", "--save-total-limit", "1", "--async-periodic-saves"]


@pytest.mark.deepspeed
def test_errors_after_a_ranks_marker_and_after_the_manifest_keep_the_checkpoint_complete(tmp_path: Path) -> None:
    out = tmp_path / "out"
    faults = f"published:4:{fault_points.RAISE}:1,rotated:4:{fault_points.RAISE}:0"
    failed = run_logged(out, ARGS, env={fault_points.FAULT_ASYNC_ENV: faults})
    assert failed.codes[0] not in (0, None) and failed.codes[1] not in (0, None), failed.log[-3000:]
    ckpt = out / "checkpoint-4"
    info = protocol.inspect(ckpt, 4, deep=True)
    assert info.status == protocol.Status.COMPLETE, info
    assert not list(ckpt.glob(f"{commit.FAILED_PREFIX}*")), sorted(p.name for p in ckpt.iterdir())
    check = ckpt_check(out, "--deep")
    assert check.returncode == 0 and check.stdout.splitlines()[-1] == str(ckpt), check.stdout + check.stderr
    assert not (out / "checkpoint-2").exists()  # rotated before the fault: checkpoint-4 is the only one left
    assert "fault injection: the async save failed at rotated on rank 0" in failed.log, failed.log[-3000:]
    assert "its files are kept" in failed.log and "stays incomplete" not in failed.log, failed.log[-3000:]
    resumed = run_logged(out, [*ARGS, "--resume"])
    assert resumed.codes == [0, 0], resumed.log[-3000:]
    assert "resum" in resumed.log and "checkpoint-4" in resumed.log, resumed.log[-3000:]
    assert protocol.inspect(out / "checkpoint-6", 6).status == protocol.Status.COMPLETE
