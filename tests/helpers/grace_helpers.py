"""grace-calc for tests: run the CLI, the sizings of the example scripts and what `grace-calc check` says of each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "sbatch"
EXAMPLE_SIZING = ("--step-time", "10s", "--save-time", "45s")  # needs TERM@69 (sbatch/examples/README.md)
TINY_SIZING = ("--step-time", "1s", "--save-time", "10s")  # the demo's saves are well under a second
CLI_TIMEOUT_S = 60


def grace_calc(
    *args: str, env: dict[str, str] | None = None, script: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run grace-calc (``python -m``, or the installed console script) with a clean world-size environment."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SLURM_NTASKS")}
    run_env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), run_env.get("PYTHONPATH", "")])
    run_env.update(env or {})
    exe = Path(sys.executable).parent / "grace-calc"
    argv = [str(exe)] if script else [sys.executable, "-m", "slurm_jit.grace.cli"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, env=run_env, timeout=CLI_TIMEOUT_S,
                          cwd=ROOT, check=False)


EXPECTED = {  # script -> (exit code, text that must appear)
    "train-tiny.sbatch": (0, "ENOUGH"),
    "demo.sbatch": (0, "runs in the batch shell and gets no signal; taken as a pre/post step"),
    "one-node-gpus.sbatch": (0, "runs in an srun job step, which --signal reaches"),
    "multi-node.sbatch": (0, "runs in an srun job step, which --signal reaches"),
    "examples/good-batch-exec.sbatch": (0, "`exec` made it the batch shell"),
    "examples/good-batch-trap.sbatch": (0, "assuming its trap forwards SIGTERM"),
    "examples/bad-short-lead.sbatch": (1, "lead 30 s < needed 69 s. HINT: use #SBATCH --signal=TERM@69"),
    "examples/bad-default-lead.sbatch": (1, "lead 60 s (sbatch's default when no @N is given) < needed 69 s"),
    "examples/bad-bare-python.sbatch": (1, "SIGTERM never reaches Python. HINT: start it with srun"),
    "examples/bad-batch-only.sbatch": (1, "with B: only the batch shell gets SIGTERM"),
    "examples/bad-trap-foreground.sbatch": (1, "bash runs a trap only after the foreground command ends"),
    "examples/bad-torchrun.sbatch": (1, "torchrun SIGKILLs its workers 30 s after it forwards SIGTERM"),
    "examples/bad-export-mismatch.sbatch": (1, "SLURM_JIT_SIGNAL_LEAD_S=120 but the --signal lead is 300"),
    "examples/bad-lead-over-time.sbatch": (1, "--signal lead 600 s >= --time 300 s"),
    "examples/bad-no-signal.sbatch": (2, "no #SBATCH --signal. HINT: add #SBATCH --signal=TERM@69"),
    "examples/bad-late-directive.sbatch": (2, "comes after the first command, and sbatch ignores it"),
}
