"""Lost peers on 2 real DeepSpeed ranks (ZeRO-2, gloo): rank 1 SIGKILLed, then SIGTERM to rank 0 a second later
(what Slurm >= 23 sends a crashed task's siblings), rank 1 SIGKILLed inside the JIT save, and rank 1 late to the
stop round by more than side_group_timeout_s. Rank 0 ends within side_group_timeout_s + 30 s with the stop record
``failed`` naming the lost rank; no ``jit_stop``, no checkpoint lacking rank 1's shard called complete, ckpt-check
still picks the newest complete one."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jit_helpers
import pytest

from slurm_jit import local_ranks
from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record
from slurm_jit.train.save_path import FAULT_SAVE_SLEEP_ENV

pytestmark = pytest.mark.deepspeed

SIDE_GROUP_TIMEOUT_S = 1800  # JitConfig's default, which demo_train uses
EXIT_WITHIN_S = 30  # the bound is side_group_timeout_s + 30 s; gloo sees a killed peer at once
KILL_AFTER_STEP = 5  # the newest periodic checkpoint before it: checkpoint-4 (--save-steps 2)
SAVE_SLEEP_S = 4  # run B: every save stalls this long, so that rank 1 dies inside the JIT save
STALLED_TIMEOUT_S = 5  # run C: the side group's timeout ...
STALLED_S = 15  # ... and how long rank 1 is late to the stop round


@dataclass
class LostRun:
    out: Path
    codes: list[int | None]
    exit_s: float  # from rank 1's SIGKILL until rank 0 exited
    log: str  # rank 0's


def _rank0_ended(out: Path, ranks: local_ranks.Ranks, t0: float, others_s: float = 0.1) -> LostRun:
    """Once rank 0 exited (seconds after ``t0``), the other ranks given ``others_s`` more."""
    deadline = t0 + STALLED_S + EXIT_WITHIN_S + 60  # past the bound only to tell "late" from "never"
    while ranks.procs[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    exit_s = time.monotonic() - t0
    return LostRun(out=out, codes=ranks.wait(others_s), exit_s=exit_s, log=ranks.log(0))


@pytest.fixture(scope="module")
def killed_then_term(tmp_path_factory: pytest.TempPathFactory) -> LostRun:
    """Rank 1 SIGKILLed in the step after step 5, SIGTERM to rank 0 one second later (it is still in that step)."""
    out = tmp_path_factory.mktemp("lost") / "out"
    ranks = jit_helpers.start_ranks(out, ["--max-steps", "400", "--save-steps", "2", "--step-sleep", "2"])
    jit_helpers.wait_for_steps(ranks, out, KILL_AFTER_STEP)
    t0 = time.monotonic()
    ranks.signal(1, signal.SIGKILL)
    time.sleep(1.0)
    ranks.signal(0, signal.SIGTERM)
    return _rank0_ended(out, ranks, t0)


@pytest.fixture(scope="module")
def killed_in_jit_save(tmp_path_factory: pytest.TempPathFactory) -> LostRun:
    """SIGTERM to both ranks; once the JIT save's directory exists (its sentinel), rank 1 is SIGKILLed in it.

    Steps of 2 s: the stop lands on step 4 or 5, never on the periodic save of step 6 (with fast steps, a loaded
    host let steps 5 and 6 pass before the signal: the JIT stop then found checkpoint-6 saved, began no save)."""
    out = tmp_path_factory.mktemp("lost-save") / "out"
    ranks = jit_helpers.start_ranks(out, ["--max-steps", "400", "--save-steps", "3", "--kill-wait", "0",
                                          "--step-sleep", "2"], env={FAULT_SAVE_SLEEP_ENV: str(SAVE_SLEEP_S)})
    jit_helpers.wait_for_steps(ranks, out, 4)  # checkpoint-3 is complete
    before = {p.name for p in out.glob("checkpoint-*")}
    ranks.signal(0)
    ranks.signal(1)
    jit_helpers.wait_for(ranks, "began a JIT save", lambda: bool({p.name for p in out.glob("checkpoint-*")} - before),
                         timeout_s=60, poll_s=0.01)
    t0 = time.monotonic()
    ranks.signal(1, signal.SIGKILL)
    return _rank0_ended(out, ranks, t0)


@pytest.fixture(scope="module")
def stalled_past_side_group_timeout(tmp_path_factory: pytest.TempPathFactory) -> LostRun:
    """Rank 1 alive but late to the stop round by more than side_group_timeout_s: rank 0's round times out. With
    short steps the rounds are read one step late (overlapped): rank 0 sees the timeout only at the next boundary,
    once rank 1 is back, and rank 1 sees rank 0's side closed there too: both fail, both report."""
    out = tmp_path_factory.mktemp("stalled") / "out"
    ranks = jit_helpers.start_ranks(out, ["--max-steps", "400", "--save-steps", "2", "--side-group-timeout",
                                          str(STALLED_TIMEOUT_S), "--stall-in", "step_end", "--stall-at-step", "5",
                                          "--stall-rank", "1", "--stall-s", str(STALLED_S)])
    jit_helpers.wait_for_steps(ranks, out, 4)
    t0 = time.monotonic()  # step 5 (where rank 1 stalls) is milliseconds from here
    return _rank0_ended(out, ranks, t0, others_s=STALLED_S + EXIT_WITHIN_S)


def _assert_failed_naming_rank1(run: LostRun) -> dict:
    assert run.codes[0] not in (None, 0), (run.codes, run.log[-3000:])
    assert run.exit_s < SIDE_GROUP_TIMEOUT_S + 30 and run.exit_s < EXIT_WITHIN_S, run.exit_s
    record = stop_record.read(run.out)
    assert record is not None and record["state"] == "failed", record
    lost = record["lost_peer"]
    assert lost["rank"] == 1 and lost["node"] == socket.gethostname(), record
    assert lost["step"] >= KILL_AFTER_STEP - 1 and "by peer" in lost["how"] and "\n" not in lost["how"], record
    assert "JIT stop" not in run.log, run.log[-3000:]
    assert "slurm_jit: peer rank 1 (node " in run.log and "HINT:" in run.log, run.log[-3000:]
    return record


def _assert_newest_complete_is_picked(out: Path, newest: str) -> None:
    """Every checkpoint with a manifest is one saved while both ranks lived; ckpt-check picks the newest."""
    found = protocol.find_resumable(out).checkpoint
    assert found is not None and found.path.name == newest, found
    check = jit_helpers.ckpt_check(out, "--deep")
    assert check.returncode == 0 and check.stdout.splitlines()[-1] == str(out / newest), check.stdout + check.stderr
    newer = [p for p in out.glob("checkpoint-*") if int(p.name.split("-")[1]) > int(newest.split("-")[1])]
    for ckpt in newer:
        assert not (ckpt / protocol.MANIFEST_NAME).exists() and (ckpt / protocol.SENTINEL_NAME).exists(), ckpt


def test_rank1_killed_then_term_to_rank0_ends_rank0_promptly_naming_rank1(killed_then_term: LostRun) -> None:
    _assert_failed_naming_rank1(killed_then_term)


def test_a_term_after_a_peer_is_lost_saves_nothing_new_called_complete(killed_then_term: LostRun) -> None:
    _assert_newest_complete_is_picked(killed_then_term.out, "checkpoint-4")


def test_stop_record_cli_says_which_peer_was_lost(killed_then_term: LostRun) -> None:
    cli = subprocess.run([sys.executable, "-m", "slurm_jit.stop_record", str(killed_then_term.out)],
                         capture_output=True, text=True, check=False)
    assert cli.returncode == stop_record.EXIT_CRASHED, (cli.stdout, cli.stderr)
    assert cli.stdout.startswith("failed step=") and " peer rank 1 lost (node " in cli.stdout, cli.stdout


def test_rank1_killed_inside_the_jit_save_leaves_it_incomplete_and_the_record_failed(
        killed_in_jit_save: LostRun) -> None:
    _assert_failed_naming_rank1(killed_in_jit_save)
    _assert_newest_complete_is_picked(killed_in_jit_save.out, "checkpoint-3")


def test_a_peer_late_past_the_side_group_timeout_is_named_by_the_first_survivor(
        stalled_past_side_group_timeout: LostRun) -> None:
    run = stalled_past_side_group_timeout
    assert None not in run.codes and run.codes[0] != 0 and run.codes[1] != 0, (run.codes, run.log[-3000:])
    assert run.exit_s < STALLED_TIMEOUT_S + 30, run.exit_s  # rank 0: gone within side_group_timeout_s + 30 s
    record = stop_record.read(run.out)
    assert record is not None and record["state"] == "failed", record
    # rank 1, back from its stall, found rank 0 gone or failing too: whichever rank writes first, rank 1 is named
    assert record["lost_peer"]["rank"] == 1 and "imed out" in record["lost_peer"]["how"], record
