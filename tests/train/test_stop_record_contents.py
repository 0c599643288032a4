"""The stop record's contents (train/stop_record.py): a round trip and its CLI, absolute paths.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slurm_jit.train import stop_record


def test_stop_record_round_trip_and_cli(tmp_path: Path) -> None:
    def cli() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "slurm_jit.train.stop_record", str(tmp_path)],
                              capture_output=True, text=True, check=False)

    assert cli().returncode == stop_record.EXIT_NO_RECORD
    for state, code in (("running", 1), ("jit_stop", 10), ("finished", 0), ("failed", 1)):
        stop_record.write(tmp_path, state, step=7, checkpoint="c")
        assert stop_record.read(tmp_path)["state"] == state  # type: ignore[index]
        result = cli()
        assert result.returncode == code and result.stdout.startswith(state)
    stop_record.path(tmp_path).write_text("{garbage")
    assert stop_record.read(tmp_path) is None and cli().returncode == stop_record.EXIT_NO_RECORD
    with pytest.raises(ValueError):
        stop_record.write(tmp_path, "exploded")


def test_stop_record_paths_are_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With a relative output_dir, stop.json named the checkpoint relative to the training's working directory.
    monkeypatch.chdir(tmp_path)
    stop_record.write("out", "jit_stop", step=6, checkpoint="out/checkpoint-6", resumed_from="out/checkpoint-4")
    record = stop_record.read(tmp_path / "out")
    assert record is not None
    assert record["checkpoint"] == str(tmp_path / "out" / "checkpoint-6")
    assert record["resumed_from"] == str(tmp_path / "out" / "checkpoint-4")
