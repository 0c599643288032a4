"""Header-only checks of checkpoint files: files of a DeepSpeed run, crafted broken ones, no unpickling."""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

import pytest
from ckpt_factory import write_evil_pt

from slurm_jit.checkpoint import formats

CD_SIGNATURE = b"PK\x01\x02"  # a zip central directory file header
CD_EXTRACT_VERSION_OFFSET = 6  # its "version needed to extract" byte (zipfile.structCentralDir)
CD_COMPRESS_SIZE_OFFSET = 20  # its 4-byte compressed size
NESTING_DEPTH = 100_000  # deeper than CPython's recursion limit, so json's C scanner gives up


def write_torch_like_zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def safetensors_bytes(header: object, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def patch_first_central_directory(path: Path, offset: int, value: bytes) -> None:
    blob = bytearray(path.read_bytes())
    cd = blob.index(CD_SIGNATURE)
    blob[cd + offset: cd + offset + len(value)] = value
    path.write_bytes(bytes(blob))


def truncated_copy(src: Path, dst: Path, size: int) -> Path:
    dst.write_bytes(src.read_bytes()[:size])
    return dst


# ---------------------------------------------------------------- real files from a real run


@pytest.mark.deepspeed
def test_every_file_of_a_real_checkpoint_passes(jit_zero2_run: Path) -> None:
    ckpt = jit_zero2_run / "checkpoint-3"
    checked = {p.relative_to(ckpt).as_posix(): formats.check_file(p) for p in ckpt.rglob("*") if p.is_file()}
    assert {rel: why for rel, why in checked.items() if why is not None} == {}
    suffixes = {Path(rel).suffix for rel in checked}
    assert {".pt", ".pth", ".bin", ".safetensors", ".json"} <= suffixes  # each kind of header was checked
    assert formats.check_torch_zip(ckpt / "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt") is None
    assert formats.check_safetensors(ckpt / "model.safetensors") is None
    assert formats.check_json(ckpt / "trainer_state.json") is None


@pytest.mark.deepspeed
@pytest.mark.parametrize("rel", ["rng_state_0.pth", "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                 "training_args.bin"])
def test_truncated_torch_zip_is_rejected_at_every_cut(jit_zero2_run: Path, tmp_path: Path, rel: str) -> None:
    src = jit_zero2_run / "checkpoint-3" / rel
    size = src.stat().st_size
    dst = tmp_path / Path(rel).name
    assert truncated_copy(src, dst, 0) and formats.check_file(dst) == "empty file"
    for cut in (1, 4, 22, 64, size // 3, size // 2, size - 22, size - 1):
        why = formats.check_file(truncated_copy(src, dst, cut))
        assert why is not None and why.startswith("not a whole torch zip archive (truncated?)"), (cut, why)


@pytest.mark.deepspeed
def test_truncated_safetensors_is_rejected_at_every_cut(jit_zero2_run: Path, tmp_path: Path) -> None:
    src = jit_zero2_run / "checkpoint-3" / "model.safetensors"
    size = src.stat().st_size
    (header_len,) = struct.unpack("<Q", src.read_bytes()[:8])
    dst = tmp_path / "model.safetensors"
    for cut in (0, 1, 7):
        assert formats.check_file(truncated_copy(src, dst, cut)) == (
            f"{cut} bytes: too short for a safetensors header")
    for cut in (8, 9, 8 + header_len // 2, 8 + header_len - 1):
        assert formats.check_file(truncated_copy(src, dst, cut)) == (
            f"header length {header_len} does not fit in {cut} bytes (truncated?)")
    for cut in (8 + header_len, size // 2, size - 1):
        assert formats.check_file(truncated_copy(src, dst, cut)) == (
            f"tensors end at byte {size} but the file has {cut} (truncated?)")


# ---------------------------------------------------------------- crafted torch zips


def test_garbage_and_empty_torch_files(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(4096))
    why = formats.check_torch_zip(garbage)
    assert why is not None and why.startswith("not a whole torch zip archive (truncated?)")
    empty = tmp_path / "optimizer.bin"
    empty.touch()
    assert formats.check_file(empty) == "empty file"


def test_zip_without_data_pkl_is_not_a_torch_save(tmp_path: Path) -> None:
    path = write_torch_like_zip(tmp_path / "other.pt", {"archive/version": b"3\n"})
    assert formats.check_torch_zip(path) == "zip archive without data.pkl: not written by torch.save"


def test_zip_member_running_past_the_end_is_truncated(tmp_path: Path) -> None:
    path = write_torch_like_zip(tmp_path / "x.pt", {"archive/data.pkl": b"\x80\x02N." * 32})
    assert formats.check_torch_zip(path) is None
    patch_first_central_directory(path, CD_COMPRESS_SIZE_OFFSET, struct.pack("<I", 1_000_000))
    assert formats.check_torch_zip(path) == (
        "member archive/data.pkl runs past the end of the file (truncated)")


def test_damaged_zip_version_field_gives_a_reason_not_an_exception(tmp_path: Path) -> None:
    path = write_torch_like_zip(tmp_path / "x.pt", {"archive/data.pkl": b"\x80\x02N."})
    patch_first_central_directory(path, CD_EXTRACT_VERSION_OFFSET, bytes([64]))  # one flipped bit: 0 -> 64
    why = formats.check_torch_zip(path)
    assert why is not None and "zip" in why


# ---------------------------------------------------------------- crafted safetensors and json


def test_safetensors_header_length_larger_than_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    assert formats.check_safetensors(path) == "header length 1000 does not fit in 10 bytes (truncated?)"


def test_safetensors_header_length_over_the_spec_cap(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    too_long = formats.SAFETENSORS_MAX_HEADER_BYTES + 1
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", too_long))
        handle.truncate(too_long + 1024)  # sparse: the length fits in the file, only the cap rejects it
    assert formats.check_safetensors(path) == (
        f"header length {too_long} does not fit in {too_long + 1024} bytes (truncated?)")


def test_crafted_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    tensor = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"format": "pt"}}
    path.write_bytes(safetensors_bytes(tensor, b"\0" * 8))
    assert formats.check_safetensors(path) is None
    whole = path.stat().st_size
    path.write_bytes(safetensors_bytes(tensor, b"\0" * 9))
    assert formats.check_safetensors(path) == (
        f"tensors end at byte {whole} but the file has {whole + 1} (truncated?)")
    path.write_bytes(struct.pack("<Q", 4) + b"{oop")
    assert formats.check_safetensors(path) == "header is not JSON"
    path.write_bytes(safetensors_bytes([1, 2], b""))
    assert formats.check_safetensors(path) == "header is not a JSON object"
    path.write_bytes(safetensors_bytes({"w": {"data_offsets": [0, "8"]}}, b"\0" * 8))
    assert formats.check_safetensors(path) == "tensor 'w' has no valid data_offsets"
    path.write_bytes(os.urandom(64))
    assert formats.check_safetensors(path) is not None


def test_json_checks(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"a": 1}')
    assert formats.check_file(path) is None
    for content in (b"", b"{not json", b"\xff\xfe\x00garbage"):
        path.write_bytes(content)
        why = formats.check_file(path)
        assert why is not None and why.startswith("not valid JSON"), content
    with open(path, "wb") as handle:
        handle.truncate(formats.JSON_MAX_BYTES + 1)  # sparse
    assert formats.check_json(path) == f"{formats.JSON_MAX_BYTES + 1} bytes: too large for a JSON state file"


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_deeply_nested_json_gives_a_reason_not_an_exception(tmp_path: Path, name: str) -> None:
    nested = b"[" * NESTING_DEPTH + b"]" * NESTING_DEPTH
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(nested)) + nested if name.endswith(".safetensors") else nested)
    assert formats.check_file(path) is not None


def test_files_without_a_header_to_check(tmp_path: Path) -> None:
    for name in ("latest", "zero_to_fp32.py", "notes.txt"):
        (tmp_path / name).write_bytes(os.urandom(64))
        assert formats.check_file(tmp_path / name) is None


# ---------------------------------------------------------------- nothing is unpickled


def test_checks_never_unpickle(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    for name in ("evil.pt", "rng_state_0.pth", "pytorch_model.bin"):
        path = write_evil_pt(tmp_path / name, marker)
        assert formats.check_torch_zip(path) is None  # a well-formed zip with data.pkl: structurally fine
        assert formats.check_file(path) is None
    assert not marker.exists()
    # the payload is live: unpickling it, which the checks must never do, creates the marker
    with zipfile.ZipFile(tmp_path / "evil.pt") as archive:
        pickle.loads(archive.read("archive/data.pkl"))  # noqa: S301 - the point of the control
    assert marker.exists()
