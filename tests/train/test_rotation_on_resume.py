"""Rotation by write time on real ranks: after a rollback, rotation keeps the checkpoint just written and resume
picks it. Real DeepSpeed ranks (2 CPU ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jit_helpers import run_to_end
from run_outputs import checkpoint_names as _dirs
from run_outputs import manifest_of as _manifest

from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record

pytestmark = pytest.mark.deepspeed

def test_rotation_keeps_the_checkpoint_just_written_and_resume_picks_it(tmp_path: Path, copy_run,
                                                                        jit_zero2_run: Path) -> None:
    """Item 2: checkpoint-6 of an earlier run is there; resume from checkpoint-3 (a rollback) with
    save_total_limit=1 and SIGTERM at the end of step 4: a round read at that boundary (blocking during the
    resumed run's warm-up) stops there; checkpoint-4 survives rotation and is what resume=True picks next."""
    out = copy_run(jit_zero2_run)
    args = ["--max-steps", "10", "--save-total-limit", "1", "--kill-wait", "0", "--signal-self-at-step", "4",
            "--resume-from", str(out / "checkpoint-3")]
    assert run_to_end(out, args) == [0, 0]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["step"] == 4, record
    assert (out / "checkpoint-4").is_dir(), _dirs(out)
    resolution = protocol.find_resumable(out)
    assert resolution.checkpoint is not None and resolution.checkpoint.step == 4, resolution
    assert _manifest(out / "checkpoint-4")["run_id"] == _manifest(jit_zero2_run / "checkpoint-3")["run_id"]
