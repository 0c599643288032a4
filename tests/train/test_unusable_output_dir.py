"""An output directory that cannot be used (a file, a dangling symbolic link, on a read-only file system, on a full
disk) is one line with a HINT, at ``JitTrainer(...)`` or at the first test write of ``train()``; never upstream's
``os.makedirs`` traceback, and nothing there is changed.

Real: a single-process JitTrainer on a tiny GPT-2 (a few seconds each), real tmpfs mounts (root) for the read-only
and the full file system.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import disk_helpers
import pytest
from disk_helpers import assert_one_line, fill

from slurm_jit.train import writable
from slurm_jit.train.refusals import JitRefusal

MOUNT_TIMEOUT_S = 60
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def _trainer(out: Path) -> object:
    import transformers

    from slurm_jit import demo_train
    from slurm_jit.train.trainer import JitConfig, JitTrainer

    targs = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=2,
                                           save_steps=1, per_device_train_batch_size=2, disable_tqdm=True)
    return JitTrainer(model=demo_train.build_model("gpt2", 16, 1), args=targs,
                      train_dataset=demo_train._Tokens(8, seed=1), jit_config=JitConfig(kill_wait_s=0))


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    with disk_helpers.tmpfs(tmp_path / "fs", 256 * 1024) as mount:
        yield mount


def test_an_output_dir_that_is_a_file_is_refused_in_one_line_and_the_file_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_text("my notes\n")
    with pytest.raises(JitRefusal) as caught:
        _trainer(out)
    assert_one_line(str(caught.value), f"{out} is a file, not a directory")
    assert out.read_text() == "my notes\n"


def test_an_output_dir_that_is_a_dangling_link_names_the_missing_target_and_creates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "scratch" / "run1")  # storage not mounted here
    with pytest.raises(JitRefusal) as caught:
        _trainer(out)
    assert_one_line(str(caught.value), f"symbolic link to {tmp_path / 'scratch' / 'run1'}, which does not exist")
    assert out.is_symlink() and not (tmp_path / "scratch").exists()


@needs_root
def test_an_output_dir_to_be_created_on_a_read_only_file_system_is_one_line(tmpfs: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True, timeout=MOUNT_TIMEOUT_S)
    out = tmpfs / "runs" / "out"
    with pytest.raises(JitRefusal) as caught:
        _trainer(out)
    assert_one_line(str(caught.value), "cannot be created", "Read-only file system (EROFS)", "writable from every node")


@needs_root
def test_a_full_disk_at_the_first_test_write_is_one_line_with_the_free_space_hint(tmpfs: Path) -> None:
    out = tmpfs / "out"
    trainer = _trainer(out)  # the directory is made while there is room
    fill(tmpfs)
    with pytest.raises(JitRefusal) as caught:
        trainer.train()  # type: ignore[attr-defined]
    assert_one_line(str(caught.value), "No space left on device (ENOSPC)", "free space on", "df -h")
    assert not list(out.rglob(f"{writable.PROBE_PREFIX}*"))  # the test write is removed
    assert not list(out.glob("checkpoint-*"))
