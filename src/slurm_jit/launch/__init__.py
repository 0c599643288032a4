"""Launchers: ``python launch/submit.py``, :class:`JitExecutor` (submitit), and the helpers the sbatch scripts run
(gate, task, runner, after_step)."""

from __future__ import annotations

from typing import Any

__all__ = ["Command", "CommandOutcome", "JitExecutor"]


def __getattr__(name: str) -> Any:
    # Lazy: the batch script's helpers (gate, after_step) import this package and need no submitit.
    if name == "JitExecutor":
        from slurm_jit.launch.executor import JitExecutor

        return JitExecutor
    if name in ("Command", "CommandOutcome"):
        from slurm_jit.launch import command

        return getattr(command, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
