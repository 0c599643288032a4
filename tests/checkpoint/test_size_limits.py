"""Hostile inputs to ckpt-check and to ``python -m slurm_jit.exactness``: each a crafted directory, no training.

Every bad input must give one line with a HINT and exit 2 ("no verdict"), never a traceback and never an exit
status that reads as a verdict (exactness: 1 = "different"; ckpt-check: 1 = "none resumable").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ckpt_factory
import pytest
import torch

from slurm_jit import exactness
from slurm_jit.checkpoint import formats, protocol

SUBPROCESS_TIMEOUT_S = 60  # one ckpt-check start (imports only) on a loaded 2-core machine


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


# ---------------------------------------------------------------- exactness


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


# ---------------------------------------------------------------- ckpt-check


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


# ---------------------------------------------------------------- ordering: clocks cannot reorder writes


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


# ---------------------------------------------------------------- a long run's trainer_state.json


def long_run_state(step: int, entries: int) -> str:
    """trainer_state.json as Trainer writes it (indent=2, sorted keys) with one log entry per step."""
    log = [{"epoch": i / 1000, "grad_norm": 1.25, "learning_rate": 5e-05, "loss": 2.5, "step": i}
           for i in range(1, entries + 1)]
    return json.dumps({"global_step": step, "log_history": log, "max_steps": 10**6}, indent=2, sort_keys=True)


@pytest.fixture
def small_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caps at kilobytes, so that the paths past them run on files written in milliseconds."""
    monkeypatch.setattr(formats, "JSON_MAX_BYTES", 4 * 1024)
    monkeypatch.setattr(formats, "TRAINER_STATE_MAX_BYTES", 64 * 1024)


@pytest.mark.usefixtures("small_caps")
def test_a_long_runs_trainer_state_over_the_parse_cap_is_still_resumable(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 7, manifest=False)
    (ckpt / "trainer_state.json").write_text(long_run_state(7, 100))  # ~14 KiB: over the parse cap
    assert (ckpt / "trainer_state.json").stat().st_size > formats.JSON_MAX_BYTES
    info = protocol.inspect(ckpt, 7)
    assert info.status is protocol.Status.UNVERIFIED, info.reason


@pytest.mark.usefixtures("small_caps")
@pytest.mark.parametrize(("content", "why"), [
    (long_run_state(7, 100)[:-3], "unbalanced"),  # truncated
    (long_run_state(8, 100), "global_step 8"),  # another step
    (long_run_state(7, 100)[:-1] + ', "global_step": 9}', "global_step 9"),  # duplicate key: the last wins
    ("[" + long_run_state(7, 100) + "]", "not one JSON object"),
    (long_run_state(7, 600), "too large"),  # over the scan cap too
])
def test_a_big_trainer_state_is_scanned_strictly(tmp_path: Path, content: str, why: str) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 7, manifest=False)
    (ckpt / "trainer_state.json").write_text(content)
    info = protocol.inspect(ckpt, 7)
    assert info.status is protocol.Status.CORRUPT and why in info.reason, info.reason


def test_a_huge_global_step_is_shown_cut(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 4, manifest=False)
    (ckpt / "trainer_state.json").write_text('{"global_step": 1%s}' % ("0" * 400))
    info = protocol.inspect(ckpt, 4)
    assert info.status is protocol.Status.CORRUPT and len(info.reason) < 120, info.reason


# ---------------------------------------------------------------- races with other processes


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


def test_json_shows_the_save_sequence(tmp_path: Path) -> None:
    for step in (5, 3):
        ckpt_factory.checkpoint(tmp_path, step)
    run = ckpt_factory.run_ckpt_check(tmp_path, "--json")
    rows = json.loads(run.stdout)["checkpoints"]
    assert [(r["step"], r["save_seq"]) for r in rows] == [(3, 2), (5, 1)], rows


def inspect_at_default_recursion_limit(ckpt: Path, step: int) -> protocol.CheckpointInfo:
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # CPython's default (pytest may run with a higher one)
    try:
        return protocol.inspect(ckpt, step)
    finally:
        sys.setrecursionlimit(previous)


def test_a_very_deep_tree_is_walked_without_recursion(tmp_path: Path) -> None:
    ckpt = ckpt_factory.checkpoint(tmp_path, 4)
    deep = ckpt
    for _ in range(1500):  # ~3000 bytes of path: within PATH_MAX; made level by level (makedirs recurses)
        deep = deep / "d"
        deep.mkdir()
    info = inspect_at_default_recursion_limit(ckpt, 4)
    assert info.status is protocol.Status.COMPLETE and info.size_bytes is not None, info.reason
    (deep / "stray.json").write_text("{not json")  # and the walk reaches the bottom
    try:
        info = inspect_at_default_recursion_limit(ckpt, 4)
        assert info.status is protocol.Status.INCOMPLETE and "stray.json" in info.reason, info.reason
    finally:
        (deep / "stray.json").unlink()
        while deep != ckpt:  # level by level: pytest's own cleanup (shutil.rmtree) recurses and would fail
            deep.rmdir()
            deep = deep.parent


def test_a_manifest_over_64_mib_is_not_parsed(tmp_path: Path) -> None:
    """256 MiB of tiny JSON objects took 6.6 GB to parse: the cap is what bounds ckpt-check's memory."""
    ckpt = ckpt_factory.checkpoint(tmp_path, 4)
    path = ckpt / protocol.MANIFEST_NAME
    text = path.read_text()
    path.write_text(text + " " * (64 * 1024 * 1024 + 1 - len(text)))  # valid JSON, one byte over
    info = protocol.inspect(ckpt, 4)
    assert info.status is protocol.Status.CORRUPT and "too large" in info.reason, info.reason


def test_the_trainer_writes_the_save_sequence(jit_zero2_run: Path) -> None:
    """The real JitTrainer path (ZeRO-2, 2 ranks; the session's shared run): periodic 3 then final 6."""
    seqs = {step: json.loads((jit_zero2_run / f"checkpoint-{step}" / protocol.MANIFEST_NAME).read_text())["save_seq"]
            for step in (3, 6)}
    assert seqs == {3: 1, 6: 2}, seqs
    assert [c.save_seq for c in protocol.scan(jit_zero2_run)[0]] == [2, 1]
