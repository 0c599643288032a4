"""A full disk inside a checkpoint write (train/save_errors.py), on a real full tmpfs; the trainer-level path (2
DeepSpeed ranks whose second save fills the disk) runs in tools/faults --quick (tests/test_faults.py). ~1 s."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

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


def _fill(mount: Path) -> None:
    """Write a filler file until the file system answers ENOSPC."""
    fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def test_a_full_disk_never_makes_the_timing_log_end_training(full_disk: Path) -> None:
    # The timing log is diagnostics: its buffered step records hitting a full disk (the disk a checkpoint just
    # filled) raised from flush() mid-training, and from close() in train()'s finally, where that OSError replaced
    # the one-line CheckpointWriteError of the failed save with a traceback.
    from slurm_jit.timing import FLUSH_EVERY_STEPS, TimingLog

    log = TimingLog(full_disk, 0, 1, "run")
    _fill(full_disk)
    for step in range(1, 50 * FLUSH_EVERY_STEPS):
        log.step(step, 0.1)
    log.save(7, "periodic", 1.0, 10)
    log.close()  # nothing raised: the log stops, training goes on
