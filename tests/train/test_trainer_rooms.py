"""JitTrainer in rooms: the class users see stays small, every override it makes is listed once with its reason,
no module of train/ (its sub-folders too) grows past the size a reader can hold (STYLE.md: modules under ~500
lines), and the rooms reach the trainer through the session (session.py), never through its private fields or an
import of trainer.py (issue #43)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import transformers

from slurm_jit.train import trainer as trainer_module
from slurm_jit.train.trainer import JitTrainer

TRAIN_DIR = Path(trainer_module.__file__).parent
TRAINER_MAX_LINES = 400  # issue 18: the class users see, its body delegating to the rooms of train/
MODULE_MAX_LINES = 500  # STYLE.md: modules under ~500 lines
SRC = TRAIN_DIR.parent
# trainer._x, self.trainer._x, trainer.__dict__: a read of the JitTrainer's private fields
PRIVATE_READ = re.compile(r"\btrainer\.(_\w+|__dict__)")
TABLE_ROW = re.compile(r"^``(\w+)``\s{2,}\S", re.MULTILINE)  # a row of the reST table in trainer.py's docstring


def _overrides() -> set[str]:
    """The Trainer methods JitTrainer defines again (its own helpers, and Python's hooks such as __init__ or
    __init_subclass__, are not overrides of the Trainer's)."""
    return {name for name, value in vars(JitTrainer).items()
            if callable(value) and not name.startswith("__") and hasattr(transformers.Trainer, name)}


def test_every_override_is_listed_once_in_the_trainer_docstring_with_a_reason() -> None:
    doc = inspect.getdoc(trainer_module) or ""
    rows = TABLE_ROW.findall(doc)
    assert len(rows) == len(set(rows)), f"listed twice: {sorted(r for r in rows if rows.count(r) > 1)}"
    missing, stale = _overrides() - set(rows), set(rows) - _overrides()
    assert not missing, f"overridden but not in trainer.py's override table: {sorted(missing)}"
    assert not stale, f"in the override table but not overridden: {sorted(stale)}"


def test_the_trainer_module_stays_under_its_size() -> None:
    lines = len((TRAIN_DIR / "trainer.py").read_text().splitlines())
    assert lines < TRAINER_MAX_LINES, f"trainer.py has {lines} lines: move logic to its room in train/"


def test_no_module_of_train_is_over_the_style_limit() -> None:
    sizes = {str(path.relative_to(TRAIN_DIR)): len(path.read_text().splitlines())
             for path in sorted(TRAIN_DIR.rglob("*.py"))}
    over = {name: n for name, n in sizes.items() if n > MODULE_MAX_LINES}
    assert not over, f"modules of train/ over {MODULE_MAX_LINES} lines: {over}"


def test_no_module_but_trainer_py_reads_the_trainer_s_private_fields() -> None:
    reads = [f"{path.relative_to(SRC)}:{number}: {line.strip()}"
             for path in sorted(SRC.rglob("*.py")) if path != TRAIN_DIR / "trainer.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE_READ.search(line)]
    assert not reads, "the trainer's private fields read outside trainer.py (take the session):\n" + "\n".join(reads)


def _imports_trainer_py(path: Path) -> bool:
    """Whether ``path`` imports slurm_jit.train.trainer anywhere: at module level, under TYPE_CHECKING or in a
    function."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name == "slurm_jit.train.trainer" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module == "slurm_jit.train.trainer" or (
                node.module == "slurm_jit.train" and any(a.name == "trainer" for a in node.names))):
            return True
    return False


def test_no_module_of_train_imports_trainer_py() -> None:
    importers = [str(path.relative_to(SRC)) for path in sorted(TRAIN_DIR.rglob("*.py")) if _imports_trainer_py(path)]
    assert not importers, f"modules of train/ importing trainer.py (type against session.Session): {importers}"
