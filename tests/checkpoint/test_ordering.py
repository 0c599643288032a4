"""What "newest" means: the checkpoint written last, not the highest step (crafted directories, milliseconds).

Scenario of issue 7 item 2: an output directory holds checkpoint-20 of an earlier run; this run rolled back to
checkpoint-10 and wrote checkpoint-14. Resume must continue from checkpoint-14, and rotation must never delete it.
"""

from __future__ import annotations

import time
from pathlib import Path

import ckpt_factory
import pytest

from slurm_jit.checkpoint import protocol
from slurm_jit.checkpoint.protocol import SENTINEL_NAME, CheckpointInfo, Status

HOUR_S = 3600.0


def rollback_dir(out: Path, *, manifest: bool = True) -> dict[int, Path]:
    """checkpoint-20 of an old run (written 3 h ago), then 10 (2 h ago) and 14 (1 h ago) of this run."""
    now = time.time()
    times = {20: now - 3 * HOUR_S, 10: now - 2 * HOUR_S, 14: now - HOUR_S}
    return {step: ckpt_factory.checkpoint(out, step, manifest=manifest, created=t, mtime=t,
                                          run_id="new" if step != 20 else "old")
            if manifest else ckpt_factory.checkpoint(out, step, manifest=False, mtime=t)
            for step, t in times.items()}


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest-created", "directory-mtime"])
def test_resume_picks_the_checkpoint_written_last_not_the_highest_step(tmp_path: Path, manifest: bool) -> None:
    paths = rollback_dir(tmp_path, manifest=manifest)
    res = protocol.find_resumable(tmp_path)
    assert [c.step for c in res.checkpoints] == [14, 10, 20]
    assert res.checkpoint is not None and res.checkpoint.path == paths[14]
    assert res.passed_over == []
    assert res.checkpoint.status is (Status.COMPLETE if manifest else Status.UNVERIFIED)


def test_written_at_is_the_manifest_time_not_the_directory_mtime(tmp_path: Path) -> None:
    # a copy (cp -r, rsync without -t) gives every directory a fresh mtime; the manifest keeps the write time
    ckpt = ckpt_factory.checkpoint(tmp_path, 7, created=1_700_000_000.0, mtime=time.time())
    info = protocol.inspect(ckpt, 7)
    assert (info.status, info.written_at, info.run_id) == (Status.COMPLETE, 1_700_000_000.0, None)


@pytest.mark.parametrize("created", ["yesterday", None, True, -5, 1e300, float("nan")])
def test_an_implausible_manifest_time_falls_back_to_the_directory_mtime(tmp_path: Path, created: object) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 7, mtime=1_600_000_000.0)
    ckpt_factory.edit_manifest(ckpt, created=created)
    info = protocol.inspect(ckpt, 7)
    assert (info.status, info.written_at) == (Status.COMPLETE, info.mtime)


def test_an_unverified_manifest_time_is_not_believed(tmp_path: Path) -> None:
    now = time.time()
    ckpt_factory.checkpoint(tmp_path, 5, created=now - HOUR_S, mtime=now - HOUR_S)
    forged = ckpt_factory.checkpoint(tmp_path, 9, created=now + 100 * HOUR_S, mtime=now - 2 * HOUR_S)
    (forged / "scheduler.pt").write_bytes(b"x")  # listed size no longer matches: corrupt
    res = protocol.find_resumable(tmp_path)
    assert [(c.step, c.status) for c in res.checkpoints] == [(5, Status.COMPLETE), (9, Status.CORRUPT)]
    assert res.checkpoints[1].written_at == res.checkpoints[1].mtime


def test_broken_checkpoints_written_after_the_resume_point_are_passed_over(tmp_path: Path) -> None:
    paths = rollback_dir(tmp_path)
    (paths[14] / SENTINEL_NAME).write_text("killed mid-save")  # the sentinel write does not change its time
    res = protocol.find_resumable(tmp_path)
    assert res.checkpoint is not None and res.checkpoint.path == paths[10]
    assert [(c.step, c.status) for c in res.passed_over] == [(14, Status.INCOMPLETE)]
    moved = protocol.quarantine(res)  # renames only what was written after the resume point
    assert [src for src, _ in moved] == [paths[14]] and paths[20].is_dir()


def test_equal_times_order_by_step(tmp_path: Path) -> None:
    for step in (3, 12, 6):  # no manifest, so no save_seq: the time decides, then the step
        ckpt_factory.checkpoint(tmp_path, step, manifest=False, mtime=1_700_000_000.0)
    assert [c.step for c in protocol.scan(tmp_path)[0]] == [12, 6, 3]


# ---------------------------------------------------------------- rotation_victims (pure)


def info(step: int, written_at: float, status: Status = Status.COMPLETE) -> CheckpointInfo:
    return CheckpointInfo(path=Path(f"/out/checkpoint-{step}"), step=step, status=status, reason="",
                          written_at=written_at)


def victims(checkpoints: list[CheckpointInfo], limit: int, keep: tuple[str, ...] = ()) -> list[int]:
    return [c.step for c in protocol.rotation_victims(checkpoints, limit, keep)]


def test_rotation_keeps_the_newest_written_not_the_highest_step() -> None:
    ckpts = [info(20, 100.0), info(10, 200.0), info(14, 300.0)]
    assert victims(ckpts, 1) == [10, 20]
    assert victims(ckpts, 2) == [20]
    assert victims(ckpts, 3) == []


def test_rotation_never_returns_an_incomplete_or_corrupt_checkpoint() -> None:
    ckpts = [info(1, 1.0, Status.INCOMPLETE), info(2, 2.0, Status.CORRUPT), info(3, 3.0), info(4, 4.0),
             info(5, 5.0, Status.UNVERIFIED)]
    assert victims(ckpts, 1) == [4, 3]


def test_rotation_keeps_every_path_the_caller_names() -> None:
    ckpts = [info(2, 2.0), info(4, 4.0), info(6, 6.0), info(8, 8.0)]
    assert victims(ckpts, 1, keep=("/out/checkpoint-2", "/out/./checkpoint-4")) == [6]


def test_rotation_never_removes_the_newest_resumable_checkpoint() -> None:
    # save_only_model: periodic saves are model-only, the JIT save is the only resume point; model-only ones rotate
    ckpts = [info(4, 1.0), info(6, 2.0, Status.MODEL_ONLY), info(8, 3.0, Status.MODEL_ONLY),
             info(10, 4.0, Status.MODEL_ONLY)]
    assert victims(ckpts, 2) == [6]


@pytest.mark.parametrize("limit", [0, -1])
def test_rotation_without_a_positive_limit_deletes_nothing(limit: int) -> None:
    assert victims([info(1, 1.0), info(2, 2.0)], limit) == []
