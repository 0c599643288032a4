#!/usr/bin/env python3
"""``python launch/submit.py``: the launcher's entry. Everything lives in :mod:`slurm_jit.launch.submit`."""

from slurm_jit.launch.submit import main

if __name__ == "__main__":
    main()
