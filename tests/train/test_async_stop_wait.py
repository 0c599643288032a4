"""A JIT stop's wait for the async periodic save in flight, bounded by the signal lead (async_save/stop_wait.py):
the bound itself (pure), and on 2 real ZeRO-2 ranks a background write stalled past what the lead allows: the stop
sets it aside (incomplete, never claimed), writes its JIT checkpoint within the lead, and the chain resumes from it
bitwise."""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from jit_helpers import ckpt_check, losses, run_logged, start_ranks, wait_for

from slurm_jit import timing
from slurm_jit.checkpoint import protocol
from slurm_jit.grace.formula import Margin
from slurm_jit.grace.rules import LEAD_ENV_VAR
from slurm_jit.train import save_errors, stop_record
from slurm_jit.train.async_save import fault_points, in_flight, stop_wait


def test_without_a_lead_there_is_no_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    assert stop_wait.bound_s(lead_s=None, earliest_signal=0.0, now=1.0, submitted_at=0.0, longest_write_s=1.0) is None
    for raw in ("", "x", "0", "-5", "inf", "nan"):
        monkeypatch.setenv(LEAD_ENV_VAR, raw)
        assert stop_wait.signal_lead_s() is None, raw
    monkeypatch.setenv(LEAD_ENV_VAR, " 90 ")
    assert stop_wait.signal_lead_s() == 90.0


def test_the_wait_leaves_the_jit_save_the_longest_write_and_its_margin() -> None:
    # lead 100 s from the signal at 0, the save in flight submitted at 4, the longest write 20 s (margin 10 s), 5 s
    # for the set-aside writer's current file (none measured): waiting until t leaves max(20, t - 4) + 10 + 5 s:
    # t + (t - 4) + 15 == 100 at t = 44.5 (past 24 the save in flight has taken longer than the longest write)
    close_s = stop_wait.set_aside_file_s(None)
    assert close_s == in_flight.SET_ASIDE_FILE_UNMEASURED_S == 5.0
    bound = stop_wait.bound_s(lead_s=100.0, earliest_signal=0.0, now=5.0, submitted_at=4.0, longest_write_s=20.0)
    assert bound == pytest.approx(39.5, abs=1e-6)
    # a long longest write: it alone decides (t + 60 + 12 + 5 == 100 at t = 23)
    bound = stop_wait.bound_s(lead_s=100.0, earliest_signal=0.0, now=5.0, submitted_at=4.0, longest_write_s=60.0)
    assert bound == pytest.approx(18.0, abs=1e-6)
    # a save in flight that has already taken longer than any write: the JIT save is taken to need as long
    bound = stop_wait.bound_s(lead_s=100.0, earliest_signal=0.0, now=5.0, submitted_at=-30.0, longest_write_s=1.0)
    end = 5.0 + bound  # end + (end + 30) + max(10, 0.2 * (end + 30)) + 5 == 100
    assert end + (end + 30.0) + Margin().seconds(end + 30.0) + close_s == pytest.approx(100.0, abs=1e-6)


def test_the_set_aside_file_is_budgeted_from_the_longest_file_write_measured() -> None:
    """The set-aside writer's current file goes on beside the JIT save: the stop budgets the longest file write
    measured (twice: the two writers share the disk), 5 s only where none was measured."""
    assert stop_wait.set_aside_file_s(12.0) == pytest.approx(stop_wait.SET_ASIDE_FILE_FACTOR * 12.0)
    assert stop_wait.set_aside_file_s(0.001) == stop_wait.SET_ASIDE_FILE_MIN_S
    # the same timeline as above with a 12 s file measured: t + (t - 4) + 10 + 24 == 100 at t = 35
    bound = stop_wait.bound_s(lead_s=100.0, earliest_signal=0.0, now=5.0, submitted_at=4.0, longest_write_s=20.0,
                              set_aside_s=stop_wait.set_aside_file_s(12.0))
    assert bound == pytest.approx(30.0, abs=1e-6)


def test_earlier_runs_writes_are_read_from_the_timing_log(tmp_path: Path) -> None:
    """A requeued run's stop knows the writes of the runs before it (the timing log): the longest background write
    (a set-aside one's time so far counts: at least that) and the longest file write of any rank."""
    assert stop_wait.earlier_writes(tmp_path / "none") == in_flight.WriteHistory()
    for rank, (dur_s, file_s) in enumerate([(40.0, 12.0), (44.0, 9.0)]):
        log = timing.TimingLog(tmp_path, rank, 2, "earlier")
        log.save_background(4, "periodic", dur_s, 1000, {"write_s": 30.0, "fsync_s": 1.0, "commit_s": 0.0,
                                                         "file_max_s": file_s})
        log.save_background(8, "periodic", 50.0 + rank, 0, {"set_aside": True})
        log.close()
    assert stop_wait.earlier_writes(tmp_path) == in_flight.WriteHistory(longest_write_s=51.0, file_max_s=12.0)


def test_no_time_left_is_no_wait() -> None:
    assert stop_wait.bound_s(lead_s=30.0, earliest_signal=0.0, now=25.0, submitted_at=0.0, longest_write_s=0.0) == 0.0
    assert stop_wait.bound_s(lead_s=30.0, earliest_signal=0.0, now=40.0, submitted_at=0.0, longest_write_s=0.0) == 0.0


LEAD_S = 30  # the signal lead the ranks are told (SLURM_JIT_SIGNAL_LEAD_S)
STALL_S = 120  # step 4's background write stalls after its first file: far past the lead
ARGS = ["--max-steps", "12", "--save-steps", "4", "--async-periodic-saves", "--kill-wait", "0"]
STEP_SLEEP = ["--step-sleep", "1.0"]  # the signal comes steps before the next periodic save (step 8) would wait


@pytest.mark.deepspeed
def test_a_jit_stop_sets_aside_an_async_save_the_lead_cannot_wait_for_and_resumes_bitwise(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert run_logged(reference, ARGS).codes == [0, 0]  # steps fast: the sleep changes no loss
    out = tmp_path / "out"
    ranks = start_ranks(out, [*ARGS, *STEP_SLEEP], env={fault_points.FAULT_ASYNC_ENV: f"write:4:{STALL_S}",
                                                        LEAD_ENV_VAR: str(LEAD_S)})
    wait_for(ranks, "step 4's write stalled", lambda: all(
        fault_points.STALLED % ("write", 4, r) in ranks.log(r) for r in (0, 1)))
    t0 = time.monotonic()
    ranks.signal(0, signal.SIGTERM)
    ranks.signal(1, signal.SIGTERM)
    codes = ranks.wait(LEAD_S + 60)
    took_s = time.monotonic() - t0
    log = ranks.log(0)
    assert codes == [0, 0], log[-3000:]
    assert took_s < LEAD_S, (took_s, log[-3000:])  # before Slurm's SIGKILL would have come
    print(f"signal to exit {took_s:.1f} s (lead {LEAD_S} s):",
          *[line for line in log.splitlines() if "set aside" in line or "waits for the async" in line], sep="\n")
    assert "set aside (it stays incomplete, never claimed)" in log, log[-3000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["step"] > 4, record
    assert protocol.inspect(Path(record["checkpoint"]), record["step"]).kind == "jit"
    assert not (out / "checkpoint-4" / protocol.MANIFEST_NAME).exists()  # never claimed
    check = ckpt_check(out, "--deep")
    assert check.returncode == 0 and check.stdout.splitlines()[-1] == record["checkpoint"], check.stdout
    assert "4  incomplete" in check.stdout, check.stdout
    resumed = run_logged(out, [*ARGS, "--resume"])
    assert resumed.codes == [0, 0], resumed.log[-3000:]
    assert f"checkpoint-{record['step']}" in resumed.log
    expected = dict(losses(reference))
    assert {s for s, _ in losses(out)} == set(expected)
    assert all(loss == expected[s] for s, loss in losses(out)), (losses(out), expected)  # bitwise


def test_the_commit_gate_lets_one_side_win_for_good() -> None:
    sealing_first = in_flight.CommitGate()
    assert sealing_first.enter_seal() and not sealing_first.close()  # the manifest had begun: the save is kept
    closed_first = in_flight.CommitGate()
    assert closed_first.close() and not closed_first.enter_seal() and closed_first.close()  # never a manifest


def test_a_lead_slurm_cannot_give_is_no_lead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEAD_ENV_VAR, "1e11")  # was a bound past threading's TIMEOUT_MAX: OverflowError at the stop
    assert stop_wait.signal_lead_s() is None
    bound = stop_wait.bound_s(lead_s=65535.0, earliest_signal=0.0, now=1.0, submitted_at=0.0, longest_write_s=0.0)
    assert bound is not None and bound <= 65535.0


EARLIER_WRITE_S = 50.0  # the longest background write of the runs before (their timing log): past what 60 s allow


@pytest.mark.deepspeed
def test_after_a_requeue_the_stop_counts_the_earlier_runs_writes(tmp_path: Path) -> None:
    """The runs before this one (the timing log of the same output_dir) took 50 s for a background write; this run
    has written none when the stop comes, 60 s before the SIGKILL: the JIT save may need the 50 s, so the stop sets
    the save in flight aside at once. Before, this run's own writes only counted (none: 0 s after every requeue), and
    the stop waited ~20 s of the lead for a save it then set aside anyway."""
    out = tmp_path / "out"
    for rank in (0, 1):
        log = timing.TimingLog(out, rank, 2, "earlier")
        log.save_background(4, "periodic", EARLIER_WRITE_S, 1000, {"write_s": 45.0, "fsync_s": 1.0, "commit_s": 4.0})
        log.close()
    ranks, codes = _stop_during_a_stall(out, [*ARGS, *STEP_SLEEP], f"write:4:{STALL_S}", 60, (0, 1))
    log = ranks.log(0)
    assert codes == [0, 0], log[-3000:]
    waited = re.search(r"\(the stop waited ([0-9.]+) s\); set aside", log)
    assert waited is not None, log[-3000:]
    assert float(waited.group(1)) < 1.0, waited.group(0)
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["step"] > 4, record


def _stop_during_a_stall(out: Path, args: list[str], fault: str, lead_s: int, stalled_ranks: tuple[int, ...]):  # type: ignore[no-untyped-def]
    point, step = fault.split(":")[:2]
    ranks = start_ranks(out, args, env={fault_points.FAULT_ASYNC_ENV: fault, LEAD_ENV_VAR: str(lead_s)})
    wait_for(ranks, f"{fault} stalled", lambda: all(
        fault_points.STALLED % (point, int(step), r) in ranks.log(r) for r in stalled_ranks))
    ranks.signal(0, signal.SIGTERM)
    ranks.signal(1, signal.SIGTERM)
    return ranks, ranks.wait(STALL_S + 60)


@pytest.mark.deepspeed
def test_a_commit_stalled_before_its_manifest_is_never_sealed_after_the_set_aside(tmp_path: Path) -> None:
    """Rank 0's thread has read every marker and stalls before the manifest when the stop sets the save aside; once
    the stall ends (the ranks still alive: a slow end of training) it writes no manifest and rotates nothing
    (the first review: it sealed checkpoint-4 after the JIT save, and save_total_limit=1 deleted the JIT one)."""
    out = tmp_path / "out"
    args = [*ARGS, *STEP_SLEEP, "--save-total-limit", "1", "--return-after-stop", "--after-train-sleep", "25"]
    ranks, codes = _stop_during_a_stall(out, args, "manifest:4:12:0", 10, (0,))
    log = ranks.log(0)
    assert codes == [0, 0], log[-3000:]
    assert "set aside (it stays incomplete, never claimed)" in log, log[-3000:]
    assert "deleting" not in log, log[-3000:]  # its commit gave up: no rotation (the ranks outlived the stall)
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and Path(record["checkpoint"]).is_dir(), record
    assert not (out / "checkpoint-4" / protocol.MANIFEST_NAME).exists()
    check = ckpt_check(out)
    assert check.returncode == 0 and check.stdout.splitlines()[-1] == record["checkpoint"], check.stdout


@pytest.mark.deepspeed
def test_a_set_aside_best_checkpoint_is_not_loaded_at_the_end_of_the_resumed_run(tmp_path: Path) -> None:
    """load_best_model_at_end: upstream names checkpoint-<best step> whenever the directory exists, and the set-aside
    one does; the resumed run's end says why it keeps the final weights (the first review: an AssertionError in
    _load_best_model, at the end of every requeue)."""
    out = tmp_path / "out"
    args = [*ARGS, "--eval-steps", "4", "--eval-samples", "4", "--metric-for-best", "loss",
            "--targ", "load_best_model_at_end=true", "--targ", "greater_is_better=true"]
    ranks, codes = _stop_during_a_stall(out, [*args, *STEP_SLEEP], f"write:4:{STALL_S}", LEAD_S, (0, 1))
    assert codes == [0, 0], ranks.log(0)[-3000:]
    resumed = run_logged(out, [*args, "--resume"])
    assert resumed.codes == [0, 0], resumed.log[-3000:]
    assert "not loading the best model:" in resumed.log and "checkpoint-4 is incomplete" in resumed.log, \
        resumed.log[-3000:]


class _TwoRanksInThreads:
    """The side group's collectives between two threads (rank "0" and rank "1"): the ranks' order of calls is what
    is under test; a stand-in because a failure after rank 0's commit has begun its manifest cannot be injected."""

    def __init__(self) -> None:
        self._barrier, self._values = threading.Barrier(2), {}  # type: ignore[var-annotated]

    def all_true(self, flag: bool) -> bool:
        self._values[threading.current_thread().name] = flag
        self._barrier.wait(10)
        result = all(v for k, v in self._values.items() if k != "broadcast")
        self._barrier.wait(10)
        return result

    def broadcast(self, obj: object) -> object:
        if threading.current_thread().name == "0":
            self._values["broadcast"] = obj
        self._barrier.wait(10)
        result = self._values["broadcast"]
        self._barrier.wait(10)
        self._values.pop("broadcast", None) if threading.current_thread().name == "0" else None
        return result


class _Writer:
    def __init__(self, fails_once: bool) -> None:
        self.fails_once, self.last_stats = fails_once, None

    def wait(self, timeout_s: float | None = None) -> bool:
        if self.fails_once:
            self.fails_once = False
            raise save_errors.CheckpointWriteError("slurm_jit: the manifest of checkpoint-8 not written (ENOSPC)")
        return True

    def cancel(self) -> None:
        pass


def test_a_kept_save_whose_manifest_failed_on_rank0_is_taken_as_saved_by_no_rank() -> None:
    """The second review: rank 0's commit had begun its manifest (kept), then failed; rank 1 took the save as saved,
    rank 0 did not: at a stop of that step rank 1 skipped the JIT save and rank 0 waited in its barrier."""
    agreement = _TwoRanksInThreads()
    job = in_flight.InFlight(8, Path("/nonexistent/checkpoint-8"), "full", "periodic", 0.0, 1)
    assert job.commit_gate.enter_seal()  # rank 0's thread: the markers read, the manifest begun
    saved: dict[int, int] = {}

    def rank(r: int) -> None:
        run = SimpleNamespace(saved_step=-1, saved_contents=None, checkpoint=None, async_saves=None, timing=None,
                              kill_wait_until=0.0, latch=SimpleNamespace(first_at=None))
        trainer = SimpleNamespace(state=SimpleNamespace(global_step=8), jit_config=SimpleNamespace(kill_wait_s=3.0))
        session = SimpleNamespace(agreement=agreement, is_rank0=r == 0, run=run, trainer=trainer)
        saves = SimpleNamespace(writer=_Writer(fails_once=r == 0), waited_s=0.0, longest_write_s=0.0)
        stop_wait.settle(session, saves, job, 0.0)  # type: ignore[arg-type]
        saved[r] = run.saved_step

    threads = [threading.Thread(target=rank, args=(r,), name=str(r)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert saved == {0: -1, 1: -1}, saved  # the same on both: the JIT save of step 8 is written by both ranks


@pytest.mark.deepspeed
def test_a_stop_at_the_step_of_a_save_whose_write_failed_writes_that_step_again(tmp_path: Path) -> None:
    """SIGTERM while the async save of step 2 is staged (the stop is taken at step 2: that save is the stop's
    checkpoint, waited for without a bound), and rank 1's background write of it fails: the stop sets it aside
    (never claimed) and writes the JIT checkpoint of step 2 itself, instead of ending train() on the write's
    error with no checkpoint of the stop at all."""
    out = tmp_path / "out"
    ranks = start_ranks(out, ["--max-steps", "8", "--save-steps", "2", "--async-periodic-saves", "--kill-wait", "0"],
                        env={fault_points.FAULT_ASYNC_ENV: "stage:2:5,write:2:raise:1"})
    wait_for(ranks, "stalled in the staging of step 2",
             lambda: all(fault_points.STALLED % ("stage", 2, r) in ranks.log(r) for r in (0, 1)))
    ranks.signal(0, signal.SIGTERM)
    ranks.signal(1, signal.SIGTERM)
    codes = ranks.wait(STALL_S)
    log = ranks.log(0)
    assert codes == [0, 0], (codes, log[-3000:], ranks.log(1)[-2000:])
    assert "not written on every rank" in log and "set aside" in log, log[-3000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["step"] == 2, record
    assert protocol.inspect(out / "checkpoint-2", 2).kind == "jit"
    assert list(out.glob(f"checkpoint-2{protocol.QUARANTINE_SUFFIX}*")), sorted(p.name for p in out.iterdir())
    check = ckpt_check(out, "--deep")
    assert check.returncode == 0 and check.stdout.splitlines()[-1] == str(out / "checkpoint-2"), check.stdout
