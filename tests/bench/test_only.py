"""`tools/bench --only`: groups of rows alone (comma-separated), a bad value refused in one line with a HINT
before anything runs, and every row not run reported skipped with the command that skipped it."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_jit.bench import cli, floor_rows
from slurm_jit.bench.rows import measured


def test_groups_are_comma_separated_and_said_in_one_order() -> None:
    assert cli.parse_only("save,resume") == {"save", "resume"}
    assert cli.parse_only(" resume , save ") == {"save", "resume"}
    assert cli.parse_only("async") == {"async"}
    assert cli.only_text(frozenset({"async", "resume", "save"})) == "save,resume,async"


@pytest.mark.parametrize("value", ["bogus", "save,bogus", "save,", "", "Save"])
def test_a_bad_only_is_one_line_with_a_hint(value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--only", value, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tools/bench: error: "), err
    assert "HINT: name groups of save, resume, async, comma-separated, e.g. --only save,resume" in err
    assert not (tmp_path / "out").exists(), "refused before anything ran"


def test_another_usage_error_is_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--quick", "--full"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "HINT: see tools/bench --help" in err, err


def test_rows_an_only_run_did_not_run_are_skipped_by_name() -> None:
    ran = measured(floor_rows.ZERO2_SAVE_ROW, 1.1, "ratio", "<= 1.25", "save over floor")
    rows = cli._complete([ran], cli.DEFAULT, frozenset({"resume", "save"}))
    assert [r.name for r in rows] == list(cli.ROW_NAMES)
    by_name = {r.name: r for r in rows}
    assert by_name[floor_rows.ZERO2_SAVE_ROW] is ran
    assert by_name[floor_rows.RESUME_ROW].note == "skipped: not run by `tools/bench --only save,resume` (see --help)"
    for name in (floor_rows.ZERO3_SAVE_ROW, floor_rows.DISK_SAVE_ROW, floor_rows.DEEP_ROW, floor_rows.RESUME_ROW):
        assert name in cli.ROW_NAMES
