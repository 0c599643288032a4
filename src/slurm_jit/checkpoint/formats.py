"""Header-only structure checks of checkpoint files.

Checkpoint files are untrusted input: nothing here unpickles or loads a tensor. A ``.pt``/``.pth``/``.bin`` file
written by ``torch.save`` is a zip archive; we read its central directory (the end of the file) and check that
every member lies inside the file. A ``.safetensors`` file starts with an 8-byte little-endian header length and
a JSON header whose largest data offset must end exactly at the end of the file.

Every file is opened through :func:`open_regular`: a symlink, FIFO, socket or device is reported, never opened
(opening a FIFO blocks, reading /dev/zero never ends), and every read is bounded by a named cap.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zipfile
from typing import BinaryIO

TORCH_ZIP_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"
SAFETENSORS_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors spec caps the header at 100 MB
JSON_SUFFIX = ".json"
JSON_MAX_BYTES = 64 * 1024 * 1024  # trainer_state.json of a very long run stays far below this
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # never block, never follow


class UntrustedFile(ValueError):
    """A path in a checkpoint that must not be read: not a regular file, or over a size cap."""


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file reached without a final symlink.

    ``lstat`` first, so that a device or FIFO is never opened (an open can block or have side effects); then
    ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat`` of what was opened, so that a swap in between is caught too.
    """
    before = os.lstat(path)
    if not stat.S_ISREG(before.st_mode):
        raise UntrustedFile(f"{file_kind(before.st_mode)}, not a regular file: not read")
    fd = os.open(path, OPEN_FLAGS)
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino):
            raise UntrustedFile("replaced while being opened: not read")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The whole content of a regular file of at most ``max_bytes`` (else :class:`UntrustedFile`)."""
    with open_regular(path) as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UntrustedFile(f"over {max_bytes} bytes: too large to read")
    return data


def load_json(path: str | os.PathLike[str], max_bytes: int = JSON_MAX_BYTES) -> object:
    """A JSON document from a regular file of at most ``max_bytes``; ValueError (or RecursionError) when not."""
    return json.loads(read_bounded(path, max_bytes))


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
    """None when the file is a JSON document of sane size."""
    size = os.lstat(path).st_size
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
