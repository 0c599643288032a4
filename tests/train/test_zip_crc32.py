"""torch.save's per-record CRC-32 is off in JitTrainer's saves (JitConfig.zip_crc32, train/zip_crc.py): the
files still load with torch.load, the manifest's xxh3-128 is what guards them, and torch's setting is restored.
Real files: a JitTrainer ZeRO-2 run's checkpoint against a plain Trainer's (the session fixtures)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from torch.utils.serialization import config as torch_serialization

from slurm_jit.checkpoint import formats
from slurm_jit.train.jit_config import JitConfig
from slurm_jit.train.zip_crc import zip_crc32


def _torch_zips(ckpt: Path) -> list[Path]:
    return [p for p in sorted(ckpt.rglob("*")) if p.is_file() and p.suffix in (".pt", ".pth", ".bin")
            and formats.check_torch_zip(p) is None]


def _crcs(path: Path) -> list[int]:
    with zipfile.ZipFile(path) as archive:
        return [member.CRC for member in archive.infolist()]


def test_the_default_is_off() -> None:
    assert JitConfig().zip_crc32 is False


def test_off_writes_no_crc_and_torch_load_reads_it(tmp_path: Path) -> None:
    tensor = torch.arange(1000, dtype=torch.float32)
    with zip_crc32(False):
        torch.save({"t": tensor}, tmp_path / "off.pt")
    assert set(_crcs(tmp_path / "off.pt")) == {0}
    with zipfile.ZipFile(tmp_path / "off.pt") as archive:
        assert archive.testzip() is not None  # zipfile sees the CRC that is not there: why the manifest hashes
    assert torch.equal(torch.load(tmp_path / "off.pt")["t"], tensor)


@pytest.mark.parametrize("before", [True, False])
def test_on_writes_torch_crcs_and_the_setting_comes_back(tmp_path: Path, before: bool) -> None:
    saved = torch_serialization.save.compute_crc32
    torch_serialization.save.compute_crc32 = before
    try:
        with zip_crc32(True):
            torch.save({"t": torch.ones(10)}, tmp_path / "on.pt")
        assert torch_serialization.save.compute_crc32 is before
        with pytest.raises(OSError), zip_crc32(not before):
            raise OSError("disk full")
        assert torch_serialization.save.compute_crc32 is before  # restored on an error too
    finally:
        torch_serialization.save.compute_crc32 = saved
    with zipfile.ZipFile(tmp_path / "on.pt") as archive:
        assert archive.testzip() is None


def test_a_jit_trainer_checkpoint_has_no_crcs_and_loads(jit_zero2_run: Path) -> None:
    ckpt = jit_zero2_run / "checkpoint-6"
    zips = _torch_zips(ckpt)
    assert any("optim_states" in p.name for p in zips), [p.name for p in zips]  # DeepSpeed's files among them
    for path in zips:
        assert set(_crcs(path)) == {0}, path
        torch.load(path, map_location="cpu", weights_only=False)  # every file still loads


def test_control_a_plain_trainer_checkpoint_has_torch_crcs(plain_zero2_run: Path) -> None:
    zips = _torch_zips(plain_zero2_run / "checkpoint-6")
    assert zips
    for path in zips:
        assert any(_crcs(path)), path
