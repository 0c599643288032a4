"""DeepSpeed's optimizer step waits for an async save's deferred staging copies (async_save/step_gate.py) within a
bound (issue #42 item 5): copies that never end (on a GPU: a device-to-host copy queued behind a lost peer's
collective) end train() with one line that names them, not with the hang watchdog's ``hung`` minutes later. The
bound itself is pure; on 2 real ZeRO-2 ranks the copies are held (fault injection) past a shortened bound."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from jit_helpers import start_ranks

from slurm_jit.train import stop_record, watchdog
from slurm_jit.train.async_save import fault_points, step_gate


def test_the_bound_grows_with_the_bytes_and_ends_before_the_watchdogs() -> None:
    floor = step_gate.COPY_WAIT_MIN_S
    assert step_gate.copy_wait_bound_s(0, None) == floor
    big = int(10 * floor * step_gate.COPY_FLOOR_BYTES_PER_S)  # 10x what the floor's time copies at the floor rate
    assert step_gate.copy_wait_bound_s(big, None) == pytest.approx(10 * floor)
    save_bound = watchdog.long_bound_s(watchdog.AUTO_MIN_S)  # the watchdog's bound on a save's phase
    assert step_gate.copy_wait_bound_s(big, save_bound) < save_bound  # this line comes first, not "hung"
    assert step_gate.copy_wait_bound_s(0, save_bound) == floor


def test_a_shortened_bound_is_fault_injection_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fault_points.COPY_WAIT_ENV, raising=False)
    assert fault_points.copy_wait_s() is None
    monkeypatch.setenv(fault_points.COPY_WAIT_ENV, "2.5")
    assert fault_points.copy_wait_s() == 2.5
    assert step_gate.copy_wait_bound_s(10**15, None) == 2.5


COPY_STALL_S = 150  # the copies of step 3 held this long (as if forever)
COPY_WAIT_S = 3  # the bound, shortened (fault injection)


@pytest.mark.deepspeed
def test_copies_that_never_end_fail_the_next_optimizer_step_in_one_line(tmp_path: Path) -> None:
    """Both ranks' copies of step 3 held 150 s: step 4's optimizer step gives up after the bound with one line
    naming the copies and checkpoint-3; the stop record says ``failed`` with it (before: the step waited the 150 s
    and training went on; with a real stuck copy, until the watchdog's ``hung``)."""
    out = tmp_path / "out"
    ranks = start_ranks(out, ["--max-steps", "8", "--save-steps", "3", "--async-periodic-saves"],
                        env={fault_points.FAULT_ASYNC_ENV: f"copy:3:{COPY_STALL_S}",
                             fault_points.COPY_WAIT_ENV: str(COPY_WAIT_S)})
    t0 = time.monotonic()
    codes = ranks.wait(COPY_STALL_S + 120)
    took_s = time.monotonic() - t0
    log = ranks.log(0)
    assert all(code not in (0, None, watchdog.HUNG_EXIT_CODE) for code in codes), (codes, log[-3000:])
    record = stop_record.read(out)
    assert record is not None and record["state"] == "failed", record
    error = record["error"]
    assert "staging copies" in error and "checkpoint-3" in error and "HINT" in error, error
    assert "\n" not in error.strip(), error
    assert took_s < COPY_STALL_S, (took_s, log[-3000:])  # it did not wait the stall out
