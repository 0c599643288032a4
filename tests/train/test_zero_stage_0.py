"""DeepSpeed without ZeRO (a config's ``"zero_optimization": {"stage": 0}``) on 2 real CPU ranks: DeepSpeed keeps the
optimizer in the model states file and no rank writes an optimizer shard. Found by a review: every checkpoint
such a run wrote was called incomplete ("optimizer shard of rank 0 missing") and ``--resume`` started afresh;
now the periodic and the JIT checkpoint are complete, and a resume from either is bitwise the run that never
stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jit_helpers import assert_same_losses, ckpt_check, losses, run_and_signal, run_logged

from slurm_jit.train import stop_record

pytestmark = pytest.mark.deepspeed  # every test starts 2 DeepSpeed ranks (the timeout of rank tests)

STAGE_0 = json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                      "gradient_clipping": "auto", "zero_optimization": {"stage": 0}})
ARGS = ["--zero-stage", "2", "--targ", f"deepspeed={STAGE_0}", "--max-steps", "14", "--save-steps", "4",
        "--kill-wait", "1"]


def test_stage_0_checkpoints_are_complete_and_resume_bitwise(tmp_path: Path) -> None:
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    assert run_logged(reference, ARGS).codes == [0, 0]
    result = run_and_signal(stopped, [*ARGS, "--step-sleep", "0.3"], [(0, 0.0), (1, 0.0)], after_steps=6)
    assert result.codes == [0, 0], result.log[-3000:]
    record = stop_record.read(stopped)
    assert record is not None and record["state"] == "jit_stop", record
    report = ckpt_check(stopped).stdout
    stop_step = int(Path(record["checkpoint"]).name.split("-")[1])
    assert f"{stop_step}  complete" in report and "4  complete" in report, report
    resumed = run_logged(stopped, [*ARGS, "--resume"])
    assert resumed.codes == [0, 0], resumed.log[-3000:]
    assert f"checkpoint-{stop_step}" in resumed.log  # resumed from the JIT checkpoint, not afresh
    assert_same_losses(losses(stopped), losses(reference))
