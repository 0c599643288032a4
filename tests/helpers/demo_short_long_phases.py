"""demo_train with the hang watchdog's long-phase floor (a save, the first step, the end of training) cut to
``LONG_PHASE_MIN_S`` seconds, so that a test sees a hang after a JIT stop within seconds, not ten minutes. Run as a
script with demo_train's arguments (tests/train/test_hang_records.py). ``LONG_PHASE_FACTOR`` in the environment
also replaces the long phases' factor (0: the floor alone), so a test can keep the step bound generous (a loaded
CI host's steps never reach it) while a long phase's bound stays seconds. ``LONG_PHASE_MIN_S`` replaces the floor;
``SHORT_PHASES_RANK`` cuts it on that rank only (the others keep the watchdog's own)."""

from __future__ import annotations

import os

from slurm_jit import demo_train
from slurm_jit.train import watchdog

LONG_PHASE_MIN_S = 2.0

if __name__ == "__main__":
    if os.environ.get("SHORT_PHASES_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0"):
        watchdog.LONG_PHASE_MIN_S = float(os.environ.get("LONG_PHASE_MIN_S", LONG_PHASE_MIN_S))
        watchdog.LONG_PHASE_FACTOR = float(os.environ.get("LONG_PHASE_FACTOR", watchdog.LONG_PHASE_FACTOR))
    demo_train.main()
