"""The launcher's plan advises a ``save_steps`` from the output directory's timing log (issue #36 item 4): Young's
interval sqrt(2 x blocked save x MTBF) at the job's GPUs (its ranks where it asks for none) and Llama 3's failure
rate per GPU, in steps; no line without a timing log."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from slurm_jit import timing
from slurm_jit.grace import goodput as gp

ROOT = Path(__file__).resolve().parents[2]
STEP_S, SAVE_S, EVERY = 1.0, 20.0, 10


def _log(out: Path, *, async_blocked_s: float | None = None) -> None:
    for rank in (0, 1):  # a run of 2 ranks: steps of 1 s, a periodic save every 10 steps
        log = timing.TimingLog(out, rank=rank, world_size=2, run_id="r1")
        for step in range(1, 31):
            log.step(step, STEP_S)
            if step % EVERY == 0 and async_blocked_s is None:
                log.save(step, "periodic", SAVE_S, 1000)
            elif step % EVERY == 0:
                log.save_blocked(step, "periodic", async_blocked_s, 1000, {"stage": async_blocked_s})
                log.save_background(step, "periodic", 1.0, 1000, {"write_s": 1.0, "staged_bytes": 1000})
        log.close()


def _plan(out: Path, *extra: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "submit.py"), "--dry-run", "--output-dir", str(out), "--python",
         sys.executable, "--time", "24:00:00", "--signal-lead", "300", *extra, "--", "python", "train.py"],
        capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def _young_steps(blocked_s: float, gpus: int) -> int:
    mtbf_s = gp.LLAMA3_MTBF_GPU_H * 3600 / gpus
    return round(math.sqrt(2 * blocked_s * mtbf_s) / STEP_S)


def test_the_plan_advises_young_s_save_steps_for_the_job_s_gpus(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _log(out)
    plan = _plan(out, "--nodes", "128", "--ntasks-per-node", "8", "--gpus-per-node", "a100:8")
    expected = _young_steps(SAVE_S, 1024)  # ~2669 steps: sqrt(2 x 20 s x 49.5 h)
    assert (f"  saves:    save_steps {expected} is Young's interval for 1,024 GPUs (one unwarned failure every "
            "49.5 h at Llama 3's rate per GPU): the timing log's steps take 1 s and a periodic save blocks training "
            f"20 s; the log's run saved every {EVERY} steps. HINT: grace-calc goodput --from {out} --gpus 1024 "
            "--time-limit 86400 --restart R") in plan, plan


def test_without_gpus_the_ranks_are_counted_and_an_async_snapshot_s_block_is_used(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _log(out, async_blocked_s=0.5)
    plan = _plan(out, "--nodes", "2", "--ntasks-per-node", "4")
    expected = _young_steps(0.5, 8)
    assert f"  saves:    save_steps {expected} is Young's interval for 8 ranks (counted as GPUs) " in plan, plan
    assert "an async snapshot blocks training 0.5 s (complete after 1.5 s)" in plan, plan


def test_no_saves_line_without_a_timing_log(tmp_path: Path) -> None:
    assert "saves:" not in _plan(tmp_path / "fresh")


def test_a_log_the_model_refuses_gives_no_line_and_the_plan_goes_on(tmp_path: Path) -> None:
    """A save longer than the job's time limit (a log from another setup): no advice, no traceback."""
    out = tmp_path / "out"
    log = timing.TimingLog(out, rank=0, world_size=1, run_id="r1")
    for step in range(1, 5):
        log.step(step, STEP_S)
    log.save(4, "periodic", 1e9, 1000)
    log.close()
    plan = _plan(out)
    assert "saves:" not in plan and "Traceback" not in plan, plan
