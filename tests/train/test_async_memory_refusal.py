"""The memory guard's refusal through the real trainer (issue #23 item 3): 2 real ZeRO-2 ranks with async periodic
saves whose host memory cannot hold the staging buffer (the margin set above this machine's memory,
SLURM_JIT_ASYNC_MEMORY_MARGIN, so psutil's and the cgroup's real numbers refuse) say so in one line, save every
checkpoint synchronously, complete, and never stage."""

from __future__ import annotations

import json
from pathlib import Path

from jit_helpers import ckpt_check, run_logged

from slurm_jit import timing
from slurm_jit.train.async_save import memory_guard


def test_a_staging_buffer_host_memory_cannot_hold_falls_back_to_synchronous_saves(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_logged(out, ["--max-steps", "4", "--save-steps", "2", "--async-periodic-saves"],
                        env={memory_guard.MARGIN_ENV: "1PiB"})
    assert result.codes == [0, 0], result.log[-4000:]
    refusals = [line for line in result.log.splitlines() if "async periodic saves need" in line]
    assert len(refusals) == 2, result.log[-4000:]  # each rank's one line, at the first periodic save only
    assert all("periodic saves stay synchronous. HINT: ask for more memory" in line for line in refusals)
    assert result.log.count("async periodic saves off for this run") == 1  # rank 0 says it once
    assert "Traceback" not in result.log

    check = ckpt_check(out, "--deep", "--json")
    verdicts = {c["step"]: (c["status"], c["kind"]) for c in json.loads(check.stdout)["checkpoints"]}
    assert verdicts == {2: ("complete", "periodic"), 4: ("complete", "final")}, check.stdout
    records = timing.read_records(out)
    assert not [r for r in records if r["event"] in ("save_blocked", "save_background")], "nothing was staged"
    assert sorted({(r["step"], r["kind"]) for r in records if r["event"] == "save"}) == [(2, "periodic"),
                                                                                      (4, "final")]
