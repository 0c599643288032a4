"""Phases the hang watchdog must not call a hang under a short ``hang_timeout_s``: ``compute_metrics`` over the
whole evaluation set, after the last batch fed it. A real single process (no DeepSpeed), the long-phase floor cut
to seconds (tests/helpers/demo_short_long_phases.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from slurm_jit.train import stop_record

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
RUN_TIMEOUT_S = 90  # a tiny GPT-2 on one CPU process: ~13 s idle, several times that under load


def test_a_compute_metrics_longer_than_the_step_bound_is_no_hang(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    ran = subprocess.run([sys.executable, str(HELPERS / "demo_short_long_phases.py"), "--output-dir", str(out),
                          "--zero-stage", "0", "--max-steps", "8", "--eval-steps", "4", "--metrics",
                          "--metrics-sleep", "5", "--hang-timeout", "2", "--kill-wait", "0"],
                         env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "hang on rank" not in ran.stderr and ran.stdout.count("'eval_accuracy'") == 2, ran.stdout[-2000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished", record
