"""demo_train as a user's script that sets up no logging at all (no handler, no level for ``slurm_jit``): what a
job log shows by default. Run as a script with demo_train's arguments (tests/train/test_stop_line.py)."""

from __future__ import annotations

from slurm_jit import demo_train

if __name__ == "__main__":
    demo_train._show_info_lines = lambda: None  # the demo's own INFO handler: a user's script has none
    demo_train.main()
