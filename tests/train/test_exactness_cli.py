"""Hostile inputs to ``python -m slurm_jit.exactness``: each a crafted directory, no training. Every bad input
gives one line with a HINT and exit 2 ("no verdict"), never a traceback and never 1 ("different").
"""

from __future__ import annotations

import os
from pathlib import Path

import ckpt_factory
import pytest
import torch

from slurm_jit import exactness


def run_exactness(capsys: pytest.CaptureFixture[str], *args: Path | str) -> tuple[int, str]:
    with ckpt_factory.time_bound(ckpt_factory.CHECK_TIMEOUT_S):
        code = exactness.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def dump(path: Path, **state: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def assert_bad_input(code: int, text: str) -> None:
    assert code == 2 and "HINT:" in text and "Traceback" not in text, text
    assert len(text.strip().splitlines()) == 1, text


def test_exactness_unreadable_file_is_bad_input_not_different(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "rank0.pt").write_bytes(b"junk, not a torch.save file")
    assert_bad_input(*run_exactness(capsys, tmp_path / "a", tmp_path / "b"))


def test_exactness_fifo_is_refused_without_blocking(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        os.mkfifo(tmp_path / side / "rank0.pt")
    assert_bad_input(*run_exactness(capsys, tmp_path / "a", tmp_path / "b"))


def test_exactness_stray_step_directory_is_not_a_crash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for side in ("a", "b"):
        dump(tmp_path / side / exactness.STATE_DIR / "step-3" / "rank0.pt", global_step=3, w=torch.ones(2))
        (tmp_path / side / exactness.STATE_DIR / "step-old").mkdir()  # a user's copy, not a dump
    code, text = run_exactness(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 0 and text.startswith("bitwise equal"), text


def test_exactness_refuses_different_steps_and_world_sizes(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    dump(tmp_path / "s3" / "rank0.pt", global_step=3, w=torch.ones(2))
    dump(tmp_path / "s5" / "rank0.pt", global_step=5, w=torch.ones(2))
    code, text = run_exactness(capsys, tmp_path / "s3", tmp_path / "s5")
    assert_bad_input(code, text)
    assert "step" in text
    dump(tmp_path / "w2" / "rank0.pt", global_step=3, w=torch.ones(2))
    dump(tmp_path / "w2" / "rank1.pt", global_step=3, w=torch.ones(2))
    code, text = run_exactness(capsys, tmp_path / "s3", tmp_path / "w2")
    assert_bad_input(code, text)
    assert "world sizes" in text


def test_exactness_nothing_to_compare_is_not_bitwise_equal(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    for side in ("a", "b"):
        dump(tmp_path / side / "rank0.pt")  # an empty state: "bitwise equal: 0 entries" proves nothing
    assert_bad_input(*run_exactness(capsys, tmp_path / "a", tmp_path / "b"))


def test_exactness_never_unpickles_without_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "unpickled"
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        ckpt_factory.write_evil_pt(tmp_path / side / "rank0.pt", marker)
    code, text = run_exactness(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 2 and "--unpickle" in text and not marker.exists(), text
