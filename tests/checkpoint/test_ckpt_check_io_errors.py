"""ckpt-check when the world fails it: a closed stdout, a checkpoint deleted during the scan, a quarantine that
cannot rename. One line with a HINT, exit 2 (never a verdict), nothing lost. Crafted directories, no training.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ckpt_factory
import pytest

from slurm_jit.checkpoint import protocol

SUBPROCESS_TIMEOUT_S = 60  # one ckpt-check start (imports only) on a loaded 2-core machine


def test_ckpt_check_closed_stdout_says_so_without_traceback(tmp_path: Path) -> None:
    ckpt_factory.checkpoint(tmp_path, 4)
    read_end, write_end = os.pipe()
    os.close(read_end)  # `ckpt-check OUT | head -1` once head has gone
    try:
        done = subprocess.run([sys.executable, "-m", "slurm_jit.checkpoint.ckpt_check", str(tmp_path)],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, check=False,
                              timeout=SUBPROCESS_TIMEOUT_S)
    finally:
        os.close(write_end)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert "standard output was closed" in done.stderr and "HINT:" in done.stderr, done.stderr


def test_a_checkpoint_deleted_during_the_scan_is_skipped_with_a_note(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    paths = {step: ckpt_factory.checkpoint(tmp_path, step) for step in (2, 4)}
    real_inspect = protocol.inspect

    def rotated_meanwhile(path: Path, step: int, **kwargs: object) -> protocol.CheckpointInfo:
        if step == 4:
            shutil.rmtree(path)  # another job's rotation, between the listing and the check
        return real_inspect(path, step, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(protocol, "inspect", rotated_meanwhile)
    run = ckpt_factory.run_ckpt_check(tmp_path)
    assert run.code == 0 and run.last_line == os.fsencode(paths[2]), run
    assert "checkpoint-4: vanished while being checked" in run.stderr, run.stderr


def test_quarantine_that_cannot_rename_loses_nothing_and_says_so(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt_factory.checkpoint(tmp_path, 2, created=time.time() - 100.0)
    broken = ckpt_factory.checkpoint(tmp_path, 4)
    (broken / protocol.SENTINEL_NAME).write_text("killed mid-save")
    taken = tmp_path / "checkpoint-4.incomplete"  # created by another process after the name was chosen
    (taken / "evidence").mkdir(parents=True)
    monkeypatch.setattr(protocol, "quarantine_path", lambda _path: taken)
    run = ckpt_factory.run_ckpt_check(tmp_path, "--quarantine")
    assert run.code == 2 and "HINT:" in run.stderr and "nothing was deleted" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr, run.stderr
    assert (broken / protocol.SENTINEL_NAME).exists() and (taken / "evidence").is_dir()
