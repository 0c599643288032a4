"""A batch the user changed on a resume (train/keep_batch.py, train/data_position.py): one process, a real
JitTrainer, no DeepSpeed (~10 s a run), a dataset that records which samples each run fetched. The user's
per-device batch or accumulation is trained with; the resume reads on from the samples consumed (not global_step
steps of the new size), the global step (the LR schedule's) goes on, one line says it; what cannot start exactly at
the position is refused in one line with a HINT. The same on 2 DeepSpeed ranks: test_keep_batch.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from jit_helpers import RecordedTokens, train_one_process

from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.train import data_position, keep_batch, resume_path
from slurm_jit.train.refusals import JitRefusal

SAMPLES = 32  # one epoch: 8 steps of 4 samples, 16 of 2


def _train(out: Path, max_steps: int, resume: bool | str, **batch: Any) -> tuple[Any, list[int]]:
    dataset = RecordedTokens(SAMPLES)
    trainer = train_one_process(out, "none", max_steps, resume, dataset=dataset, **batch)
    return trainer, dataset.fetched


def _keep_only(out: Path, step: int) -> str:
    """The run's checkpoints after ``step`` removed: the resume goes on from checkpoint-<step>."""
    for ckpt in out.glob("checkpoint-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    return str(out / f"checkpoint-{step}")


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == resume_path.__name__ and "your batch" in r.getMessage()]


def test_a_halved_per_device_batch_trains_on_from_the_samples_consumed(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Per-device batch 4 to step 2 (8 samples), resumed at 2: 4 more steps of 2 samples read the sampler's samples
    8-15, the schedule at step 2 of max_steps 6. Before: the accumulation was set to 2, each step 4 samples again,
    the user's batch overridden."""
    out = tmp_path / "out"
    _, uninterrupted = _train(out, 4, False, per_device=4)  # the sampler's order of the epoch's first 16
    resume_from = _keep_only(out, 2)
    with caplog.at_level("WARNING"):
        trainer, fetched = _train(out, 6, resume_from, per_device=2)
    assert trainer.args.gradient_accumulation_steps == 1 and trainer.state.global_step == 6
    assert fetched[:8] == uninterrupted[8:16], (fetched, uninterrupted)
    assert _said(caplog) == ["slurm_jit: per-device batch 4 -> 2: your batch, 4 -> 2 samples per optimizer step; "
                             "the data position kept (8 samples into epoch 0), the schedule at step 2"]
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [1, 2, 3, 4, 5, 6]
    manifest, _ = manifest_file.read(out / "checkpoint-6")
    assert manifest is not None and manifest[keep_batch.SAMPLES_KEY] == 2 and manifest[keep_batch.PER_DEVICE_KEY] == 2
    assert manifest[data_position.POSITION_KEY] == {"epoch": 0, "samples": 16}, manifest


def test_another_accumulation_is_the_users_and_reads_on_from_the_samples_consumed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Accumulation 1 to step 2 (4 samples), resumed with 2: 2 steps of 4 samples read samples 4-11. Before: put
    back to 1 (2 samples a step, samples 4-7)."""
    out = tmp_path / "out"
    _, uninterrupted = _train(out, 6, False)
    resume_from = _keep_only(out, 2)
    with caplog.at_level("WARNING"):
        trainer, fetched = _train(out, 4, resume_from, accumulation=2)
    assert trainer.args.gradient_accumulation_steps == 2 and trainer.state.global_step == 4
    assert fetched[:8] == uninterrupted[4:12], (fetched, uninterrupted)
    assert _said(caplog) == ["slurm_jit: gradient accumulation 1 -> 2: your batch, 2 -> 4 samples per optimizer "
                             "step; the data position kept (4 samples into epoch 0), the schedule at step 2"]
    manifest, _ = manifest_file.read(out / "checkpoint-4")
    assert manifest is not None and manifest[keep_batch.COMMAND_KEY] == 2, manifest
    assert manifest[data_position.POSITION_KEY] == {"epoch": 0, "samples": 12}, manifest


def test_num_train_epochs_trains_the_rest_of_the_epoch_at_the_users_batch(tmp_path: Path) -> None:
    """One epoch; per-device batch 4 to step 2 (8 samples), resumed with 2: 12 steps of 2 read the epoch's other
    24 samples, each once, to step 14 (upstream's count: 16 steps, global_step 2 x 2 samples skipped, samples 4-7
    trained twice and the last 4 never)."""
    out = tmp_path / "out"
    _, uninterrupted = _train(out, -1, False, per_device=4, epochs=1.0)
    assert len(uninterrupted) == SAMPLES
    trainer, fetched = _train(out, -1, _keep_only(out, 2), per_device=2, epochs=1.0)
    assert trainer.state.global_step == trainer.state.max_steps == 14
    assert fetched == uninterrupted[8:], (fetched, uninterrupted)


def test_a_batch_whose_steps_cannot_start_at_the_position_is_refused_in_one_line(tmp_path: Path) -> None:
    """4 samples consumed at step 2; accumulation 3 (6 samples a step) cannot start a step there: refused before
    any step, the HINT naming the products that can. Before: the accumulation was put back to 1."""
    out = tmp_path / "out"
    _train(out, 2, False)
    with pytest.raises(JitRefusal) as refused:
        _train(out, 4, True, accumulation=3)
    line = str(refused.value)
    assert "\n" not in line and "4 samples into epoch 0 when written, not a whole number of this run's 6 samples " \
        "per optimizer step" in line, line
    assert "HINT: per_device_train_batch_size x gradient_accumulation_steps 1, 2, 4 on 1 ranks" in line, line
    assert not (out / "checkpoint-4").exists()


def test_a_batch_that_reorders_a_length_grouped_epoch_is_refused_before_any_step(tmp_path: Path) -> None:
    """train_sampling_strategy="group_by_length": LengthGroupedSampler orders the epoch by per-device batch x
    accumulation, so the halved batch would read on in another order than the 4 samples consumed came from: refused
    in one line before any step. Before: trained (samples twice, others never)."""
    out = tmp_path / "out"
    _train(out, 2, False, train_sampling_strategy="group_by_length")
    with pytest.raises(JitRefusal) as refused:
        _train(out, 4, True, per_device=1, train_sampling_strategy="group_by_length")
    line = str(refused.value)
    assert "\n" not in line and "train_sampling_strategy='group_by_length' orders each epoch by the batch" in line
    assert "HINT: resume with per_device_train_batch_size x gradient_accumulation_steps 2 as when written" in line
    assert not (out / "checkpoint-4").exists()


def test_under_ignore_data_skip_a_batch_whose_steps_cannot_start_at_the_position_is_trained_with(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """4 samples consumed at step 2; accumulation 3 (6 a step) under ignore_data_skip: nothing is skipped, so
    trained with, the line saying the position is not kept and the epoch starts over (upstream's). Before: refused
    for a position the resume does not start at, or said "the data position kept"."""
    out = tmp_path / "out"
    _, first = _train(out, 2, False)
    with caplog.at_level("WARNING"):
        trainer, fetched = _train(out, 4, True, accumulation=3, ignore_data_skip=True)
    assert trainer.state.global_step == 4 and fetched[:4] == first[:4], (fetched, first)  # the epoch's first again
    assert _said(caplog) == ["slurm_jit: gradient accumulation 1 -> 3: your batch, 2 -> 6 samples per optimizer step; "
                             "ignore_data_skip: the data position is not kept (the epoch upstream counts for the "
                             "checkpoint's step at this batch starts from its first sample), the schedule at step 2"]
