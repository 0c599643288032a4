"""How ``tools/test``'s two pytest-xdist workers share the suite (hooked in ``tests/conftest.py``).

The heavy files, whose tests start DeepSpeed ranks, trainings or Slurm jobs, are in two work units handed out
first, one to each worker, and run file after file in the order a single process runs them: ``CLUSTER_UNIT``,
every file with Slurm tests (they share the one local cluster, its cores and the two-node cluster's drained node:
never two at once), and ``RANKS_UNIT``, the other heavy files (they share the session fixtures' runs, made once).
A serial run of the two took ~88 min here, over CI's 90. Every other file is a unit of its own, taken by whichever
worker is free, its tests at nice ``LIGHT_NICE`` so that they take only the CPU the heavy ones leave. xdist's own
``--dist loadgroup`` renames node ids, which pytest 9 no longer reads, hence this scheduler over
``LoadScopeScheduling``'s seams (pytest-xdist is pinned for them in pyproject.toml).

A file's unit is decided by its text (the controller never collects): ``HEAVY_WORDS``, ``CLUSTER_WORDS``. A test
checks that every test marked ``slow`` (deepspeed or slurm) is in a heavy unit, and every ``slurm`` one in the
cluster's.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

CLUSTER_UNIT = "heavy: Slurm jobs on the local cluster"
RANKS_UNIT = "heavy: DeepSpeed ranks and trainings"
HEAVY_UNITS = (RANKS_UNIT, CLUSTER_UNIT)  # handed out in this order, before any other unit
CLUSTER_WORDS = ("mark.slurm",)
# Heavy files that need no cluster but run with it for balance: the tools' end-to-end smoke runs (~5 min; a clean
# clone had the Slurm unit done ~25 min before the other)
WITH_THE_CLUSTER_DIRS = ("bench", "faults")
# Fixtures that start DeepSpeed ranks: a test that uses one is a `deepspeed` test whatever its own marks say.
DEEPSPEED_FIXTURES = frozenset({"plain_zero2_run", "jit_zero2_run", "reference_losses"})
HEAVY_WORDS = (
    "mark.slurm", "mark.deepspeed", *sorted(DEEPSPEED_FIXTURES),
    # tests/helpers/jit_helpers.py's ways to start ranks or a training, and local_ranks' own
    "run_logged(", "run_to_end(", "start_ranks(", "run_and_signal(", "start_demo(", "run_demo(",
    "train_one_process(", "local_ranks.start(",
)
LIGHT_NICE = 10  # CFS weight 110 against 1024: a light test gets ~10 % of a core the heavy ones want


@functools.cache
def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def is_heavy_file(path: Path) -> bool:
    return any(word in _text(path) for word in HEAVY_WORDS)


def unit_of(path: Path) -> str | None:
    """The heavy unit of a test file, or None for a light one (a unit of its own)."""
    if any(word in _text(path) for word in CLUSTER_WORDS):
        return CLUSTER_UNIT
    if path.parent.name in WITH_THE_CLUSTER_DIRS and is_heavy_file(path):
        return CLUSTER_UNIT
    return RANKS_UNIT if is_heavy_file(path) else None


class HeavyFirstScheduling(LoadScopeScheduling):
    """``LoadScopeScheduling`` with the heavy files in two units, given out before any other."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return unit_of(Path(self.config.rootpath, path)) or path

    def _assign_work_unit(self, node: object) -> None:
        for unit in reversed(HEAVY_UNITS):
            if unit in self.workqueue:
                self.workqueue.move_to_end(unit, last=False)
        super()._assign_work_unit(node)  # type: ignore[arg-type]


def yield_the_cores(heavy: bool) -> None:
    """In an xdist worker: this process (and what it starts) at nice 0 for a heavy test, LIGHT_NICE otherwise."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0 if heavy else LIGHT_NICE)
    except OSError:
        pass  # not root: going back to 0 is refused; the test runs all the same
