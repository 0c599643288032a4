"""tests/README.md's table of folders: every test file lives in one of the folders it names (the tests mirror
src/slurm_jit/), never flat in tests/, and each folder the table names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
ROW = re.compile(r"^\|\s*(`[^|]+`)\s*\|", re.M)


def table_folders() -> set[str]:
    folders = set()
    for cell in ROW.findall((TESTS / "README.md").read_text(encoding="utf-8")):
        folders.update(name.strip("/") for name in re.findall(r"`([^`]+)/`", cell))
    return folders


def test_every_folder_in_the_table_exists() -> None:
    folders = table_folders()
    assert {"checkpoint", "train", "launch", "helpers"} <= folders, folders
    assert sorted(f for f in folders if not (TESTS / f).is_dir()) == []


def test_every_test_file_is_in_a_folder_of_the_table() -> None:
    folders = table_folders()
    misplaced = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                       if p.relative_to(TESTS).parts[0] not in folders)
    assert misplaced == [], f"test files outside tests/README.md's folders: {misplaced}. HINT: put each beside " \
                            "the code it checks (tests/<folder>/), or add its folder to the table"


def test_no_page_says_the_launcher_bypasses_submitit() -> None:
    # docs/launcher.md once said submit.py "does not use submitit yet" and passed the entry as JSON, while it runs
    # through JitExecutor with a pickled command (docs/submit.md, "submitit and slurm-jit"): one truth.
    stale = [page.name for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "launch" / "README.md"]
             if re.search(r"does not use submitit|entry as JSON", page.read_text(encoding="utf-8"))]
    assert stale == []
