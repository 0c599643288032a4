"""Header-only structure checks of checkpoint files.

Checkpoint files are untrusted input: nothing here unpickles or loads a tensor. A ``.pt``/``.pth``/``.bin`` file
written by ``torch.save`` is a zip archive; we read its central directory (the end of the file) and check that
every member lies inside the file. A ``.safetensors`` file starts with an 8-byte little-endian header length and
a JSON header whose largest data offset must end exactly at the end of the file.

Every file is opened through :func:`open_regular` (:mod:`slurm_jit.safe_read`'s): a symlink, FIFO, socket or
device is reported, never opened (opening a FIFO blocks, reading /dev/zero never ends), and every read is bounded
by a named cap.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import stat
import struct
import zipfile
from collections.abc import Callable, Iterator
from typing import BinaryIO

# The safe reading itself is the package's one reader (below every folder), named here as before
from slurm_jit.safe_read import (  # noqa: F401
    JSON_MAX_BYTES,
    OPEN_FLAGS,
    UntrustedFile,
    file_kind,
    load_json,
    open_regular,
    read_bounded,
)

TORCH_ZIP_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"
SAFETENSORS_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors spec caps the header at 100 MB
JSON_SUFFIX = ".json"
# trainer_state.json grows by ~135 bytes per logged step (Trainer writes it with indent=2): logging every step for
# 500 000 steps passes JSON_MAX_BYTES. Above that it is scanned, never built in memory, up to this cap (8 million
# logged steps; upstream's own load of such a file at resume costs ~2.6 GB per rank).
TRAINER_STATE_NAME = "trainer_state.json"
TRAINER_STATE_MAX_BYTES = 1024 * 1024 * 1024
# A JSON string or a structural character: what the scanner steps through (C speed, nothing built).
_JSON_TOKEN_RE = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:]')
_SCALAR_MAX_BYTES = 8192  # a number of up to 4300 digits (CPython's int() limit) fits


def walk(top: str | os.PathLike[str], onerror: Callable[[OSError], None] | None = None,
         ) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(top)`` (top-down, symlinked directories listed, not followed) without recursion: Python 3.11's
    os.walk recurses once per level, so a tree deeper than ~1000 levels raised RecursionError."""
    stack = [os.fspath(top)]
    while stack:
        root = stack.pop()
        dirs: list[str] = []
        files: list[str] = []
        descend: list[str] = []
        try:
            with os.scandir(root) as entries:
                for entry in entries:
                    is_dir = _is_dir(entry)
                    (dirs if is_dir else files).append(entry.name)
                    if is_dir and not entry.is_symlink():
                        descend.append(os.path.join(root, entry.name))
        except OSError as exc:
            if onerror is not None:
                onerror(exc)
            continue
        yield root, dirs, files
        stack.extend(reversed(descend))


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()  # as os.walk: a symlink to a directory is listed among dirs (and not followed)
    except OSError:
        return False


def top_level_value(path: str | os.PathLike[str], key: str, max_bytes: int) -> object:
    """The value of ``key`` in the top-level JSON object of a regular file of at most ``max_bytes``, found by
    scanning the bytes in place (memory-mapped; nothing but the value is built). The last occurrence wins, as with
    ``json.loads``; None when absent. ValueError when the brackets do not balance into one object."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > max_bytes:
            raise UntrustedFile(f"over {max_bytes} bytes: too large to read")
        if size == 0:
            raise ValueError("empty file")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            value_at = _scan_object(data, key.encode())
            if value_at is None:
                return None
            text = bytes(data[value_at:value_at + _SCALAR_MAX_BYTES]).decode("utf-8", "replace").lstrip()
    return json.JSONDecoder().raw_decode(text)[0]


def _scan_object(data: mmap.mmap, key: bytes) -> int | None:
    """Where the value of the last top-level ``key`` starts, after checking that the document is one object."""
    depth = 0
    previous = b""
    value_at = None
    quoted = b'"' + key + b'"'
    for match in _JSON_TOKEN_RE.finditer(data):  # type: ignore[call-overload]  # mmap is a bytes-like buffer
        token = match.group()
        if token in (b"{", b"["):
            if depth == 0 and (token != b"{" or data[:match.start()].strip()):
                raise ValueError("not one JSON object")
            depth += 1
        elif token in (b"}", b"]"):
            depth -= 1
            if depth < 0:
                raise ValueError("unbalanced brackets")
            if depth == 0 and data[match.end():].strip():
                raise ValueError("data after the top-level object")
        elif token == b":" and depth == 1 and previous == quoted:
            value_at = match.end()
        previous = token
    if depth != 0:
        raise ValueError("unbalanced brackets (truncated?)")
    return value_at


def check_torch_zip(path: str | os.PathLike[str]) -> str | None:
    """None when ``path`` looks like a whole ``torch.save`` zip archive, else why not."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return "empty file"
        return _check_zip_members(handle, size)


def _check_zip_members(handle: BinaryIO, size: int) -> str | None:
    try:
        with zipfile.ZipFile(handle) as archive:
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
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size < 8:
            return f"{size} bytes: too short for a safetensors header"
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
    """None when the file is a JSON document of sane size (a big trainer_state.json: one balanced object)."""
    size = os.lstat(path).st_size
    if size > JSON_MAX_BYTES and os.path.basename(path) == TRAINER_STATE_NAME:
        try:
            top_level_value(path, "global_step", TRAINER_STATE_MAX_BYTES)
        except UntrustedFile as exc:
            return str(exc)
        except ValueError as exc:
            return f"not valid JSON: {exc}"
        return None
    if size > JSON_MAX_BYTES:
        return f"{size} bytes: too large for a JSON state file"
    try:
        load_json(path)
    except UntrustedFile as exc:
        return str(exc)
    except (ValueError, RecursionError) as exc:
        return f"not valid JSON: {type(exc).__name__}: {exc}"
    return None


def check_file(path: str | os.PathLike[str]) -> str | None:
    """Header check by file type; None when fine or when the type has no header to check.

    Anything but a regular file is a problem whatever its name: nothing else belongs in a checkpoint.
    """
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        return f"{file_kind(mode)}, not a regular file: not trusted"
    name = os.fspath(path)
    try:
        if name.endswith(TORCH_ZIP_SUFFIXES):
            return check_torch_zip(path)
        if name.endswith(SAFETENSORS_SUFFIX):
            return check_safetensors(path)
        if name.endswith(JSON_SUFFIX):
            return check_json(path)
    except UntrustedFile as exc:
        return str(exc)
    return None
