"""The ``ckpt-check`` command: checkpoint/ckpt_check.py with the output directory's lock (train/output_lock.py)
handed in for ``--reseal``, here above both: a checkpoint module never imports train/."""

from __future__ import annotations

from collections.abc import Sequence

from slurm_jit.checkpoint import ckpt_check
from slurm_jit.train import output_lock


def main(argv: Sequence[str] | None = None) -> None:
    """``ckpt-check``'s entry point (see ``ckpt-check --help``)."""
    ckpt_check.main(argv, dir_lock=output_lock)


if __name__ == "__main__":
    main()
