"""A deep check (``ckpt-check --deep``, checkpoint/manifest.py) hashes DEEP_READERS files at once and still names the
first bad file in name order; readers stop once a file before theirs is known bad, and on an interrupt. Real files."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from slurm_jit.checkpoint import manifest
from slurm_jit.checkpoint.writing import file_entries

CHUNK = 1024  # HASH_CHUNK_BYTES in these tests: many chunks from small files


def _checkpoint(root: Path, sizes: dict[str, int]) -> dict:
    ckpt = root / "checkpoint-5"
    ckpt.mkdir()
    for rel, size in sizes.items():
        (ckpt / rel).write_bytes(os.urandom(size))
    return {"step": 5, "files": file_entries(ckpt, sorted(sizes))}


def _flip(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest, "HASH_CHUNK_BYTES", CHUNK)


def test_a_whole_checkpoint_passes_and_every_byte_is_read(tmp_path: Path) -> None:
    sizes = {f"f{i:02d}.bin": 10 * CHUNK + i for i in range(20)}
    man = _checkpoint(tmp_path, sizes)
    read: list[int] = []
    assert manifest.verify(tmp_path / "checkpoint-5", 5, man, True, read.append) is None
    assert sum(read) == sum(sizes.values())


def test_the_first_bad_file_in_name_order_is_named_whichever_reader_finishes_first(tmp_path: Path) -> None:
    # "a.bin" is large (read last to finish), "z.bin" tiny: both bad, the name is a's
    man = _checkpoint(tmp_path, {"a.bin": 400 * CHUNK, **{f"m{i}.bin": CHUNK for i in range(10)}, "z.bin": 10})
    ckpt = tmp_path / "checkpoint-5"
    _flip(ckpt / "a.bin", offset=399 * CHUNK)
    _flip(ckpt / "z.bin")
    assert manifest.verify(ckpt, 5, man, True, None) == "a.bin checksum mismatch"
    assert manifest.verify(ckpt, 5, man, False, None) is None  # quick: sizes only


def test_a_size_mismatch_is_found_before_any_byte_is_hashed(tmp_path: Path) -> None:
    man = _checkpoint(tmp_path, {"a.bin": 50 * CHUNK, "b.bin": 50 * CHUNK})
    ckpt = tmp_path / "checkpoint-5"
    with open(ckpt / "b.bin", "ab") as handle:
        handle.write(b"x")
    read: list[int] = []
    assert manifest.verify(ckpt, 5, man, True, read.append) == f"b.bin has {50 * CHUNK + 1} bytes, manifest says " \
                                                                 f"{50 * CHUNK}"
    assert read == []


def _slow_progress(read: list[int], delay_s: float = 0.005):
    lock = threading.Lock()

    def progress(nbytes: int) -> None:
        with lock:
            read.append(nbytes)
        time.sleep(delay_s)
    return progress


def test_readers_of_files_after_a_bad_one_stop(tmp_path: Path) -> None:
    big = 200 * CHUNK  # 200 chunks x 5 ms = 1 s to read whole
    man = _checkpoint(tmp_path, {"a.bin": 10, "b.bin": big})
    ckpt = tmp_path / "checkpoint-5"
    _flip(ckpt / "a.bin")
    read: list[int] = []
    assert manifest.verify(ckpt, 5, man, True, _slow_progress(read)) == "a.bin checksum mismatch"
    assert sum(read) < big // 2, sum(read)


CTRL_C_AFTER_CHUNKS = 20  # of the 800: the readers are inside their files when it comes, on a host of any speed


def test_a_ctrl_c_stops_every_reader(tmp_path: Path) -> None:
    sizes = {f"f{i}.bin": 200 * CHUNK for i in range(4)}  # 4 readers at 5 ms a chunk (one at a time): 4 s in all
    man = _checkpoint(tmp_path, sizes)
    read: list[int] = []
    slow = _slow_progress(read)

    def progress(nbytes: int) -> None:  # a reader sends it; the main thread, waiting on the readers, gets it
        slow(nbytes)
        if len(read) == CTRL_C_AFTER_CHUNKS:
            os.kill(os.getpid(), signal.SIGINT)

    # Python's own Ctrl-C handler, whatever this process inherited: Python leaves SIGINT ignored when it starts with
    # it ignored (a pytest started with `&` from a script), and the signal then did nothing.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            manifest.verify(tmp_path / "checkpoint-5", 5, man, True, progress)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sum(read) < sum(sizes.values()) // 2, sum(read)


def test_a_reader_error_stops_the_others_and_comes_out(tmp_path: Path) -> None:
    sizes = {f"f{i}.bin": 200 * CHUNK for i in range(4)}
    man = _checkpoint(tmp_path, sizes)
    read: list[int] = []
    slow = _slow_progress(read)

    def progress(nbytes: int) -> None:
        slow(nbytes)
        if len(read) == 10:
            raise OSError(5, "Input/output error")
    with pytest.raises(OSError, match="Input/output error"):
        manifest.verify(tmp_path / "checkpoint-5", 5, man, True, progress)
    assert sum(read) < sum(sizes.values()) // 2, sum(read)


def test_hash_file_stops_when_cancelled(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(os.urandom(10 * CHUNK))
    calls = []
    with pytest.raises(manifest.HashCancelled):
        manifest.hash_file(tmp_path / "f", calls.append, cancelled=lambda: len(calls) >= 3)
    assert len(calls) == 3
