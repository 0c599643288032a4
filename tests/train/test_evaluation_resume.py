"""Evaluations around a JIT stop: a stop during the owed evaluation keeps it owed; a resume after an aborted
evaluation matches the uninterrupted run. Real ranks (2 CPU ranks), real SIGTERMs.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from jit_helpers import (
    STOP_DEADLINE_S,
    assert_same_losses,
    ckpt_check,
    losses,
    run_logged,
    run_to_end,
    start_demo,
    wait_for,
)

from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record

# Real ranks (plain DDP over gloo: the paths do not depend on DeepSpeed), evaluation and a periodic save every 2
# steps, save_total_limit=1; a stop at step 6 (SIGTERM at the end of step 5, read one step on) skips that step's
# evaluation: owed.
OWED = ["--max-steps", "8", "--eval-steps", "2", "--save-steps", "2", "--save-total-limit", "1", "--kill-wait", "0",
        "--zero-stage", "0"]


OWED_EVAL_SLEEP_S = "1"  # per evaluation batch on resume: the owed evaluation lasts long enough to be signalled


def _evals(out: Path) -> list[tuple[int, float]]:
    path = out / "evals-rank0.jsonl"
    return [(r["step"], r["eval_loss"]) for r in map(json.loads, path.read_text().splitlines())]


def _dirs(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if "checkpoint-" in p.name)


@pytest.mark.deepspeed
def test_stop_during_the_owed_evaluation_keeps_it_owed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGTERM while the resumed run ran the evaluation owed from step 6: it was aborted, step 7 was trained and
    # saved as a JIT checkpoint owing an evaluation at step 7; the next resume evaluated at 7, never at 6.
    # Meanwhile: output_dir relative and through a symlink, rotation with save_total_limit=1.
    monkeypatch.chdir(tmp_path)  # the ranks inherit it
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "link")
    ref, out = Path("ref"), Path("link/out")
    assert run_to_end(ref, OWED) == [0, 0]
    assert run_to_end(out, [*OWED, "--signal-self-at-step", "5"]) == [0, 0]
    ckpt = out / "checkpoint-6"
    assert _dirs(out) == ["checkpoint-6"]  # checkpoint-4 rotated away once 6 was complete
    assert json.loads((ckpt / protocol.MANIFEST_NAME).read_text())["owed_evaluation"] is True
    ranks = start_demo(out, [*OWED, "--resume", "--eval-sleep", OWED_EVAL_SLEEP_S])
    wait_for(ranks, "ran the owed evaluation", lambda: "running the evaluation owed from step 6" in ranks.log(0))
    for rank in (0, 1):
        ranks.signal(rank, signal.SIGTERM)
    assert ranks.wait(STOP_DEADLINE_S) == [0, 0], ranks.log(0)[-3000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop", record
    assert record["checkpoint"] == os.path.abspath(ckpt), record  # absolute: read from any directory
    assert _dirs(out) == ["checkpoint-6"]
    assert "aborted before this run's first step" in ranks.log(0)
    assert ckpt_check(out).stdout.splitlines()[-1] == str(ckpt)
    # the next resume runs the evaluation owed from step 6, and everything is the uninterrupted run's
    assert run_to_end(out, [*OWED, "--resume"]) == [0, 0]
    assert [s for s, _ in _evals(ref)] == [2, 4, 6, 8]
    assert _evals(out) == _evals(ref)
    assert_same_losses(losses(out), losses(ref))
    assert _dirs(out) == ["checkpoint-8"]  # the one resumed from goes once this run has written a newer one


# A stop read during the evaluation of step 5 (SIGTERM at the end of step 5): the evaluation is aborted.
ABORTED = ["--max-steps", "10", "--eval-steps", "5", "--kill-wait", "0", "--zero-stage", "0"]


@pytest.mark.deepspeed
def test_resume_after_an_aborted_evaluation_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    # The aborted evaluation had drawn from the RNG (its DataLoader's base seed) before the JIT checkpoint saved
    # the RNG state; the owed evaluation on resume drew again: every later loss (dropout) diverged.
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_to_end(ref, ABORTED) == [0, 0]
    stopped = run_logged(out, [*ABORTED, "--signal-self-at-step", "5"])
    assert stopped.codes == [0, 0] and "evaluation aborted at step 5" in stopped.log, stopped.log[-3000:]
    resumed = run_logged(out, [*ABORTED, "--resume"])
    assert resumed.codes == [0, 0] and "running the evaluation owed from step 5" in resumed.log
    assert _evals(out) == _evals(ref)
    assert_same_losses(losses(out), losses(ref))
