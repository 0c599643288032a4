"""The logging window's file (train/logging_window.py): read back bit for bit, non-finite values included; a file
that is there but unusable is a WindowError (one warning at the resume, never a traceback); another world size
takes the old ranks' mean."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from slurm_jit.train import logging_window
from slurm_jit.train.logging_window import Window, WindowError

WINDOW = Window(step=9, world_size=2, tr_loss=7.123456789, globalstep_last_logged=7, total_loss_scalar=3.9,
                chain_first_step=0, train_metrics={"entropy": [4.1, 4.2], "num_tokens": [132]}, total_train_tokens=132)


def _write_both(ckpt: Path, window: Window = WINDOW) -> None:
    logging_window.write(ckpt, 0, window)
    logging_window.write(ckpt, 1, dataclasses.replace(window, tr_loss=1.5))


def test_a_window_reads_back_exactly_nan_and_infinity_included(tmp_path: Path) -> None:
    _write_both(tmp_path)
    assert logging_window.read(tmp_path, 0, 2) == WINDOW
    assert logging_window.read(tmp_path, 1, 2) == dataclasses.replace(WINDOW, tr_loss=1.5)
    odd = dataclasses.replace(WINDOW, tr_loss=math.nan, total_loss_scalar=-math.inf,
                              train_metrics={"aux_loss": [math.inf]})
    logging_window.write(tmp_path, 0, odd)
    json.loads((tmp_path / "jit-logging-rank0.json").read_text(), parse_constant=pytest.fail)  # standard JSON
    back = logging_window.read(tmp_path, 0, 2)
    assert back is not None and math.isnan(back.tr_loss) and back.total_loss_scalar == -math.inf
    assert back.train_metrics == {"aux_loss": [math.inf]}


def test_another_world_size_takes_the_old_ranks_mean(tmp_path: Path) -> None:
    _write_both(tmp_path)
    one = logging_window.read(tmp_path, 0, 1)
    assert one is not None and one.tr_loss == (7.123456789 + 1.5) / 2 and one.globalstep_last_logged == 7


@pytest.mark.parametrize("edit", [
    lambda w: {**w, "globalstep_last_logged": "x"}, lambda w: {**w, "tr_loss": "abc"},
    lambda w: {k: v for k, v in w.items() if k != "total_loss_scalar"}, lambda w: {**w, "version": 2},
    lambda w: {**w, "train_metrics": {"a": "b"}}, lambda w: {**w, "globalstep_last_logged": 10},
    lambda w: [1, 2], lambda w: {**w, "surprise": 1},
])
def test_an_unusable_file_is_a_window_error(tmp_path: Path, edit: object) -> None:
    _write_both(tmp_path)
    path = tmp_path / "jit-logging-rank0.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))  # type: ignore[operator]
    with pytest.raises(WindowError):
        logging_window.read(tmp_path, 0, 2)


def test_a_truncated_file_or_a_missing_rank_is_a_window_error(tmp_path: Path) -> None:
    _write_both(tmp_path)
    (tmp_path / "jit-logging-rank1.json").unlink()
    with pytest.raises(WindowError, match="missing"):
        logging_window.read(tmp_path, 1, 2)
    with pytest.raises(WindowError):
        logging_window.read(tmp_path, 0, 1)  # another world size needs every old rank's sum
    path = tmp_path / "jit-logging-rank0.json"
    path.write_text(path.read_text()[:20])
    with pytest.raises(WindowError):
        logging_window.read(tmp_path, 0, 2)
    assert logging_window.read(tmp_path / "none", 0, 2) is None  # no window at all: an upstream checkpoint
