"""The Slurm gateway's runner faked at its one boundary (``slurm.runner``), for the launcher's fast tests."""

from __future__ import annotations

from collections.abc import Sequence


class SubmitGateway:
    """sbatch answers job 4242, ``scontrol show job`` a RUNNING job; every argv is kept (a refusal leaves none)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout_s: float) -> str:
        self.calls.append(list(argv))
        if argv[0] == "sbatch":
            return "4242\n"
        if argv[:3] == ["scontrol", "show", "job"]:
            return f"JobId={argv[3]} JobName=x\n   JobState=RUNNING Reason=None\n   Restarts=0\n"
        return ""
