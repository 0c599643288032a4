"""The README and docs/ pages: every relative link resolves (file and anchor), and each CLI page lists every
option its parser has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slurm_jit.checkpoint import ckpt_check
from slurm_jit.grace import cli as grace_cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks; inline code spans are kept (a heading's slug is made from them)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(prose(page.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(CODE_SPAN.sub("", prose(page.read_text(encoding="utf-8")))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not ours to check here
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_a_broken_link_and_a_wrong_anchor_are_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# The `x` page: one\n\n[a](page.md#the-x-page-one) [b](gone.md) [c](#nowhere)\n"
                    "`[not a link](gone.md)`\n```\n[in code](gone.md)\n```\n", encoding="utf-8")
    assert broken_links(page) == ["gone.md: no such file", "#nowhere: no heading with that anchor in page.md"]


def option_strings(parser: object) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")}  # type: ignore[attr-defined]


@pytest.mark.parametrize(("page", "parsers"), [
    ("grace-calc.md", grace_cli.build_parsers()),
    ("ckpt-check.md", (ckpt_check._parser(),)),
])
def test_each_cli_page_lists_every_option(page: str, parsers: tuple[object, ...]) -> None:
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    options = set().union(*(option_strings(p) for p in parsers)) - {"--help"}
    assert sorted(o for o in options if f"`{o}" not in text) == []
