"""The stop record OUT_DIR/slurm-jit/stop.json: replaced whole, never written through what lies in its way."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_jit.train import stop_record


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_link_left_as_the_temporary_record_is_replaced_not_written_through(tmp_path: Path, link: str) -> None:
    # Before: open(stop.tmp, "w") followed the link and truncated what it named (a checkpoint's weights, the
    # output lock's record).
    out = tmp_path / "out"
    precious = tmp_path / "model.safetensors"
    precious.write_bytes(b"weights")
    tmp = stop_record.path(out).with_suffix(".tmp")
    tmp.parent.mkdir(parents=True)
    if link == "symbolic":
        tmp.symlink_to(precious)
    else:
        tmp.hardlink_to(precious)
    stop_record.write(out, "finished", step=3)
    assert precious.read_bytes() == b"weights"
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished" and record["step"] == 3
    assert not stop_record.path(out).is_symlink() and not tmp.exists()
