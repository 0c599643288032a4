"""``python -m slurm_jit.stop_record OUT_DIR``: the stable command.

The record itself lives in :mod:`slurm_jit.train.stop_record`.
"""

from slurm_jit.train.stop_record import main

if __name__ == "__main__":
    main()
