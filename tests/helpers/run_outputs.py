"""What a finished or stopped demo_train run left in its OUT_DIR: the evaluations, a checkpoint's manifest, the
checkpoint directory names. Shared by the tests of tests/train/ that read one run several ways."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_jit.checkpoint import protocol


def eval_losses(out: Path) -> list[tuple[int, float]]:
    path = out / "evals-rank0.jsonl"
    return [(r["step"], r["eval_loss"]) for r in map(json.loads, path.read_text().splitlines())] if path.exists() \
        else []


def manifest_of(ckpt: Path) -> dict:
    return json.loads((ckpt / protocol.MANIFEST_NAME).read_text())


def checkpoint_names(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
