"""Row 6: races. (a) Two launches on one output directory: the second refuses, naming the holder, while the first
trains on; once the first is SIGKILLed, its lock (the file still names it) is taken over by the next launch.
(b) No requeue before the checkpoint is durable: while a SIGTERMed run stops, the stop record is polled; the
instant it says ``jit_stop`` (what the launchers requeue on), the checkpoint it names must already be complete,
with every rank's files verified against the manifest (``--deep``)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from slurm_jit.checkpoint import protocol
from slurm_jit.faults import common
from slurm_jit.train import stop_record

LONG = ["--zero-stage", "2", "--max-steps", "200", "--step-sleep", "0.2", "--kill-wait", "0"]
STOPPED = ["--zero-stage", "2", "--max-steps", "40", "--step-sleep", "0.05", "--kill-wait", "1", "--resume"]


def _second_launch(out: Path, tally: common.Tally) -> str:
    first = common.start(out, LONG)
    try:
        if not common.wait_until(lambda: len(common.losses(out)) >= 1, first):
            tally.fail("the first launch never trained")
            return ""
        record_before = stop_record.read(out)
        codes, log = common.run(out, LONG)
        line = next((x.strip() for x in log.splitlines() if "is in use by" in x), "")
        tally.check(stop_record.read(out) == record_before, "the refused launch rewrote the holder's stop record")
        tally.trials += 1
        tally.check(codes == [2, 2], f"second launch exited {codes}, expected 2 (refused)")
        tally.check(f"pid {first.procs[0].pid}" in line and "HINT:" in line, f"holder not named: {line!r}")
        tally.check(all(p.poll() is None for p in first.procs), "the first launch died")
        return line
    finally:
        for rank in range(len(first.procs)):
            first.signal(rank, signal.SIGKILL)
        first.wait(30)


def _stop_and_poll(out: Path, tally: common.Tally) -> str:
    """The takeover of the killed holder's lock, and the stop record polled during a JIT stop."""
    held_by = json.loads((out / "slurm-jit" / "output.lock").read_text() or "{}").get("pid")
    trained_before = len(common.losses(out))
    ranks = common.start(out, STOPPED)
    seen = None
    try:
        if not common.wait_until(lambda: len(common.losses(out)) >= trained_before + 3, ranks):
            tally.fail(f"the launch after the SIGKILLed holder (pid {held_by}) never trained")
            return ""
        for rank in range(len(ranks.procs)):
            ranks.signal(rank, signal.SIGTERM)
        deadline = time.monotonic() + common.START_TIMEOUT_S
        while seen is None and time.monotonic() < deadline:
            record = stop_record.read(out)
            if record is not None and record.get("state") == "jit_stop" and record.get("checkpoint"):
                ckpt = Path(record["checkpoint"])
                seen = protocol.inspect(ckpt, record["step"], deep=True)
            elif all(p.poll() is not None for p in ranks.procs):
                break
            time.sleep(common.POLL_S)
        codes = ranks.wait(common.START_TIMEOUT_S)
    finally:
        ranks.kill()
    tally.trials += 1
    tally.check(codes == [0, 0], f"the stopped run exited {codes}")
    if seen is None:
        tally.fail("the stop record never said jit_stop")
        return ""
    if seen.status is not protocol.Status.COMPLETE:
        tally.false_complete += 1
        tally.fail(f"jit_stop named {seen.path.name} while it was {seen.status.value}: {seen.reason}")
    return f"{seen.path.name} {seen.status.value} (--deep) when jit_stop was first read"


def run_row(root: Path) -> common.Row:
    t0 = time.monotonic()
    tally = common.Tally()
    out = common.fresh(root / "races") / "out"
    line = _second_launch(out, tally)
    stopped = _stop_and_poll(out, tally)
    detail = (f"second launch on a training output_dir refused while the first trained on: {line[:200]!r}; "
              f"after a SIGKILL of the first, the next launch took its lock over and trained; {stopped}")
    return tally.row("races: lock and requeue after durability", detail, time.monotonic() - t0)
