"""Functions submitted with JitExecutor in the tests: importable by module name on the job's nodes (tests/ is on
the job's PYTHONPATH, exported by sbatch), so cloudpickle stores them by reference."""

from __future__ import annotations

import json
import os
from pathlib import Path

import submitit


def train_demo(out: str, *demo_args: str) -> dict[str, object]:
    """demo_train's entry as a function (JitTrainer, 2 CPU ranks): returns what the last run saw."""
    from slurm_jit import demo_train

    demo_train.main(["--output-dir", out, "--resume", *demo_args])
    env = submitit.JobEnvironment()  # works: the script exports SUBMITIT_EXECUTOR=slurm
    final = Path(out, "final-state.json")
    step = json.loads(final.read_text())["global_step"] if env.global_rank == 0 and final.exists() else None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "submitit_rank": env.global_rank, "restart": os.environ.get("SLURM_RESTART_COUNT", "0"), "step": step}


def add(a: int, b: int) -> int:
    return a + b


def fail(message: str) -> None:
    raise ValueError(message)


def returns_a_lock() -> object:
    import threading

    return threading.Lock()


def exits(code: int) -> None:
    raise SystemExit(code)
