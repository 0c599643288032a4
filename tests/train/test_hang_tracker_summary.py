"""The TensorBoard stop summary of a hang and of a lost peer: a real ``TensorBoardCallback``'s writer writes the
text, read back from the event file. The trainer is a stand-in with only what the summary reads (rank 0, its
callbacks): the real watchdog path that calls it is run by tests/train/test_hang_watchdog.py."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers.integrations import TensorBoardCallback

from slurm_jit.train import trackers


def _stop_texts(log_dir: Path) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode())
            for e in events.Tensors(f"{trackers.STOP_KEY}/text_summary")]


def _trainer(log_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(log_dir))
    callback = TensorBoardCallback()
    return SimpleNamespace(is_world_process_zero=lambda: True,
                           callback_handler=SimpleNamespace(callbacks=[callback]))


HUNG = {"state": "hung", "step": 6, "ranks": [
    {"rank": 0, "node": "node1", "step": 6, "since_s": 30.0, "frame": "distributed_c10d.py:2 in all_reduce"},
    {"rank": 1, "node": "node2", "step": 6, "since_s": 30.0, "frame": "train.py:12 in on_step_begin"}]}
LOST = {"state": "failed", "step": 9, "lost_peer": {"rank": 1, "step": 9, "node": None, "how": "gone"}}


@pytest.mark.parametrize(("record", "says"), [
    (HUNG, "hang at step 6 on rank 1 (node node2), stack in the log; a requeued job resumes"),
    (LOST, "peer rank 1 lost at step 9; a requeued job resumes"),
])
def test_tensorboard_summary_names_the_hung_rank_or_the_lost_peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  record: dict[str, Any], says: str) -> None:
    trainer = _trainer(tmp_path, monkeypatch)
    trackers.log_hang_to_trackers(trainer, record)
    texts = _stop_texts(tmp_path)
    assert len(texts) == 1 and texts[0][0] == record["step"] and texts[0][1].startswith(says), texts


def test_a_tracker_that_hangs_delays_the_hang_exit_by_its_bound_only(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _trainer(tmp_path, monkeypatch)
    monkeypatch.setattr(trackers, "TRACKER_WAIT_S", 0.5)
    monkeypatch.setattr(trackers, "_log_stop_tensorboard", lambda *a: time.sleep(60))  # a writer on a dead mount
    started = time.monotonic()
    trackers.log_hang_to_trackers(trainer, HUNG)
    assert time.monotonic() - started < 5, "the hang's exit waited for a stuck tracker"
