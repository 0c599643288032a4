"""The launcher's plan advises periodic saves from the timing log (issue #36 item 4), said as what to do (issue #41
item 4): Young's interval sqrt(2 x blocked save x MTBF) at the job's GPUs (its ranks where it asks for none) and
Llama 3's failure rate per GPU, in steps, or no periodic save where the JIT stop at each allocation's end covers it
(an interval past --time, or few failures per allocation); the arithmetic behind --explain; the log's step at the
job's world size (else its newest run's, said so); --step-time, --save-time and --from as the grace calculator
takes them; no line (and never a traceback, never a refused submission) where no advice can be given."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import plan_text

from slurm_jit import timing
from slurm_jit.grace import goodput as gp

ROOT = Path(__file__).resolve().parents[2]
STEP_S, SAVE_S, EVERY = 1.0, 20.0, 10
BIG_JOB = ("--nodes", "128", "--ntasks-per-node", "8", "--gpus-per-node", "a100:8")  # 1,024 GPUs and ranks


def _log(out: Path, *, world_size: int = 1024, step_s: float = STEP_S, save_s: float = SAVE_S,
         async_blocked_s: float | None = None, background_s: float = 1.0, run_id: str = "r1") -> None:
    """Ranks 0 and 1 of a run of ``world_size``: 30 steps, a periodic save every 10."""
    for rank in (0, 1):
        log = timing.TimingLog(out, rank=rank, world_size=world_size, run_id=run_id)
        for step in range(1, 31):
            log.step(step, step_s)
            if step % EVERY == 0 and async_blocked_s is None:
                log.save(step, "periodic", save_s, 1000)
            elif step % EVERY == 0:
                log.save_blocked(step, "periodic", async_blocked_s, 1000, {"stage": async_blocked_s})
                log.save_background(step, "periodic", background_s, 1000, {"write_s": background_s,
                                                                            "staged_bytes": 1000})
        log.close()


def _plan(out: Path, *extra: str, time: str = "24:00:00") -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "submit.py"), "--dry-run", "--explain", "--output-dir", str(out),
         "--python", sys.executable, "--time", time, "--signal-lead", "300", *extra, "--", "python", "train.py"],
        capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def _saves(plan: str) -> str:
    assert len([line for line in plan.splitlines() if line.startswith("  saves:    ")]) == 2, plan  # and --explain's
    return "  saves:    " + plan_text.value(plan.split("\nwhy:\n", 1)[0], "saves:")


def _why(plan: str) -> str:
    """--explain's saves: paragraph, its wrapped lines read as one."""
    why = plan.split("\nwhy:\n", 1)[1].split("\n  saves:    ", 1)[1].split("\n  requeue:  ", 1)[0]
    return " ".join(why.split())


def _young_steps(blocked_s: float, gpus: int, step_s: float = STEP_S) -> int:
    mtbf_s = gp.LLAMA3_MTBF_GPU_H * 3600 / gpus
    return round(math.sqrt(2 * blocked_s * mtbf_s) / step_s)


def test_the_plan_advises_young_s_save_steps_for_the_job_s_gpus(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _log(out)
    expected = _young_steps(SAVE_S, 1024)  # 2670 steps: sqrt(2 x 20 s x 49.5 h)
    plan = _plan(out, *BIG_JOB)
    assert _saves(plan) == (f"  saves:    save_steps {expected} (every 44.5 min: Young's interval for 1,024 GPUs, one "
                            "unwarned failure every 49.5 h)")
    assert _why(plan) == (
        "Young's interval sqrt(2 x 20 s blocked per save x 49.5 h between unwarned failures of 1,024 GPUs at Llama 3's "
        f"rate per GPU) = 44.5 min: save_steps {expected} (44.5 min); the timing log's steps take 1 s and a periodic "
        f"save blocks training 20 s; the log's run saved every {EVERY} steps; 0.48 unwarned failures expected per "
        f"allocation of 24 h. HINT: grace-calc goodput --from {out} --gpus 1024 --time-limit 86400 --restart R (a "
        "requeue's cost here) for your cluster's failure rates and each choice's goodput")


def test_the_job_s_world_size_is_picked_from_a_log_of_several_and_another_is_said(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _log(out, world_size=1024, step_s=0.5, run_id="r1")
    _log(out, world_size=512, step_s=1.0, run_id="r2")  # the newest run: half the ranks, twice the step
    assert f"save_steps {_young_steps(SAVE_S, 1024, 0.5)} (" in _saves(_plan(out, *BIG_JOB))
    plan = _plan(out, "--nodes", "256", "--ntasks-per-node", "8", "--gpus-per-node", "8")  # 2048: none in the log
    assert f"save_steps {_young_steps(SAVE_S, 2048, 1.0)} (every 31.5 min: Young's interval for 2,048 GPUs" \
        in _saves(plan), plan
    assert ("the timing log's steps at world size 512 (not this job's 2048: a step's time changes with it; "
            "--step-time to give this job's) take 1 s") in _why(plan), plan


def test_given_step_and_save_times_and_from_are_the_grace_calculator_s(tmp_path: Path) -> None:
    out, other = tmp_path / "out", tmp_path / "other"
    _log(out)
    _log(other, step_s=5.0, save_s=200.0)
    plan = _plan(out, *BIG_JOB, "--step-time", "2", "--save-time", "50")
    assert f"save_steps {_young_steps(50.0, 1024, 2.0)} (" in _saves(plan), plan
    assert ("steps take 2 s (--step-time) and a save blocks training 50 s (--save-time)" in _why(plan)
            and "--step-time 2 --save-time 50" in _why(plan)), plan
    plan = _plan(tmp_path / "fresh", *BIG_JOB, "--from", str(other))
    assert f"save_steps {_young_steps(200.0, 1024, 5.0)} (" in _saves(plan) and f"--from {other} " in _why(plan), plan


def test_without_gpus_the_ranks_are_counted_and_few_failures_need_no_periodic_save(tmp_path: Path) -> None:
    """8 ranks for a day: an unwarned failure ends 1 allocation in ~260, under FEW_FAILURES_PER_ALLOCATION."""
    out = tmp_path / "out"
    _log(out, world_size=8, async_blocked_s=0.5)
    plan = _plan(out, "--nodes", "2", "--ntasks-per-node", "4")
    assert _saves(plan) == ("  saves:    no periodic save needed: the JIT stop covers each allocation's end (an "
                            "unwarned failure ends 1 in 260 allocations of 8 ranks (counted as GPUs))"), plan
    why = _why(plan)
    assert f"save_steps {_young_steps(0.5, 8)} (" in why and "unwarned failures of 8 ranks (counted as GPUs)" in why
    assert "an async snapshot blocks training 0.5 s (complete after 1.5 s)" in why, why
    assert "--save-time S (a synchronous save's seconds: the log has none)" in why, why  # grace-calc needs one


def test_the_background_write_as_the_floor_and_an_interval_past_the_time_limit_are_said(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _log(out, async_blocked_s=0.01, background_s=600.0)  # Young: sqrt(2 x 0.01 s x 49.5 h) = 59.7 s < 600 s
    plan = _plan(out, *BIG_JOB)
    assert _saves(plan) == ("  saves:    save_steps 600 (every 10 min: the background write for 1,024 GPUs, one "
                            "unwarned failure every 49.5 h)"), plan
    assert "= 59.7 s, shorter than the background write's 600 s (a save waits for the one before it): save_steps " \
           "600 (10 min)" in _why(plan), plan
    _log(tmp_path / "small", world_size=2)  # 2 ranks: Young's interval is days, the job 90 minutes
    plan = _plan(tmp_path / "small", "--nodes", "1", "--ntasks-per-node", "2", time="90")
    assert _saves(plan) == ("  saves:    no periodic save needed: the JIT stop covers each allocation's end (Young's "
                            "interval, 16.8 h, is longer than --time 90 min)"), plan
    assert "a periodic save would only ever cover an unwarned failure" in _why(plan), plan


def test_a_path_the_shell_would_split_is_quoted_in_the_hint(tmp_path: Path) -> None:
    out = tmp_path / "my out;x"
    _log(out)
    assert f"--from '{out}' --gpus" in _why(_plan(out, *BIG_JOB))


def test_no_line_where_no_advice_can_be_given(tmp_path: Path) -> None:
    assert "saves:" not in _plan(tmp_path / "fresh")  # no timing log
    _log(tmp_path / "zero", save_s=0.0)  # a save of 0 s: nothing to trade against
    assert "saves:" not in _plan(tmp_path / "zero", *BIG_JOB)
    _log(tmp_path / "tiny", step_s=1e-310)  # Young's interval over this step overflows
    assert "saves:" not in _plan(tmp_path / "tiny", *BIG_JOB)
    _log(tmp_path / "long", world_size=1, save_s=1e9)  # a save longer than the job: the model refuses it
    assert "saves:" not in _plan(tmp_path / "long")
    _log(tmp_path / "fine")
    huge = "a100:" + "9" * 400  # sbatch's syntax, past any cluster: sbatch refuses it, the plan gives no advice
    assert "  saves:    save_steps" in _plan(tmp_path / "fine", *BIG_JOB)
    assert "saves:" not in _plan(tmp_path / "fine", "--gpus-per-node", huge)
