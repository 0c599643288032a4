"""The caps that bound what ckpt-check and resume read: a long run's trainer_state.json over the parse cap stays
resumable, a big one is scanned strictly, a huge global step is shown cut, a very deep tree is walked without
recursion, a manifest over 64 MiB is not parsed. Crafted directories, no training.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ckpt_factory
import pytest

from slurm_jit.checkpoint import formats, protocol


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
