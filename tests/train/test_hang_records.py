"""The stop record when the hang watchdog fires: an earlier run's hang reports are not this run's, a hang after a
complete JIT stop checkpoint leaves the record a JIT stop (requeued, resumed from it), and the watchdog's thread
and the main thread never interleave their writes of the record. Real single processes (no DeepSpeed), a real
SIGTERM, real threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from slurm_jit.checkpoint import protocol
from slurm_jit.checkpoint.verdict import Status
from slurm_jit.timing import TIMING_DIR
from slurm_jit.train import stop_record

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
RUN_TIMEOUT_S = 90  # a tiny GPT-2 on one CPU process: ~8 s idle, several times that under load
ONE_PROCESS = ["--zero-stage", "0", "--max-steps", "20", "--kill-wait", "0"]


def _demo(program: list[str], out: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env.update(extra_env)
    return subprocess.run([sys.executable, *program, "--output-dir", str(out), *ONE_PROCESS, *args], env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)


def _stop_record_cli(out: Path) -> int:
    return subprocess.run([sys.executable, "-m", "slurm_jit.stop_record", str(out)], capture_output=True,
                          check=False).returncode


def test_an_earlier_runs_hang_report_does_not_make_this_runs_failure_a_hang(tmp_path: Path) -> None:
    out = tmp_path / "out"
    old = {"rank": 1, "step": 7, "phase": "step", "since_s": 31.0, "bound_s": 30.0, "node": "n2", "frame": "x"}
    stop_record.write_hang_report(out, 1, old)  # an earlier 2-rank run's rank 1 hung; this run has one rank
    ran = _demo(["-m", "slurm_jit.demo_train"], out, "--fail-at-step", "2")
    assert ran.returncode == 1, ran.stderr[-3000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "failed", record
    assert "failure injected at step 2" in record["error"] and "ranks" not in record, record
    assert _stop_record_cli(out) == stop_record.EXIT_CRASHED
    assert not list((out / TIMING_DIR).glob(stop_record.HANG_REPORT_GLOB))


def test_a_hang_after_the_jit_stop_checkpoint_keeps_the_record_a_jit_stop(tmp_path: Path) -> None:
    out = tmp_path / "out"
    ran = _demo([str(HELPERS / "demo_short_long_phases.py")], out, "--signal-self-at-step", "3",
                "--hang-timeout", "30", "--slow-train-end", "60",  # hangs in on_train_end after the stop
                LONG_PHASE_FACTOR="0")  # the end of training's bound: 2 s; a step's stays 30 s (a loaded host)
    assert ran.returncode == 87, ran.stderr[-3000:]
    assert "slurm_jit: JIT stop: SIGTERM at step 3" in ran.stderr and "hang on rank 0" in ran.stderr, ran.stderr
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop", record
    assert record["checkpoint"] == str(out / "checkpoint-3") and record["signal"] == "SIGTERM", record
    assert "hung in 'end of training'" in record["error_after_stop"] and record["ranks"][0]["rank"] == 0, record
    assert protocol.inspect(out / "checkpoint-3", 3, deep=True).status == Status.COMPLETE
    assert _stop_record_cli(out) == stop_record.EXIT_REQUEUE


def test_writes_from_two_threads_never_interleave(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def writer(state: str) -> None:
        try:
            for step in range(150):
                stop_record.write(tmp_path, state, step=step, checkpoint=None)
        except BaseException as exc:  # noqa: BLE001 - what a torn write raises is the finding
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(state,)) for state in ("jit_stop", "hung")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [], errors[:3]
    record = stop_record.read(tmp_path)
    assert record is not None and record["step"] == 149, record
    assert not stop_record.path(tmp_path).with_suffix(".tmp").exists()
