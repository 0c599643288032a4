"""``grace-calc --help`` and ``grace-calc check --help``: the option list a user reads, exit 0, no traceback."""

from __future__ import annotations

import pytest
from grace_helpers import grace_calc


@pytest.mark.parametrize("argv", [("--help",), ("check", "--help")])
def test_help_lists_every_option_and_exits_0(argv: tuple[str, ...]) -> None:
    proc = grace_calc(*argv)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "--margin" in proc.stdout and "--from" in proc.stdout and "--no-slurm" in proc.stdout
    assert "20%, at least 10 s" in proc.stdout  # the margin's default, one percent sign as printed
