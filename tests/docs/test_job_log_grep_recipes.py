"""The docs' recipes that grep a job's log for the launcher's, the trainer's and Slurm's lines (issue #41 item 6)
keep Slurm's ``*** STEP ... CANCELLED ***`` line and leave out the ``TrainingArguments`` dump every HF script
prints (``save_strategy=SaveStrategy.STEPS,``): each recipe as written in README.md and docs/, run by the real
grep over a log with both."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
START = "grep -a -e '^slurm-jit'"
LOG = """slurm-jit: job 10035 restart 0 on node[1-2]
Training/evaluation parameters TrainingArguments(
logging_strategy=IntervalStrategy.STEPS,
save_strategy=SaveStrategy.STEPS,
)
slurmstepd-node1: error: *** STEP 10035.0 ON node1 CANCELLED AT 2026-12-02T07:08:46 ***
slurm_jit: JIT stop: SIGTERM at step 3101, stopped at step 3191, checkpoint out/checkpoint-3191 complete
"""


def _recipes() -> list[tuple[str, str]]:
    """(file, the grep command as written: markdown's line breaks undone), for every recipe in the docs."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        for match in re.finditer(re.escape(START), text):
            command = re.match(r"[^|`#]*?\.out", text[match.start():], re.DOTALL)
            assert command is not None, f"{doc.name}: a grep recipe without its log: {text[match.start():][:200]}"
            found.append((doc.name, " ".join(command.group(0).split())))
    return found


def test_the_docs_have_recipes_to_check() -> None:
    assert {name for name, _ in _recipes()} >= {"README.md", "submit.md", "stacks.md"}


@pytest.mark.parametrize(("doc", "recipe"), _recipes())
def test_a_recipe_keeps_slurm_s_step_line_and_leaves_the_training_arguments_out(doc: str, recipe: str,
                                                                                  tmp_path: Path) -> None:
    log = tmp_path / "slurm-10035.out"
    log.write_text(LOG)
    argv = [*shlex.split(recipe)[:-1], str(log)]  # the recipe's own log path replaced by this one
    out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30).stdout
    assert "*** STEP 10035.0 ON node1 CANCELLED" in out and "slurm-jit: job 10035" in out, (doc, recipe, out)
    assert "STEPS," not in out, (doc, recipe, out)
