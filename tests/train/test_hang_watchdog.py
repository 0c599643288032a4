"""The hang watchdog on 2 real DeepSpeed ranks: a rank blocked in user code ends every rank as ``hung`` within
hang_timeout + 30 s, stacks in the log; a frozen rank (SIGSTOP) is the one named; long legitimate phases (a slow
first step, a slow save, a long evaluation) with a short hang_timeout are never called a hang; a hang after the
training's end (a peer slow to end) leaves the record ``finished``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jit_helpers
import pytest

from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record, stop_summary, watchdog
from slurm_jit.train.save_path import FAULT_SAVE_SLEEP_ENV

pytestmark = pytest.mark.deepspeed

HANG_TIMEOUT_S = 10
EXIT_WITHIN_S = HANG_TIMEOUT_S + 30  # the bound: every rank gone within hang_timeout + 30 s
STALL_AT_STEP = 3  # rank 1 blocks in on_step_begin once step 3 is done (checkpoint-2 is the newest complete)
FOREVER_S = 100_000
HELPERS = Path(__file__).resolve().parents[1] / "helpers"
# Rank 0's end-of-training bound in the closing-barrier test (demo_short_long_phases.py; the watchdog's own is
# max(10 x hang_timeout_s, 600 s)): from the last step to train()'s record, well under this on a loaded host
END_BOUND_S = 8
LATE_END_S = 3 * END_BOUND_S  # rank 1's on_train_end there: it comes to the barrier after rank 0 has gone


@dataclass
class HungRun:
    out: Path
    codes: list[int | None]
    exit_s: float  # from step STALL_AT_STEP logged until every rank exited
    logs: list[str]


@pytest.fixture(scope="module")
def hung_run(tmp_path_factory: pytest.TempPathFactory) -> HungRun:
    out = tmp_path_factory.mktemp("hang") / "out"
    ranks = jit_helpers.start_ranks(out, [
        "--max-steps", "12", "--save-steps", "2", "--hang-timeout", str(HANG_TIMEOUT_S),
        "--stall-at-step", str(STALL_AT_STEP), "--stall-rank", "1", "--stall-s", str(FOREVER_S)])
    jit_helpers.wait_for_steps(ranks, out, STALL_AT_STEP)
    t0 = time.monotonic()
    deadline = t0 + EXIT_WITHIN_S + 60  # past the bound only to tell "late" from "never"
    while any(p.poll() is None for p in ranks.procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    exit_s = time.monotonic() - t0
    codes = ranks.wait(0.1)  # SIGKILLs a rank still running: a hang the watchdog missed
    return HungRun(out=out, codes=codes, exit_s=exit_s, logs=[ranks.log(0), ranks.log(1)])


def test_a_rank_blocked_in_user_code_ends_every_rank_within_the_bound(hung_run: HungRun) -> None:
    assert hung_run.codes[1] == watchdog.HUNG_EXIT_CODE, (hung_run.codes, hung_run.logs[1][-3000:])
    # rank 0 waits in the step's collective: its own watchdog ends it, or the collective fails once rank 1 is gone
    assert hung_run.codes[0] not in (None, 0), (hung_run.codes, hung_run.logs[0][-3000:])
    assert hung_run.exit_s < EXIT_WITHIN_S, hung_run.exit_s


def test_the_hung_rank_s_stack_is_in_its_log(hung_run: HungRun) -> None:
    log = hung_run.logs[1]
    assert "slurm_jit: hang on rank 1" in log and "HINT:" in log, log[-3000:]
    assert "most recent call first" in log and "in on_step_begin" in log, log[-3000:]  # faulthandler's dump


def test_the_stop_record_says_hung_and_names_the_stuck_frame(hung_run: HungRun) -> None:
    record = stop_record.read(hung_run.out)
    assert record is not None and record["state"] == "hung", record
    stuck = {r["rank"]: r for r in record["ranks"]}
    assert "on_step_begin" in stuck[1]["frame"] and stuck[1]["step"] == STALL_AT_STEP, record
    assert stuck[1]["since_s"] >= HANG_TIMEOUT_S and stuck[1]["node"], record
    cli = subprocess.run([sys.executable, "-m", "slurm_jit.stop_record", str(hung_run.out)], capture_output=True,
                         text=True, check=False)
    assert cli.returncode == stop_record.EXIT_HUNG, (cli.returncode, cli.stdout, cli.stderr)
    assert cli.stdout.startswith("hung ") and "rank 1" in cli.stdout and "on_step_begin" in cli.stdout, cli.stdout


def test_the_newest_complete_checkpoint_before_the_hang_resumes(hung_run: HungRun) -> None:
    found = protocol.find_resumable(hung_run.out).checkpoint
    assert found is not None and found.path.name == "checkpoint-2", found


def test_a_slow_first_step_a_slow_save_and_a_long_evaluation_are_not_a_hang(tmp_path: Path) -> None:
    slow_s = 12  # each phase alone outlasts hang_timeout_s
    timeout_s = 8
    result = jit_helpers.run_logged(tmp_path / "out", [
        "--max-steps", "6", "--save-steps", "3", "--eval-steps", "5", "--eval-samples", "48", "--eval-sleep", "1",
        "--hang-timeout", str(timeout_s), "--stall-at-step", "0", "--stall-s", str(slow_s)],
        env={FAULT_SAVE_SLEEP_ENV: str(slow_s)})
    assert result.codes == [0, 0], (result.codes, result.log[-4000:])
    assert f"hang watchdog on rank 0: hang_timeout_s={float(timeout_s)}" in result.log, result.log[-3000:]
    assert "slurm_jit: hang on rank" not in result.log
    record = stop_record.read(tmp_path / "out")
    assert record is not None and record["state"] == "finished", record
    evals = (tmp_path / "out" / "evals-rank0.jsonl").read_text()
    assert '"step": 5' in evals, evals  # the long evaluation ran to its end


def test_a_frozen_rank_is_the_one_named_not_the_rank_waiting_for_it(tmp_path: Path) -> None:
    """Rank 1 SIGSTOPped mid-step (a node gone whole, a process stuck in the kernel: no socket closed, no report):
    rank 0's watchdog ends it in the step's collective; the record lists rank 1 as unreported and names it (it
    named rank 0, the one waiting, and --exclude-hung-node would have excluded rank 0's healthy node)."""
    out = tmp_path / "out"
    ranks = jit_helpers.start_ranks(out, ["--max-steps", "400", "--save-steps", "10", "--step-sleep", "1",
                                          "--hang-timeout", str(HANG_TIMEOUT_S)])
    jit_helpers.wait_for_steps(ranks, out, 5)  # in step 6 now: no save before step 10 (a save has a longer bound)
    time.sleep(0.3)
    ranks.signal(1, signal.SIGSTOP)
    deadline = time.monotonic() + EXIT_WITHIN_S + 30
    while ranks.procs[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    codes = ranks.wait(0.1)  # SIGKILLs the stopped rank
    assert codes[0] == watchdog.HUNG_EXIT_CODE, (codes, ranks.log(0)[-3000:])
    record = stop_record.read(out)
    assert record is not None and record["state"] == "hung", record
    assert [r["rank"] for r in record["ranks"]] == [0] and record["unreported"][0]["rank"] == 1, record
    node = record["unreported"][0]["node"]
    assert stop_summary.phrase(record) == (f"hang at step {record['step']} on rank 1 (node {node}), stack "
                                             "in the log"), record


def test_a_hang_in_the_closing_barrier_after_the_end_keeps_the_record_finished(tmp_path: Path) -> None:
    """Both ranks train to the end; rank 1 is slow to end (on_train_end), so rank 0, having written ``finished``,
    waits for it in the side group's closing barrier, and its end-of-training bound (cut to END_BOUND_S on rank
    0 only) fires there. The record stays ``finished``: it said ``hung`` (stop_record exit 11, requeued under
    --retry-on-hang) for a training whose every step and save was done."""
    out = tmp_path / "out"
    ranks = jit_helpers.start_ranks(out, [
        "--max-steps", "4", "--save-steps", "4", "--hang-timeout", "30", "--stall-in", "train_end",
        "--stall-at-step", "0", "--stall-rank", "1", "--stall-s", str(LATE_END_S)],
        env={"SHORT_PHASES_RANK": "0", "LONG_PHASE_FACTOR": "0", "LONG_PHASE_MIN_S": str(END_BOUND_S)},
        program=[str(HELPERS / "demo_short_long_phases.py")])
    codes = ranks.wait(jit_helpers.START_TIMEOUT_S + LATE_END_S)
    log = ranks.log(0)
    assert codes[0] == watchdog.HUNG_EXIT_CODE, (codes, log[-3000:])
    # Rank 1 comes to the closing barrier after rank 0 has gone: its training was done, so one warning line and a
    # clean exit, not a traceback that reads as a crash
    late = ranks.log(1)
    assert codes[1] == 0 and "a peer was gone at the closing barrier" in late, (codes, late[-3000:])
    assert "Traceback" not in late, late[-3000:]
    assert "slurm_jit: hang on rank 0" in log and "in phase 'end of training'" in log, log[-3000:]
    assert "in barrier" in log.split("slurm_jit: hang on rank 0")[1].splitlines()[0], log[-3000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished", record
    assert record["step"] == 4 and record["checkpoint"] == str(out / "checkpoint-4"), record
    cli = subprocess.run([sys.executable, "-m", "slurm_jit.stop_record", str(out)], capture_output=True,
                         text=True, check=False)
    assert cli.returncode == stop_record.EXIT_FINISHED, (cli.returncode, cli.stdout, cli.stderr)
    assert "hang on rank 0 after training reached its end" in log and "stays finished" in log, log[-3000:]
