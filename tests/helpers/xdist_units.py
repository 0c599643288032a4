"""How ``tools/test``'s two pytest-xdist workers share the suite (hooked in ``tests/conftest.py``).

Every file whose tests start DeepSpeed ranks, trainings or Slurm jobs is in ONE work unit, handed out first and run
file after file by one worker, in the order a single process runs them: they want the machine's two cores, share
the one local cluster and the session fixtures' runs, and their timing windows were measured that way. Every other
file is a unit of its own for the other worker, whose tests run at nice ``LIGHT_NICE`` so that they take only the
CPU the heavy ones leave (a serial run is the upper bound on the time). xdist's own ``--dist loadgroup`` renames
node ids, which pytest 9 no longer reads, hence this scheduler over ``LoadScopeScheduling``'s seams (pytest-xdist
is pinned for them in pyproject.toml).

A file's unit is decided by its text (the controller never collects): ``HEAVY_WORDS``. A test checks that every
test marked ``slow`` (deepspeed or slurm) is in the heavy unit.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

HEAVY_UNIT = "heavy: DeepSpeed ranks, trainings and Slurm jobs"
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
def is_heavy_file(path: Path) -> bool:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return any(word in text for word in HEAVY_WORDS)


class HeavyFirstScheduling(LoadScopeScheduling):
    """``LoadScopeScheduling`` with the heavy files in one unit, given out before any other."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return HEAVY_UNIT if is_heavy_file(Path(self.config.rootpath, path)) else path

    def _assign_work_unit(self, node: object) -> None:
        if HEAVY_UNIT in self.workqueue:
            self.workqueue.move_to_end(HEAVY_UNIT, last=False)
        super()._assign_work_unit(node)  # type: ignore[arg-type]


def yield_the_cores(heavy: bool) -> None:
    """In an xdist worker: this process (and what it starts) at nice 0 for a heavy test, LIGHT_NICE otherwise."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0 if heavy else LIGHT_NICE)
    except OSError:
        pass  # not root: going back to 0 is refused; the test runs all the same
