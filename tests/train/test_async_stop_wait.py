"""A JIT stop's wait for the async periodic save in flight, bounded by the signal lead (async_save/stop_wait.py):
the bound itself (pure), and on 2 real ZeRO-2 ranks a background write stalled past what the lead allows: the stop
sets it aside (incomplete, never claimed), writes its JIT checkpoint within the lead, and the chain resumes from it
bitwise."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from jit_helpers import ckpt_check, losses, run_logged, start_ranks, wait_for

from slurm_jit.checkpoint import protocol
from slurm_jit.grace.formula import Margin
from slurm_jit.grace.rules import LEAD_ENV_VAR
from slurm_jit.train import stop_record
from slurm_jit.train.async_save import fault_points, stop_wait


def test_without_a_lead_there_is_no_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    assert stop_wait.bound_s(lead_s=None, earliest_signal=0.0, now=1.0, submitted_at=0.0, longest_write_s=1.0) is None
    for raw in ("", "x", "0", "-5", "inf", "nan"):
        monkeypatch.setenv(LEAD_ENV_VAR, raw)
        assert stop_wait.signal_lead_s() is None, raw
    monkeypatch.setenv(LEAD_ENV_VAR, " 90 ")
    assert stop_wait.signal_lead_s() == 90.0


def test_the_wait_leaves_the_jit_save_the_longest_write_and_its_margin() -> None:
    # lead 100 s from the signal at 0, the save in flight submitted at 4, the longest write 20 s (margin 10 s), 5 s
    # for the set-aside writer's current file: waiting until t leaves max(20, t - 4) + 10 + 5 s:
    # t + (t - 4) + 15 == 100 at t = 44.5 (past 24 the save in flight has taken longer than the longest write)
    close_s = stop_wait.SET_ASIDE_CLOSE_WAIT_S
    assert close_s == 5.0
    bound = stop_wait.bound_s(lead_s=100.0, earliest_signal=0.0, now=5.0, submitted_at=4.0, longest_write_s=20.0)
    assert bound == pytest.approx(39.5, abs=1e-6)
    # a long longest write: it alone decides (t + 60 + 12 + 5 == 100 at t = 23)
    bound = stop_wait.bound_s(lead_s=100.0, earliest_signal=0.0, now=5.0, submitted_at=4.0, longest_write_s=60.0)
    assert bound == pytest.approx(18.0, abs=1e-6)
    # a save in flight that has already taken longer than any write: the JIT save is taken to need as long
    bound = stop_wait.bound_s(lead_s=100.0, earliest_signal=0.0, now=5.0, submitted_at=-30.0, longest_write_s=1.0)
    end = 5.0 + bound  # end + (end + 30) + max(10, 0.2 * (end + 30)) + 5 == 100
    assert end + (end + 30.0) + Margin().seconds(end + 30.0) + close_s == pytest.approx(100.0, abs=1e-6)


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
