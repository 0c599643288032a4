"""A subclass of JitTrainer whose ``_save_checkpoint`` calls ``super()`` on some paths only: the class check at
construction sees a super() call and lets it through; the JIT stop at a step where it skips super() wrote no
checkpoint, and must say so (one line, a HINT) instead of recording a JIT stop at a checkpoint that is not there.
One process, a real JitTrainer on a tiny GPT-2, no DeepSpeed, a real SIGTERM (~15 s)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import transformers

from slurm_jit import demo_train
from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record
from slurm_jit.train.trainer import JitConfig, JitTrainer

SAVE_STEPS = 2
STOP_AT_STEP = 3  # odd: the subclass below skips super() there


class EvenStepsOnly(JitTrainer):
    """A user's override that saves on its own cadence: super() on even steps only."""

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.state.global_step % 2 == 0:
            super()._save_checkpoint(model, trial)


class SigtermAt(transformers.TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == STOP_AT_STEP:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_jit_stop_whose_save_skipped_super_fails_in_one_line_and_records_no_stop(tmp_path: Path) -> None:
    out = tmp_path / "out"
    targs = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=8,
                                           save_steps=SAVE_STEPS, per_device_train_batch_size=2,
                                           disable_tqdm=True, logging_steps=1)
    trainer = EvenStepsOnly(model=demo_train.build_model("gpt2", 16, 1), args=targs,
                            train_dataset=demo_train._Tokens(8, seed=1), jit_config=JitConfig(kill_wait_s=0),
                            callbacks=[SigtermAt()])
    with pytest.raises(Exception) as failed:  # noqa: PT011 - the type is the point below: the message
        trainer.train()
    message = str(failed.value)
    assert "\n" not in message and "EvenStepsOnly._save_checkpoint" in message and "HINT:" in message, message
    assert f"step {STOP_AT_STEP}" in message, message
    assert not (out / f"checkpoint-{STOP_AT_STEP}").exists()
    record = stop_record.read(out)
    assert record is None or record.get("state") != "jit_stop", record  # no stop claimed at a missing checkpoint
    earlier = out / f"checkpoint-{SAVE_STEPS}"
    assert protocol.inspect(earlier, SAVE_STEPS, deep=True).status is protocol.Status.COMPLETE  # nothing lost
