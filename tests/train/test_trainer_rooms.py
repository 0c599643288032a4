"""JitTrainer in rooms: the class users see stays small, every override it makes is listed once with its reason,
and no module of train/ grows past the size a reader can hold (STYLE.md: modules under ~500 lines)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import transformers

from slurm_jit.train import trainer as trainer_module
from slurm_jit.train.trainer import JitTrainer

TRAIN_DIR = Path(trainer_module.__file__).parent
TRAINER_MAX_LINES = 400  # issue 18: the class users see, its body delegating to the rooms of train/
MODULE_MAX_LINES = 500  # STYLE.md: modules under ~500 lines
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
    sizes = {path.name: len(path.read_text().splitlines()) for path in sorted(TRAIN_DIR.glob("*.py"))}
    over = {name: n for name, n in sizes.items() if n > MODULE_MAX_LINES}
    assert not over, f"modules of train/ over {MODULE_MAX_LINES} lines: {over}"
