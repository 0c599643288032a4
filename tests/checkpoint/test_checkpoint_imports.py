"""The layering (docs/STYLE: launch -> train -> grace -> checkpoint -> timing, slurm): no module of
src/slurm_jit/checkpoint/ imports slurm_jit.train, launch or grace, not even inside a function (``ckpt-check
--reseal`` gets the output directory's lock handed in by the ``ckpt-check`` command)."""

from __future__ import annotations

import ast
from pathlib import Path

CHECKPOINT_SRC = Path(__file__).resolve().parents[2] / "src" / "slurm_jit" / "checkpoint"
ABOVE = ("slurm_jit.train", "slurm_jit.launch", "slurm_jit.grace")


def _imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def test_no_checkpoint_module_imports_a_layer_above_it() -> None:
    modules = sorted(CHECKPOINT_SRC.glob("*.py"))
    assert len(modules) >= 5, modules  # the folder is where this test thinks it is
    upward = {path.name: name for path in modules for name in _imported(ast.parse(path.read_text()))
              if name.startswith(ABOVE) or name in ("slurm_jit.JitTrainer", "slurm_jit.with_jit")}
    assert not upward, upward
