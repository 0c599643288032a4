"""Elastic resume without DeepSpeed (plain DDP over gloo, ``--zero-stage 0``): the global batch is kept too.

Such a checkpoint has no saved DeepSpeed config to say its samples per optimizer step, so before the manifest
recorded them (``samples_per_step``, train/keep_batch.py) a 2 -> 1 resume of the same command ran 2 samples per
step instead of 4 and skipped half the data it should have (measured: the losses after the stop 3-5% off the
uninterrupted run's). Real ranks, a real SIGTERM; about 30 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jit_helpers import final_losses, losses, run_demo

from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.train import keep_batch

DDP = ["--model", "llama", "--vocab", "96", "--width", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
       "--lr", "3e-3", "--kill-wait", "0", "--max-steps", "8", "--zero-stage", "0"]
STOP_AT = 4  # the 2-rank run signals itself after this step: its JIT checkpoint is checkpoint-5
pytestmark = pytest.mark.deepspeed  # the timeout of the rank tests


def test_two_ddp_ranks_to_one_keep_the_global_batch_and_continue_bitwise(tmp_path: Path) -> None:
    reference = tmp_path / "ref"
    run_demo(reference, DDP, 2)
    out = tmp_path / "out"
    run_demo(out, [*DDP, "--signal-self-at-step", str(STOP_AT)], 2)
    written, _ = manifest_file.read(out / f"checkpoint-{STOP_AT + 1}")
    assert written is not None and written[keep_batch.SAMPLES_KEY] == 4, written  # 2 ranks x 2 x 1
    log = run_demo(out, [*DDP, "--resume"], 1)  # the same command on 1 rank
    assert log.count("world size 2 -> 1: gradient accumulation 1 -> 2, 4 samples per optimizer step kept") == 1, \
        log[-3000:]
    # The same samples in the same steps: halving the loss of two micro-batches is exact, so bitwise here.
    assert final_losses(out) == losses(reference)
