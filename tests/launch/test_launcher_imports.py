"""The processes the batch script runs around the ranks (the ckpt-check gate before srun, the runner each srun task
starts before it execs the program, after_step and the runner's finish after srun) never import torch: each is
on the restart's or the failure's critical path, inside the allocation, and torch's import alone was ~1 s of each
here (3-4 s of every restart and of every crash's detection, issue #36)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

LAUNCHER_MODULES = ("slurm_jit.launch.gate", "slurm_jit.launch.runner", "slurm_jit.launch.after_step",
                    "slurm_jit.stop_record", "slurm_jit.train.stop_record")


@pytest.mark.parametrize("module", LAUNCHER_MODULES)
def test_a_launcher_process_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"{module} imports {proc.stdout.strip()[:300]}"


def test_a_lost_peer_is_still_told_apart_where_torch_is_loaded() -> None:
    """The lazy lookup of torch.distributed's error class: with torch loaded, a DistError is a lost peer's."""
    import torch.distributed as dist

    from slurm_jit.train import save_errors

    exc = dist.DistError("Connection closed by peer [127.0.0.1]:1234")
    line = save_errors.peer_gone_line(Path("/out/checkpoint-5"), exc)
    assert line is not None and "another rank ended or stopped answering" in line, line
