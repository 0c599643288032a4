"""The install section (README's and docs/install.md) says what works as written: the torch pin is the one
tools/setup-env installs, `DS_BUILD_OPS=0` comes with the package install, the ops it prebuilds are the ones
setup-env builds, and every `python -m slurm_jit.local_ranks` line it shows is a command line the real parser
takes (tests/launch/test_local_ranks_command.py runs the command itself)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from slurm_jit import local_ranks

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "install.md"]


def _pin() -> str:
    match = re.search(r'^TORCH_PIN="(torch==[\d.]+)"', (ROOT / "tools" / "setup-env").read_text(), re.MULTILINE)
    assert match, "tools/setup-env names no TORCH_PIN"
    return match.group(1)


def test_the_install_lines_pin_torch_first_and_build_no_ops() -> None:
    for page in PAGES:
        text = page.read_text()
        torch_at = text.index(f"pip install {_pin()}")
        package_at = text.index("DS_BUILD_OPS=0 pip install -e .")
        assert torch_at < package_at, f"{page.name}: torch must be installed before the package"


def test_the_prebuilt_ops_are_the_ones_setup_env_builds() -> None:
    builders = re.findall(r"\w+Builder", (ROOT / "tools" / "setup-env").read_text())
    assert builders and set(builders) <= set(re.findall(r"\w+Builder", (ROOT / "docs" / "install.md").read_text()))


def test_every_local_ranks_line_shown_is_one_the_command_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the pages' paths are the clone's
    lines = [line.split("#")[0] for page in PAGES for line in page.read_text().splitlines()
             if line.startswith("python -m slurm_jit.local_ranks ")]
    assert len(lines) >= 2, lines
    for line in lines:
        argv = shlex.split(line)[3:]
        nranks, _, command = local_ranks.parse_cli(argv)  # raises UsageError (one line) if it would not run
        assert nranks == 2 and (ROOT / command[0]).is_file(), line
