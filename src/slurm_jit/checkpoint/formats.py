"""Header-only structure checks of checkpoint files.

Checkpoint files are untrusted input: nothing here unpickles or loads a tensor. A ``.pt``/``.pth``/``.bin`` file
written by ``torch.save`` is a zip archive; we read its central directory (the end of the file) and check that
every member lies inside the file. A ``.safetensors`` file starts with an 8-byte little-endian header length and
a JSON header whose largest data offset must end exactly at the end of the file.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile

TORCH_ZIP_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"
SAFETENSORS_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors spec caps the header at 100 MB
JSON_SUFFIX = ".json"
JSON_MAX_BYTES = 64 * 1024 * 1024  # trainer_state.json of a very long run stays far below this


def check_torch_zip(path: str | os.PathLike[str]) -> str | None:
    """None when ``path`` looks like a whole ``torch.save`` zip archive, else why not."""
    size = os.path.getsize(path)
    if size == 0:
        return "empty file"
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: any parse failure is a verdict, not a crash
        return f"not a whole torch zip archive (truncated?): {type(exc).__name__}: {exc}"
    if not any(m.filename.endswith("data.pkl") for m in members):
        return "zip archive without data.pkl: not written by torch.save"
    for member in members:
        if member.header_offset + member.compress_size > size:
            return f"member {member.filename} runs past the end of the file (truncated)"
    return None


def check_safetensors(path: str | os.PathLike[str]) -> str | None:
    """None when the safetensors header parses and its tensors end exactly at the end of the file."""
    size = os.path.getsize(path)
    if size < 8:
        return f"{size} bytes: too short for a safetensors header"
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > SAFETENSORS_MAX_HEADER_BYTES or 8 + header_len > size:
            return f"header length {header_len} does not fit in {size} bytes (truncated?)"
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return "header is not JSON"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"tensor {name!r} has no valid data_offsets"
        end = max(end, offsets[1])
    if 8 + header_len + end != size:
        return f"tensors end at byte {8 + header_len + end} but the file has {size} (truncated?)"
    return None


def check_json(path: str | os.PathLike[str]) -> str | None:
    """None when the file is a JSON document of sane size."""
    size = os.path.getsize(path)
    if size > JSON_MAX_BYTES:
        return f"{size} bytes: too large for a JSON state file"
    try:
        with open(path, encoding="utf-8") as handle:
            json.load(handle)
    except (ValueError, RecursionError) as exc:
        return f"not valid JSON: {type(exc).__name__}: {exc}"
    return None


def check_file(path: str | os.PathLike[str]) -> str | None:
    """Header check by file type; None when fine or when the type has no header to check."""
    name = os.fspath(path)
    if name.endswith(TORCH_ZIP_SUFFIXES):
        return check_torch_zip(path)
    if name.endswith(SAFETENSORS_SUFFIX):
        return check_safetensors(path)
    if name.endswith(JSON_SUFFIX):
        return check_json(path)
    return None
