"""Where a JIT stop can land: during evaluation, during a periodic save, before the first step; double signals;
kill_wait; SIGKILL in the middle of a save; rotation across a failed save; upstream's callback replaced.

Every stop that leaves something to resume is resumed, and its per-step losses compared bitwise with an
uninterrupted run of the same configuration (ZeRO-2).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from jit_helpers import (
    assert_jit_stop,
    assert_same_losses,
    assert_stop_timing,
    ckpt_check,
    losses,
    resume_and_compare,
    run_and_signal,
    run_logged,
    start_ranks,
    wait_for,
    wait_for_steps,
)

from slurm_jit import timing
from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record
from slurm_jit.train.trainer import FAULT_SAVE_SLEEP_ENV

pytestmark = pytest.mark.deepspeed

Reference = Callable[[list[str]], list[tuple[int, float]]]

KILL_WAIT_S = 1.0
BASE = ["--zero-stage", "2", "--max-steps", "40", "--step-sleep", "0.03", "--kill-wait", str(KILL_WAIT_S)]
# Periodic saves every 10 steps, one kept: the SIGKILL-mid-save tests and their reference.
SAVES = [*BASE, "--save-steps", "10", "--save-total-limit", "1"]
# Evaluations every 5 steps; --eval-sleep only slows them (no effect on any number), so the reference and the
# resumed run leave it out.
EVALS = [*BASE, "--eval-steps", "5", "--eval-samples", "32"]
EVAL_SLEEP = ["--eval-sleep", "1.0"]  # 8 batches x 1 s per rank: an evaluation a stop must abort
# Periodic saves, their rotation and upstream's enable_jit_checkpoint change no loss: a stop of BASE with any of
# them is compared with the one uninterrupted run of BASE (each had its own reference run, 3 more trainings).


def _checkpoint_dirs(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))


def test_stop_during_evaluation_aborts_it_then_checkpoints(tmp_path: Path, reference_losses: Reference) -> None:
    out = tmp_path / "out"
    result = run_and_signal(out, [*EVALS, *EVAL_SLEEP], [(0, 0.0), (1, 0.3)], after_steps=5)
    ckpt = assert_jit_stop(out, result)
    assert ckpt.name == "checkpoint-5"
    assert "evaluation aborted at step 5" in result.log
    evals = [r for r in timing.read_records(out) if r["event"] == "eval"]
    assert evals and all(r["aborted"] for r in evals), evals
    assert max(r["dur_s"] for r in evals) < 8.0  # aborted well before the 8 s evaluation would have ended
    resume_and_compare(out, EVALS, reference_losses(EVALS))


def test_stop_during_periodic_save_finishes_it_and_writes_no_second_checkpoint(
        tmp_path: Path, reference_losses: Reference) -> None:
    out = tmp_path / "out"
    args = [*BASE, "--save-steps", "10"]
    result = run_and_signal(out, args, [(0, 0.0), (1, 0.1)], env={FAULT_SAVE_SLEEP_ENV: "3"},
                            wait_until=f"{out.name}/checkpoint-10/{protocol.SENTINEL_NAME}")
    assert result.codes == [0, 0], result.log[-3000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["step"] == 10, record
    assert _checkpoint_dirs(out) == ["checkpoint-10"]
    info = protocol.inspect(out / "checkpoint-10", 10, deep=True)
    assert info.status is protocol.Status.COMPLETE and info.kind == "periodic"
    resume_and_compare(out, args, reference_losses(BASE))


def test_signal_before_first_step_exits_cleanly_without_checkpoint(tmp_path: Path,
                                                                   reference_losses: Reference) -> None:
    out = tmp_path / "out"
    # signal as soon as train() has installed its handler (the stop record says "running")
    result = run_and_signal(out, BASE, [(0, 0.0), (1, 0.0)],
                            wait_until=f"{out.name}/slurm-jit/stop.json")
    assert result.codes == [0, 0], result.log[-3000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["step"] == 0, record
    assert record["checkpoint"] is None
    assert "before the first step" in result.log
    assert _checkpoint_dirs(out) == []
    assert losses(out) == []
    resumed = run_logged(out, [*BASE, "--resume"])  # nothing to resume: a fresh start, equal to the reference
    assert resumed.codes == [0, 0] and "no resumable checkpoint" in resumed.log, resumed.log[-3000:]
    assert_same_losses(losses(out), reference_losses(BASE))


def test_double_sigterm_is_ignored(tmp_path: Path, reference_losses: Reference) -> None:
    out = tmp_path / "out"
    result = run_and_signal(out, BASE, [(0, 0.0), (1, 0.0), (0, 0.3), (1, 0.0), (0, 0.4)])
    assert_jit_stop(out, result)
    assert_stop_timing(out, result, KILL_WAIT_S)  # kill_wait from the first signal, not the repeats
    assert len([d for d in _checkpoint_dirs(out) if not d.endswith(".incomplete")]) == 1
    resume_and_compare(out, BASE, reference_losses(BASE))


def test_sigkill_within_kill_wait_starts_no_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [*BASE[:-2], "--kill-wait", "3"]  # transformers' default kill_wait; no periodic saves
    ranks = start_ranks(out, args)
    wait_for_steps(ranks, out, 3)
    for rank in (0, 1):
        ranks.signal(rank, signal.SIGTERM)
    time.sleep(1.5)  # inside kill_wait: scancel's SIGTERM, then SIGKILL
    assert all(p.poll() is None for p in ranks.procs)  # SIGTERM alone did not end them
    for rank in (0, 1):
        ranks.signal(rank, signal.SIGKILL)
    ranks.wait(10)
    assert len(losses(out)) > 3  # training went on during kill_wait
    assert _checkpoint_dirs(out) == []  # and no checkpoint was begun
    assert ckpt_check(out).returncode == 3
    assert stop_record.read(out)["state"] == "running"  # type: ignore[index]  # killed: not a clean JIT stop


def test_sigkill_mid_save_falls_back_and_rotation_keeps_last_complete(tmp_path: Path,
                                                                     reference_losses: Reference) -> None:
    out = tmp_path / "out"
    ranks = start_ranks(out, SAVES, env={FAULT_SAVE_SLEEP_ENV: "30"})
    wait_for(ranks, "began checkpoint-10", (out / "checkpoint-10" / protocol.SENTINEL_NAME).exists)
    time.sleep(1.0)  # the save is under way: files written, manifest not yet
    for rank in (0, 1):
        ranks.signal(rank, signal.SIGKILL)
    ranks.wait(10)
    # the half-written checkpoint-10 is incomplete; there is nothing to resume from yet
    assert ckpt_check(out).returncode == 1
    # restart without the fault: no checkpoint to resume -> fresh start; checkpoint-10 is set aside when rewritten
    restart = run_logged(out, [*SAVES, "--resume"], env={FAULT_SAVE_SLEEP_ENV: "0"})
    assert restart.codes == [0, 0], restart.log[-3000:]
    assert "no resumable checkpoint" in restart.log and "resuming from" not in restart.log
    resolution = protocol.find_resumable(out)
    assert resolution.checkpoint is not None and resolution.checkpoint.step == 40
    assert [c.step for c in resolution.checkpoints if c.resumable()] == [40]  # save_total_limit=1
    assert (out / f"checkpoint-10{protocol.QUARANTINE_SUFFIX}").is_dir()  # set aside, never deleted
    assert_same_losses(losses(out)[-40:], reference_losses(BASE))


def test_sigkill_mid_save_resumes_from_previous_complete(tmp_path: Path, reference_losses: Reference) -> None:
    out = tmp_path / "out"
    reference = reference_losses(BASE)
    # steps of 0.2 s (no loss changes): the 10 steps to checkpoint-20, whose rotation would delete checkpoint-10,
    # outlast a loaded host's delay between seeing the manifest and the kill
    ranks = start_ranks(out, [*SAVES, "--step-sleep", "0.2"], env={FAULT_SAVE_SLEEP_ENV: "0"})
    wait_for(ranks, "completed checkpoint-10", (out / "checkpoint-10" / protocol.MANIFEST_NAME).exists)
    ranks.wait(0.1)  # SIGKILL both ranks (wait() kills what still runs at its deadline)
    assert (out / "checkpoint-10").is_dir()
    first_run = losses(out)
    assert first_run == reference[:len(first_run)] and len(first_run) >= 10
    partial = out / "checkpoint-20"  # as a SIGKILL in the middle of the next save would leave it
    partial.mkdir(exist_ok=True)
    (partial / protocol.SENTINEL_NAME).write_text("killed mid-save\n")
    (partial / "trainer_state.json").write_text(json.dumps({"global_step": 20}))
    resumed = run_logged(out, [*SAVES, "--resume"])
    assert resumed.codes == [0, 0], resumed.log[-3000:]
    # this run's own log (not the first run's save lines): it passed over 20 and resumed from 10
    assert f"passing over {partial}: incomplete" in resumed.log, resumed.log[-3000:]
    assert f"resuming from {out / 'checkpoint-10'} (complete)" in resumed.log, resumed.log[-3000:]
    assert_same_losses(losses(out)[len(first_run):], reference[10:])  # steps 11..40, as if never killed
    assert protocol.find_resumable(out).checkpoint.step == 40  # type: ignore[union-attr]


def test_upstream_enable_jit_checkpoint_is_replaced(tmp_path: Path, reference_losses: Reference) -> None:
    out = tmp_path / "out"
    args = [*BASE, "--upstream-jit"]
    result = run_and_signal(out, args, [(0, 0.0), (1, 0.5)])
    assert_jit_stop(out, result)
    assert_stop_timing(out, result, KILL_WAIT_S)
    assert "replaced transformers' JIT checkpoint callback" in result.log
    assert len(_checkpoint_dirs(out)) == 1  # upstream's save path (a second, manifest-less save) never ran
    resume_and_compare(out, args, reference_losses(BASE))
