"""A full disk inside a checkpoint write (train/save_errors.py), on a real full tmpfs; the trainer-level path (2
DeepSpeed ranks whose second save fills the disk) runs in tools/faults --quick (tests/faults/test_faults.py). ~1 s."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from disk_helpers import fill

from slurm_jit.train import save_errors

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True, timeout=60)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=60)


def test_a_torch_save_into_a_full_disk_is_one_line_with_a_hint(full_disk: Path) -> None:
    ckpt = full_disk / "checkpoint-4"
    ckpt.mkdir()
    with pytest.raises(save_errors.CheckpointWriteError) as caught:
        with save_errors.disk_full_is_one_line(ckpt):
            torch.save({"w": torch.zeros(1024 * 1024)}, ckpt / "optim.pt")  # 4 MiB into 256 KiB
    message = str(caught.value)
    assert "no space left on the device" in message and "HINT:" in message and "\n" not in message, message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_an_enospc_oserror_is_named(full_disk: Path) -> None:
    ckpt = full_disk / "checkpoint-4"
    ckpt.mkdir()
    with pytest.raises(save_errors.CheckpointWriteError, match=r"No space left on device \(ENOSPC\)"):
        with save_errors.disk_full_is_one_line(ckpt), open(ckpt / "big", "wb") as handle:
            handle.write(b"\0" * 1024 * 1024)
            handle.flush()
            os.fsync(handle.fileno())


def test_other_failures_pass_through_unchanged(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-4"  # a disk with room: a failure is not a full disk
    with pytest.raises(RuntimeError, match="a bug"):
        with save_errors.disk_full_is_one_line(ckpt):
            raise RuntimeError("a bug")


def test_a_full_disk_never_makes_the_timing_log_end_training(full_disk: Path) -> None:
    # The timing log is diagnostics: its buffered step records hitting a full disk (the disk a checkpoint just
    # filled) raised from flush() mid-training, and from close() in train()'s finally, where that OSError replaced
    # the one-line CheckpointWriteError of the failed save with a traceback.
    from slurm_jit.timing import FLUSH_EVERY_STEPS, TimingLog

    log = TimingLog(full_disk, 0, 1, "run")
    fill(full_disk)
    for step in range(1, 50 * FLUSH_EVERY_STEPS):
        log.step(step, 0.1)
    log.save(7, "periodic", 1.0, 10)
    log.close()  # nothing raised: the log stops, training goes on


def test_a_full_disk_at_the_sentinel_is_one_line_and_keeps_the_earlier_checkpoint(full_disk: Path) -> None:
    # One process, no DeepSpeed (~10 s): the disk fills between saves, so the save of step 2 fails at its very
    # first write, the sentinel (a raw OSError traceback before: the sentinel was outside the one-line guard).
    import transformers

    from slurm_jit import demo_train
    from slurm_jit.checkpoint import protocol
    from slurm_jit.train.trainer import JitTrainer

    class FillAtStep2(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == 2:
                fill(full_disk)

    out = full_disk / "out"
    targs = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=3,
                                           save_steps=1, per_device_train_batch_size=2, disable_tqdm=True)
    trainer = JitTrainer(model=demo_train.build_model("gpt2", 16, 1), args=targs,
                         train_dataset=demo_train._Tokens(8, seed=1), callbacks=[FillAtStep2()])
    with pytest.raises(save_errors.CheckpointWriteError) as caught:
        trainer.train()
    assert "checkpoint-2" in str(caught.value) and "HINT:" in str(caught.value), caught.value
    resolution = protocol.find_resumable(str(out))
    assert resolution.checkpoint is not None and resolution.checkpoint.path.name == "checkpoint-1"


def test_a_file_system_out_of_inodes_never_makes_the_timing_log_end_training(tmp_path: Path) -> None:
    # The first test write of train() succeeds and frees its inode; another user can take the last one before the
    # timing log is created (an inode quota, a metadata target full): that open() raised from train()'s start.
    from slurm_jit.timing import TIMING_DIR, TimingLog

    mount = tmp_path / "few-inodes"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=8", "tmpfs", str(mount)], check=True,
                   timeout=60)
    try:
        (mount / TIMING_DIR).mkdir()
        taken = 0
        with pytest.raises(OSError):  # every inode taken
            while True:
                (mount / f"other-{taken}").touch()
                taken += 1
        log = TimingLog(mount, 0, 1, "run")  # nothing raised: no log, training goes on
        log.step(1, 0.1)
        log.close()
        assert not list((mount / TIMING_DIR).iterdir())
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=60)
