"""One row of the TRL/PEFT matrix (tests/train/test_trl_matrix.py, tests/integration/test_trl_on_slurm.py): a TRL
trainer with JIT on 2 DeepSpeed CPU ranks, run once uninterrupted and once stopped by SIGTERM at a seeded random
step and resumed; what the two left behind, to be compared bitwise."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from jit_helpers import RunResult, assert_jit_stop, losses, run_and_signal, run_logged

from slurm_jit.checkpoint import protocol

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SEED_ENV = "SLURM_JIT_MATRIX_SEED"  # set it to replay a stop step a failed run printed


@dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    program: list[str]  # the example and its row options
    args: list[str]  # demo_train's flags, the same for every run of the row
    max_steps: int
    stop_after: tuple[int, int]  # SIGTERM once a step in this range (seeded) is logged
    weights: str = protocol.WEIGHTS_MASTER_ONLY  # the JIT checkpoint's weights layout (a PEFT model's: its own)


@dataclass
class RowRuns:
    row: Row
    reference: Path
    out: Path
    ckpt: Path  # the JIT checkpoint the stop left
    resumed: RunResult
    stop_after: int
    seconds: dict[str, float]  # wall time of each run: reference, stopped, resumed


def stop_step(row: Row) -> int:
    """The step after which the stopped run gets SIGTERM: random, seeded, printed (replay with SEED_ENV)."""
    seed = int(os.environ.get(SEED_ENV, random.randrange(2**31)))
    step = random.Random(seed).randint(*row.stop_after)
    print(f"trl matrix {row.name}: SIGTERM after step {step} ({SEED_ENV}={seed})")
    return step


def run_row(row: Row, root: Path) -> RowRuns:
    """The reference run, then the stopped run and its resume, in ``root``."""
    seconds: dict[str, float] = {}
    start = time.monotonic()
    reference = root / "reference"
    ran = run_logged(reference, row.args, program=row.program)
    assert ran.codes == [0, 0], ran.log[-4000:]
    seconds["reference"] = time.monotonic() - start
    stop_after = stop_step(row)
    out = root / "out"
    start = time.monotonic()
    stopped = run_and_signal(out, row.args, [(0, 0.0), (1, 0.0)], after_steps=stop_after, signum=signal.SIGTERM,
                             program=row.program)
    ckpt = assert_jit_stop(out, stopped, row.weights)
    seconds["stopped"] = time.monotonic() - start
    start = time.monotonic()
    resumed = run_logged(out, [*row.args, "--resume"], program=row.program)
    assert resumed.codes == [0, 0], resumed.log[-4000:]
    seconds["resumed"] = time.monotonic() - start
    print(f"trl matrix {row.name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    return RowRuns(row=row, reference=reference, out=out, ckpt=ckpt, resumed=resumed, stop_after=stop_after,
                   seconds=seconds)


def evals(out: Path) -> list[dict[str, float]]:
    path = out / "evals-rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def final_state(out: Path) -> dict[str, object]:
    return json.loads((out / "final-state.json").read_text())


def checkpoints(out: Path) -> list[str]:
    """The checkpoint directories rotation left, by step."""
    return sorted((p.name for p in out.glob("checkpoint-*") if p.is_dir()), key=lambda n: int(n.split("-")[1]))


__all__ = ["Row", "RowRuns", "checkpoints", "evals", "final_state", "losses", "run_row", "stop_step"]
