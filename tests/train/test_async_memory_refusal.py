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


STAGING_FAILS_ON_RANK_1 = '''
import os
from slurm_jit import demo_train
from slurm_jit.train.async_save import staging

if os.environ.get("RANK") == "1":
    def failing(self, *args, **kwargs):
        raise RuntimeError("pinned allocation failed (injected)")
    staging.HostStager.stage = failing

if __name__ == "__main__":
    demo_train.main()
'''


def test_a_staging_that_fails_on_one_rank_falls_back_on_every_rank_at_once(tmp_path: Path) -> None:
    """Found by a review: a staging error other than the memory guard's (a failed pinned allocation, a pickling
    error) raised on that rank alone, and the other ranks waited in the agreement until the side group's timeout
    (1800 s). Now it is that rank's "no": every rank saves synchronously, one line says why."""
    script = tmp_path / "failing.py"
    script.write_text(STAGING_FAILS_ON_RANK_1)
    out = tmp_path / "out"
    result = run_logged(out, ["--max-steps", "4", "--save-steps", "2", "--async-periodic-saves",
                              "--side-group-timeout", "60"], None, [str(script)])
    assert result.codes == [0, 0], result.log[-4000:]
    assert "failed on this rank: RuntimeError: pinned allocation failed (injected)" in result.log
    assert result.log.count("async periodic saves off for this run") == 1
    check = ckpt_check(out, "--json")
    verdicts = {c["step"]: c["status"] for c in json.loads(check.stdout)["checkpoints"]}
    assert verdicts == {2: "complete", 4: "complete"}, check.stdout
