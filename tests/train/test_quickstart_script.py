"""The README quickstart's ``examples/train.py`` (a plain training script with the two-line change): SIGTERM on
both ranks ends it with a complete JIT checkpoint, and the same command resumes from it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from jit_helpers import START_TIMEOUT_S, ckpt_check, wait_for

from slurm_jit import local_ranks
from slurm_jit.train import stop_record

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train.py"
STOP_TIMEOUT_S = 60  # kill_wait 3 s + one step + a 1 MiB save, on a loaded 2-core host


def steps_logged(out: Path) -> int:
    log = out / "slurm-jit" / "timing-rank0.jsonl"
    if not log.exists():
        return 0
    return log.read_text().count('"event": "step"')  # whole lines only: the writer flushes every 20 steps


@pytest.mark.deepspeed
def test_sigterm_stops_with_a_jit_checkpoint_and_the_same_command_resumes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    ranks = local_ranks.start([str(SCRIPT), str(out), "100000"], 2, tmp_path / "logs")
    try:
        wait_for(ranks, "logged 5 steps", lambda: steps_logged(out) >= 5, poll_s=0.1)
        for rank in range(2):
            ranks.signal(rank, signal.SIGTERM)
        assert ranks.wait(STOP_TIMEOUT_S) == [0, 0], ranks.log(0)[-3000:]
    finally:
        ranks.kill()
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop", record
    check = ckpt_check(out)
    assert check.returncode == 0 and check.stdout.splitlines()[-1] == record["checkpoint"], check.stdout
    stop_step = record["step"]
    resumed = local_ranks.start([str(SCRIPT), str(out), str(stop_step + 2)], 2, tmp_path / "logs-resumed")
    try:
        assert resumed.wait(START_TIMEOUT_S) == [0, 0], resumed.log(0)[-3000:]
    finally:
        resumed.kill()
    assert f"checkpoint-{stop_step}: " in resumed.log(0)  # the slim JIT save's weights rebuilt on resume
    finished = stop_record.read(out)
    assert finished is not None and (finished["state"], finished["step"]) == ("finished", stop_step + 2), finished
