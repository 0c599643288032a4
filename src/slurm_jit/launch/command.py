"""What a :class:`~slurm_jit.launch.executor.JitExecutor` job runs when it is not a Python function.

``executor.submit(Command(["python", "train.py", "--lr", "3e-4"]))``: each srun task sets the rank environment and
execs the program in place (the rank *is* the srun task, so Slurm's signals reach it directly). Its result, after
the whole requeue chain, is a :class:`CommandOutcome`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Command:
    """A program and its arguments, passed as data (no shell sees them)."""

    argv: tuple[str, ...]

    def __init__(self, argv: Sequence[str]) -> None:
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv) or not argv[0].strip():
            raise ValueError(f"Command({argv!r}): not a program and its arguments. HINT: a list of strings, "
                             'e.g. Command(["python", "train.py", "--lr", "3e-4"])')
        object.__setattr__(self, "argv", tuple(argv))

    def problem(self) -> str | None:
        """Why the program cannot be exec'd from here (checked at submit; a bare name is looked up on PATH)."""
        program = self.argv[0]
        found = program if os.sep in program else shutil.which(program)
        if found is None:
            return f"{program}: not found on PATH"
        if os.path.isdir(found) or not os.path.exists(found):
            return f"{found}: no such program"
        if not os.access(found, os.X_OK):
            return f"{found}: not executable (no exec bit)"
        return None

    def __call__(self) -> Any:
        raise TypeError("a Command is exec'd by each srun task, not called. HINT: submit it: "
                        "JitExecutor(...).submit(Command([...]))")


@dataclass(frozen=True, kw_only=True)
class CommandOutcome:
    """A :class:`Command` job's result: how the whole requeue chain ended."""

    job_id: str
    restarts: int  # SLURM_RESTART_COUNT of the last run
    final_step: int | None  # the global step in the last run's stop record; None without one
    stop_record: dict[str, Any] | None  # the last run's stop record (None: the program wrote none)
    srun_exit: int  # the last run's srun exit status
