"""The ``universal/`` conversion inside ``checkpoint-S`` (issue 13) never changes the verdict on ``checkpoint-S``
itself: crafted directories (tests/ckpt_factory.py), milliseconds, no torch."""

from __future__ import annotations

import os
from pathlib import Path

import ckpt_factory

from slurm_jit.checkpoint import elastic_plan, protocol


def _half_conversion(ckpt: Path) -> Path:
    """What a SIGKILL during ds_to_universal leaves: the sentinel, and a .pt file cut off mid-write."""
    universal = elastic_plan.universal_dir(ckpt)
    protocol.write_sentinel(universal, 5, "jit")
    cut = universal / "global_step5" / "zero" / "lm_head.weight" / "fp32.pt"
    ckpt_factory.torch_like_zip(cut)
    cut.write_bytes(cut.read_bytes()[:20])  # a zip local header and nothing after it
    return universal


def test_a_half_written_conversion_leaves_the_original_complete_and_chosen(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True)
    _half_conversion(ckpt)
    info = protocol.inspect(ckpt, 5, deep=True)
    assert info.status is protocol.Status.COMPLETE, info.reason
    run = ckpt_factory.run_ckpt_check(tmp_path, "--world-size", "1")
    assert run.code == 0 and run.last_line == os.fsencode(ckpt), run.stdout


def test_a_foreign_file_in_universal_does_not_make_the_original_corrupt(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True)
    universal = elastic_plan.universal_dir(ckpt)
    universal.mkdir()
    os.mkfifo(universal / "pipe")  # not a regular file: the conversion's business, not the original's
    assert protocol.inspect(ckpt, 5).status is protocol.Status.COMPLETE
    assert not elastic_plan.universal_complete(ckpt, 5)


def test_universal_as_a_symlink_or_a_file_leaves_the_original_complete(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 5, world=2, deepspeed=True)
    elastic_plan.universal_dir(ckpt).symlink_to(tmp_path)
    assert protocol.inspect(ckpt, 5).status is protocol.Status.COMPLETE
    elastic_plan.universal_dir(ckpt).unlink()
    os.mkfifo(elastic_plan.universal_dir(ckpt))
    assert protocol.inspect(ckpt, 5).status is protocol.Status.COMPLETE
    assert elastic_plan.plan(ckpt, 1).action == elastic_plan.CONVERT
