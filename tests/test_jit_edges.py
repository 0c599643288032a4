"""Where a JIT stop can land: during evaluation, during a periodic save, before the first step; double signals;
kill_wait; SIGKILL in the middle of a save; rotation across a failed save; upstream's callback replaced."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from jit_helpers import (
    assert_jit_stop,
    assert_same_losses,
    ckpt_check,
    losses,
    run_and_signal,
    run_to_end,
)

from slurm_jit import local_ranks, timing
from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record
from slurm_jit.train.trainer import FAULT_SAVE_SLEEP_ENV

pytestmark = pytest.mark.deepspeed

BASE = ["--zero-stage", "2", "--max-steps", "40", "--step-sleep", "0.03", "--kill-wait", "1"]


def _checkpoint_dirs(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))


def test_stop_during_evaluation_aborts_it_then_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # eval at step 5 takes 8 batches x 1 s per rank unless aborted
    args = [*BASE, "--eval-steps", "5", "--eval-samples", "32", "--eval-sleep", "1.0"]
    result = run_and_signal(out, args, [(0, 0.0), (1, 0.3)], after_steps=5)
    ckpt = assert_jit_stop(out, result)
    assert ckpt.name == "checkpoint-5"
    assert "evaluation aborted at step 5" in result.log
    evals = [r for r in timing.read_records(out) if r["event"] == "eval"]
    assert evals and all(r["aborted"] for r in evals), evals
    assert max(r["dur_s"] for r in evals) < 8.0  # aborted well before the 8 s evaluation would have ended


def test_stop_during_periodic_save_finishes_it_and_writes_no_second_checkpoint(tmp_path: Path) -> None:
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


def test_signal_before_first_step_exits_cleanly_without_checkpoint(tmp_path: Path) -> None:
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


def test_double_sigterm_is_ignored(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_and_signal(out, BASE, [(0, 0.0), (1, 0.0), (0, 0.3), (1, 0.0), (0, 0.4)])
    assert_jit_stop(out, result)
    assert len([d for d in _checkpoint_dirs(out) if not d.endswith(".incomplete")]) == 1


def test_sigkill_within_kill_wait_starts_no_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [*BASE[:-2], "--kill-wait", "3"]  # transformers' default kill_wait; no periodic saves
    ranks = local_ranks.start(["-m", "slurm_jit.demo_train", "--output-dir", str(out), *args], 2, tmp_path / "logs")
    while len(losses(out)) < 3:
        assert all(p.poll() is None for p in ranks.procs), ranks.log(0)[-3000:]
        time.sleep(0.02)
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


def test_sigkill_mid_save_falls_back_and_rotation_keeps_last_complete(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [*BASE, "--save-steps", "10", "--save-total-limit", "1"]
    reference_out = tmp_path / "ref"
    assert run_to_end(reference_out, args) == [0, 0]
    ranks = local_ranks.start(["-m", "slurm_jit.demo_train", "--output-dir", str(out), *args], 2, tmp_path / "logs",
                              env={FAULT_SAVE_SLEEP_ENV: "30"})
    while not (out / "checkpoint-10" / protocol.SENTINEL_NAME).exists():
        assert all(p.poll() is None for p in ranks.procs), ranks.log(0)[-3000:]
        time.sleep(0.02)
    time.sleep(1.0)  # the save is under way: files written, manifest not yet
    for rank in (0, 1):
        ranks.signal(rank, signal.SIGKILL)
    ranks.wait(10)
    # the half-written checkpoint-10 is incomplete; there is nothing to resume from yet
    assert ckpt_check(out).returncode == 1
    # restart without the fault: no checkpoint to resume -> fresh start; checkpoint-10 is set aside when rewritten
    assert run_to_end(out, [*args, "--resume"], env={FAULT_SAVE_SLEEP_ENV: "0"}) == [0, 0]
    resolution = protocol.find_resumable(out)
    assert resolution.checkpoint is not None and resolution.checkpoint.step == 40
    assert [c.step for c in resolution.checkpoints if c.resumable()] == [40]  # save_total_limit=1
    assert (out / f"checkpoint-10{protocol.QUARANTINE_SUFFIX}").is_dir()  # set aside, never deleted
    assert_same_losses(losses(out)[-40:], losses(reference_out))


def test_sigkill_mid_save_resumes_from_previous_complete(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [*BASE, "--save-steps", "10", "--save-total-limit", "1"]
    ranks = local_ranks.start(["-m", "slurm_jit.demo_train", "--output-dir", str(out), *args], 2, tmp_path / "logs",
                              env={FAULT_SAVE_SLEEP_ENV: "0"})
    while not (out / "checkpoint-10" / protocol.MANIFEST_NAME).exists():
        assert all(p.poll() is None for p in ranks.procs), ranks.log(0)[-3000:]
        time.sleep(0.02)
    ranks.wait(0.1)  # SIGKILL both ranks (wait() kills what still runs at its deadline)
    assert (out / "checkpoint-10").is_dir()
    partial = out / "checkpoint-20"
    partial.mkdir(exist_ok=True)
    (partial / protocol.SENTINEL_NAME).write_text("killed mid-save\n")
    (partial / "trainer_state.json").write_text(json.dumps({"global_step": 20}))
    assert run_to_end(out, [*args, "--resume"]) == [0, 0]
    log = (tmp_path / "logs" / "rank0.log").read_text() + (out.parent / "logs-out" / "rank0.log").read_text()
    assert "passing over" in log and "checkpoint-20" in log
    assert "resuming from" in log and "checkpoint-10" in log
    assert protocol.find_resumable(out).checkpoint.step == 40  # type: ignore[union-attr]


def test_upstream_enable_jit_checkpoint_is_replaced(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_and_signal(out, [*BASE, "--upstream-jit"], [(0, 0.0), (1, 0.5)])
    assert_jit_stop(out, result)
    assert "replaced transformers' JIT checkpoint callback" in result.log
    assert len(_checkpoint_dirs(out)) == 1  # upstream's save path (a second, manifest-less save) never ran
