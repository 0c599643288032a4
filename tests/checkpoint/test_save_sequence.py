"""Resume picks by the save sequence, not by clocks: a node's clock ahead or a far-future created time cannot
reorder writes; checkpoints without a sequence keep their place by time; ckpt-check --json and the real trainer
show and write the sequence.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ckpt_factory

from slurm_jit.checkpoint import protocol


def test_a_node_clock_ahead_cannot_make_resume_pick_an_older_checkpoint(tmp_path: Path) -> None:
    now = time.time()
    older = ckpt_factory.checkpoint(tmp_path, 10, created=now + 300.0, mtime=now + 300.0)  # node 5 min ahead
    newer = ckpt_factory.checkpoint(tmp_path, 12, created=now, mtime=now)  # the next job, on a correct clock
    res = protocol.find_resumable(tmp_path)
    assert res.checkpoint is not None and res.checkpoint.path == newer, [c.step for c in res.checkpoints]
    checkpoints, _ = protocol.scan(tmp_path)
    assert [c.path for c in protocol.rotation_victims(checkpoints, 1)] == [older]  # never the newer one


def test_a_far_future_created_time_cannot_pin_resume_to_an_old_checkpoint(tmp_path: Path) -> None:
    ckpt_factory.checkpoint(tmp_path, 4, created=float(2**33 - 1))  # year 2242, still "plausible"
    later = ckpt_factory.checkpoint(tmp_path, 2, created=1_000_000_000.0)  # a rollback, clock in 2001
    res = protocol.find_resumable(tmp_path)
    assert res.checkpoint is not None and res.checkpoint.path == later


def test_checkpoints_without_a_sequence_keep_their_place_by_time(tmp_path: Path) -> None:
    now = time.time()
    ckpt_factory.checkpoint(tmp_path, 3, created=now - 300.0)
    plain = ckpt_factory.checkpoint(tmp_path, 5, manifest=False, mtime=now - 200.0)  # plain Trainer
    last = ckpt_factory.checkpoint(tmp_path, 4, created=now - 100.0)
    assert [c.path for c in protocol.scan(tmp_path)[0]] == [last, plain, tmp_path / "checkpoint-3"]
    assert protocol.next_save_seq(tmp_path) == 3


def test_json_shows_the_save_sequence(tmp_path: Path) -> None:
    for step in (5, 3):
        ckpt_factory.checkpoint(tmp_path, step)
    run = ckpt_factory.run_ckpt_check(tmp_path, "--json")
    rows = json.loads(run.stdout)["checkpoints"]
    assert [(r["step"], r["save_seq"]) for r in rows] == [(3, 2), (5, 1)], rows


def test_the_trainer_writes_the_save_sequence(jit_zero2_run: Path) -> None:
    """The real JitTrainer path (ZeRO-2, 2 ranks; the session's shared run): periodic 3 then final 6."""
    seqs = {step: json.loads((jit_zero2_run / f"checkpoint-{step}" / protocol.MANIFEST_NAME).read_text())["save_seq"]
            for step in (3, 6)}
    assert seqs == {3: 1, 6: 2}, seqs
    assert [c.save_seq for c in protocol.scan(jit_zero2_run)[0]] == [2, 1]
