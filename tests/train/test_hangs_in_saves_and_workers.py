"""The hang watchdog against hangs where no step boundary comes, on 2 real DeepSpeed ranks: a writer stuck inside
the JIT save after a stop signal (the record must say ``hung``, never ``jit_stop``, and the previous checkpoint stay
picked), and a DataLoader worker blocked in its fetch (the rank ends as ``hung``, and its worker with it)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import jit_helpers
import pytest

from slurm_jit import local_ranks
from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record, watchdog

pytestmark = pytest.mark.deepspeed

HANG_TIMEOUT_S = 15  # a step's bound: generous for a loaded 2-core host's steps
EXIT_WITHIN_S = HANG_TIMEOUT_S + 30  # the bound: every rank gone within hang_timeout + 30 s
FOREVER_S = 100_000
# demo_train with the long phases' bound (a save) cut to seconds: the save's own bound is 10 x the step bound, at
# least 600 s, too long for a test
SHORT_LONG_PHASES = [str(Path(__file__).parents[1] / "helpers" / "demo_short_long_phases.py")]


@dataclass
class HungRun:
    out: Path
    codes: list[int | None]
    exit_s: float  # from the stall until every rank exited
    logs: list[str]
    leftover_groups: list[int]  # ranks whose process group still had a process once the rank itself exited


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_all(ranks: local_ranks.Ranks, t0: float) -> HungRun:
    deadline = t0 + EXIT_WITHIN_S + 60  # past the bound only to tell "late" from "never"
    while any(p.poll() is None for p in ranks.procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    exit_s = time.monotonic() - t0
    time.sleep(2.0)  # a DataLoader worker's own parent check runs every 5 s; one stuck in a fetch never runs it
    leftover = [r for r, p in enumerate(ranks.procs) if p.poll() is not None and _group_alive(p.pid)]
    codes = ranks.wait(0.1)
    return HungRun(out=Path(), codes=codes, exit_s=exit_s, logs=[ranks.log(0), ranks.log(1)],
                   leftover_groups=leftover)


@pytest.fixture(scope="module")
def stuck_jit_save(tmp_path_factory: pytest.TempPathFactory) -> HungRun:
    """Each rank signals itself at step 5; rank 1's on_save blocks inside the JIT save that follows."""
    out = tmp_path_factory.mktemp("stuck-save") / "out"
    ranks = jit_helpers._start(out, [
        "--max-steps", "400", "--save-steps", "2", "--hang-timeout", str(HANG_TIMEOUT_S), "--kill-wait", "0",
        "--signal-self-at-step", "5", "--stall-in", "save", "--stall-at-step", "5", "--stall-rank", "1",
        "--stall-s", str(FOREVER_S)], env={"LONG_PHASE_FACTOR": "0"}, program=SHORT_LONG_PHASES)[0]
    jit_helpers.wait_for_steps(ranks, out, 5)
    run = _wait_all(ranks, time.monotonic())
    run.out = out
    return run


@pytest.fixture(scope="module")
def stuck_worker(tmp_path_factory: pytest.TempPathFactory) -> HungRun:
    """Rank 1's one DataLoader worker blocks once it has fetched 8 steps' items (it fetches ahead of the steps)."""
    out = tmp_path_factory.mktemp("stuck-worker") / "out"
    ranks = jit_helpers.start_ranks(out, [
        "--max-steps", "400", "--save-steps", "2", "--hang-timeout", str(HANG_TIMEOUT_S), "--workers", "1",
        "--stall-in", "worker", "--stall-at-step", "8", "--stall-rank", "1", "--stall-s", str(FOREVER_S)])
    jit_helpers.wait_for_steps(ranks, out, 3)  # checkpoint-2 is complete
    run = _wait_all(ranks, time.monotonic())
    run.out = out
    return run


def _assert_hung_and_previous_picked(run: HungRun, oldest: int) -> dict:
    """``hung``; the newest checkpoint with a manifest (at least checkpoint-``oldest``) is picked, newer ones are
    the stuck save's (no manifest)."""
    assert run.codes[1] == watchdog.HUNG_EXIT_CODE, (run.codes, run.logs[1][-3000:])
    assert run.codes[0] not in (None, 0), (run.codes, run.logs[0][-3000:])
    assert run.exit_s < EXIT_WITHIN_S, run.exit_s
    record = stop_record.read(run.out)
    assert record is not None and record["state"] == "hung", record
    found = protocol.find_resumable(run.out).checkpoint
    assert found is not None and found.step >= oldest, found
    for ckpt in run.out.glob("checkpoint-*"):
        assert int(ckpt.name.split("-")[1]) <= found.step or not (ckpt / protocol.MANIFEST_NAME).exists(), ckpt
    return record


def test_a_writer_stuck_in_the_jit_save_ends_as_hung_never_jit_stop(stuck_jit_save: HungRun) -> None:
    record = _assert_hung_and_previous_picked(stuck_jit_save, 4)
    stuck = {r["rank"]: r for r in record["ranks"]}
    assert stuck[1]["phase"] == "save" and "on_save" in stuck[1]["frame"], record
    assert "JIT stop" not in stuck_jit_save.logs[0], stuck_jit_save.logs[0][-3000:]
    assert protocol.find_resumable(stuck_jit_save.out).checkpoint.path.name == "checkpoint-4"


def test_a_blocked_dataloader_worker_ends_its_rank_as_hung(stuck_worker: HungRun) -> None:
    record = _assert_hung_and_previous_picked(stuck_worker, 2)
    stuck = {r["rank"]: r for r in record["ranks"]}
    assert stuck[1]["phase"] == "step", record
    assert "slurm_jit: hang on rank 1" in stuck_worker.logs[1], stuck_worker.logs[1][-3000:]


def test_a_hung_rank_s_dataloader_worker_ends_with_it(stuck_worker: HungRun) -> None:
    assert stuck_worker.leftover_groups == [], "a DataLoader worker outlived its hung rank"
