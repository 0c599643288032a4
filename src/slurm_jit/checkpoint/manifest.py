"""The manifest ``slurm-jit-manifest.json``: its fields, reading it (bounded, regular file only) and verifying the
files it lists against the directory. What the verdict is, given a verified manifest, is :mod:`protocol`'s."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import xxhash

from slurm_jit.checkpoint import formats, structure

MANIFEST_NAME = "slurm-jit-manifest.json"
MANIFEST_FORMAT = "slurm-jit-checkpoint"
FORMAT_VERSION = 2  # 2 added "contents" and "run_id"; version 1 manifests are read as contents "full"
READABLE_VERSIONS = (1, 2)
# ~130 bytes per file: 500 000 files, ~150 000 ranks of ZeRO shards, beyond any run published. It bounds the parse
# too: a hostile manifest of tiny JSON objects costs ~25x its size in memory (measured: 256 MiB took 6.6 GB).
MANIFEST_MAX_BYTES = 64 * 1024 * 1024
CONTENTS_FULL = "full"  # everything an exact resume needs
CONTENTS_MODEL_ONLY = "model_only"  # a save_only_model save: weights for inference, never resumed
CONTENTS = (CONTENTS_FULL, CONTENTS_MODEL_ONLY)
# "weights": where the trainable module weights of a DeepSpeed checkpoint are. An absent field (manifests written
# before it) means WEIGHTS_FULL, except under ZeRO-3, whose model-states files never hold them.
WEIGHTS_FULL = "full"  # DeepSpeed's model-states file holds the module weights (beside the fp32 master copy)
WEIGHTS_MASTER_ONLY = "fp32-master-only"  # only the optimizer shards' fp32 master partitions hold them
# A PEFT model's save (upstream's exclude_frozen_parameters): the model-states file holds the trainable weights (the
# adapters) and no frozen ones; those are the model as built (the base the user's script loads), as upstream resumes
WEIGHTS_FROZEN_EXCLUDED = "frozen-excluded"
# A PEFT model's JIT save under ZeRO-1/2 (train/slim_save.py): the frozen base left out as above, and the trainable
# weights only in the optimizer shards' fp32 master partitions; each of their module keys holds a zero-element
# placeholder (shape [0]), so that a plain Trainer's non-strict load fails on the size mismatch instead of
# resuming the adapters as built. Only JitTrainer resumes it.
WEIGHTS_FROZEN_EXCLUDED_MASTER_ONLY = "frozen-excluded-master-only"
# "frozen_fingerprint" (optional; absent in manifests written before it, which resume unchecked): a checkpoint
# whose weights leave the frozen base out (FROZEN_LEFT_OUT) records what those tensors were (train/frozen_weights.py):
# {"algorithm": "xxh3_128", "digest": hex, "count": n, "tensors": {name: "dtype[shape]:xxh3_64 hex"}}, an entry
# ending in "+quant:xxh3_64 hex" for a quantised tensor's state
FROZEN_FINGERPRINT = "frozen_fingerprint"
WEIGHTS_LAYOUTS = (WEIGHTS_FULL, WEIGHTS_MASTER_ONLY, WEIGHTS_FROZEN_EXCLUDED, WEIGHTS_FROZEN_EXCLUDED_MASTER_ONLY)
FROZEN_LEFT_OUT = (WEIGHTS_FROZEN_EXCLUDED, WEIGHTS_FROZEN_EXCLUDED_MASTER_ONLY)  # the frozen base is the model built
MASTER_ONLY = (WEIGHTS_MASTER_ONLY, WEIGHTS_FROZEN_EXCLUDED_MASTER_ONLY)  # the trainable weights: the shards' only
ZERO3 = 3  # ZeRO stage 3: partitioned parameters, model-states files with placeholders for the weights
HASH_NAME = "xxh3_128"
HASH_CHUNK_BYTES = 8 * 1024 * 1024
# Files a deep check reads and hashes at once: one stream reaches neither a parallel file system's nor an NVMe
# drive's read limit, and read() and xxhash both release the GIL (2 threads hash 2x as fast on 2 cores here).
DEEP_READERS = 8
MAX_EPOCH_S = 2**33  # year 2242: a manifest's "created" beyond it is not a time (clocks differ, not by centuries)
TRAINER_STATE_NAME = "trainer_state.json"
# "save_seq": one more than the highest of every manifest in the output directory when it was written, so that
# the order of writes holds whatever the clocks say (a node ahead or behind, a clock stepped back).
SAVE_SEQ_MAX = 2**62  # a save per microsecond for 100 000 years stays below; above it is no sequence number


class HashCancelled(Exception):
    """hash_file stopped reading: its ``cancelled()`` turned true."""


def hash_file(path: str | os.PathLike[str], progress: Callable[[int], None] | None = None,
              cancelled: Callable[[], bool] | None = None) -> str:
    """xxh3-128 hex digest of a regular file, read in chunks (a FIFO, device or symlink: UntrustedFile);
    HashCancelled when ``cancelled()`` turns true between two chunks."""
    digest = xxhash.xxh3_128()
    chunk = _chunk_buffer()
    with formats.open_regular(path) as handle:
        while n := handle.readinto(chunk):
            if cancelled is not None and cancelled():
                raise HashCancelled(str(path))
            digest.update(chunk[:n])
            if progress is not None:
                progress(n)
    return digest.hexdigest()


_buffers = threading.local()


def _chunk_buffer() -> memoryview:
    """This thread's read buffer, reused from file to file: a fresh 8 MiB bytes object per read costs its page
    faults each time (measured: readinto a reused buffer hashes a 160 MB file from tmpfs 1.3x as fast)."""
    buffer: memoryview | None = getattr(_buffers, "chunk", None)
    if buffer is None or len(buffer) != HASH_CHUNK_BYTES:  # the chunk size is the module's, read at each call
        buffer = _buffers.chunk = memoryview(bytearray(HASH_CHUNK_BYTES))
    return buffer


def plain_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _safe_member(ckpt_dir: Path, rel: object) -> Path | None:
    """The path of a manifest entry, or None when it could escape the checkpoint directory or is no file name."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return None
    try:
        os.fsencode(rel)  # a lone surrogate outside surrogateescape's range names no file
    except UnicodeError:
        return None
    parts = Path(rel).parts
    if Path(rel).is_absolute() or any(p in ("..", ".", "") for p in parts):
        return None
    return ckpt_dir / rel


def read(ckpt_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) or (None, why it cannot be used). Reads at most MANIFEST_MAX_BYTES of a regular file."""
    try:
        manifest = formats.load_json(ckpt_dir / MANIFEST_NAME, MANIFEST_MAX_BYTES)
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"manifest unreadable: {type(exc).__name__}: {exc}"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None, "manifest is not a slurm-jit manifest"
    if manifest.get("version") not in READABLE_VERSIONS or not plain_int(manifest.get("version")):
        return None, f"manifest version {manifest.get('version')!r} not supported (want one of {READABLE_VERSIONS})"
    if not isinstance(manifest.get("files"), dict) or not plain_int(manifest.get("step")):
        return None, "manifest lacks files or step"
    if TRAINER_STATE_NAME not in manifest["files"]:
        return None, f"manifest does not list {TRAINER_STATE_NAME}"
    if manifest.get("contents", CONTENTS_FULL) not in CONTENTS:
        return None, f"manifest contents {manifest.get('contents')!r} unknown (want one of {CONTENTS})"
    if manifest.get("weights", WEIGHTS_FULL) not in WEIGHTS_LAYOUTS:
        return None, f"manifest weights {manifest.get('weights')!r} unknown (want one of {WEIGHTS_LAYOUTS})"
    if FROZEN_FINGERPRINT in manifest and frozen_tensors(manifest) is None:
        return None, (f"manifest {FROZEN_FINGERPRINT} malformed (want an object whose 'tensors' maps each frozen "
                      "tensor's name to its entry)")
    return manifest, None


def frozen_tensors(manifest: dict[str, Any]) -> dict[str, str] | None:
    """The recorded ``frozen_fingerprint``'s tensors (name -> entry), or None where absent or malformed."""
    recorded = manifest.get(FROZEN_FINGERPRINT)
    tensors = recorded.get("tensors") if isinstance(recorded, dict) else None
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in tensors.items()):
        return None
    return tensors


def weights_layout(manifest: dict[str, Any]) -> str:
    """The checkpoint's weights layout (WEIGHTS_LAYOUTS) from a manifest :func:`read` accepted."""
    recorded = manifest.get("weights")
    if isinstance(recorded, str):
        return recorded
    return WEIGHTS_MASTER_ONLY if manifest.get("zero_stage") == ZERO3 else WEIGHTS_FULL


def verify(
    ckpt_dir: Path, step: int, manifest: dict[str, Any], deep: bool, progress: Callable[[int], None] | None
) -> str | None:
    if manifest["step"] != step:
        return f"manifest step {manifest['step']} != directory step {step}"
    tag = manifest.get("deepspeed_tag")
    if tag is not None and tag != f"{structure.DS_TAG_PREFIX}{step}":
        return f"manifest DeepSpeed tag {tag!r} is not {structure.DS_TAG_PREFIX}{step} of this checkpoint"
    world = manifest.get("world_size")
    if world is not None and not (plain_int(world) and 1 <= world <= structure.MAX_WORLD_SIZE):
        return f"manifest world_size {world!r} is not between 1 and {structure.MAX_WORLD_SIZE}"
    real_root = os.path.realpath(ckpt_dir)
    entries = sorted(manifest["files"].items())
    for rel, entry in entries:  # every file's size first: no byte is hashed in a checkpoint cut short
        why = _verify_entry(ckpt_dir, real_root, rel, entry)
        if why:
            return why
    return _verify_hashes(ckpt_dir, entries, progress) if deep else None


def _verify_hashes(ckpt_dir: Path, entries: list[tuple[str, Any]],
                   progress: Callable[[int], None] | None) -> str | None:
    """The first file in name order whose checksum is not the manifest's, read DEEP_READERS at a time. A reader
    stops once a file before its own is known bad (it can no longer be the first), and all stop on an interrupt."""
    lock = threading.Lock()
    first_bad = [len(entries)]  # the index of the first mismatch found so far
    interrupted = threading.Event()

    def counted(nbytes: int) -> None:
        if progress is not None:
            with lock:
                progress(nbytes)

    def check(index: int) -> None:
        rel, entry = entries[index]

        def cancelled() -> bool:
            return interrupted.is_set() or first_bad[0] < index

        try:
            if cancelled():
                return
            digest = hash_file(ckpt_dir / rel, counted, cancelled)
        except HashCancelled:
            return
        if digest != entry.get(HASH_NAME):
            with lock:
                first_bad[0] = min(first_bad[0], index)

    pool = ThreadPoolExecutor(max_workers=DEEP_READERS, thread_name_prefix="ckpt-deep")
    try:
        futures = [pool.submit(check, i) for i in range(len(entries))]
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:  # a reader's OSError (the file went away meanwhile) comes out here, as before
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
    except BaseException:
        interrupted.set()  # Ctrl-C or an error: the other readers stop at their next chunk
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return f"{entries[first_bad[0]][0]} checksum mismatch" if first_bad[0] < len(entries) else None


def _verify_entry(ckpt_dir: Path, real_root: str, rel: str, entry: object) -> str | None:
    path = _safe_member(ckpt_dir, rel)
    if path is None:
        return f"manifest path {rel!r} escapes the checkpoint"
    if not isinstance(entry, dict) or not plain_int(entry.get("size")):
        return f"manifest entry for {rel} is malformed"
    try:
        st = os.lstat(path)
    except OSError:
        return f"{rel} is missing"
    if not stat.S_ISREG(st.st_mode):
        return f"{rel} is {formats.file_kind(st.st_mode)}, not a regular file"
    if os.path.realpath(path) != os.path.join(real_root, *Path(rel).parts):
        return f"{rel} is reached through a symlink: not trusted"
    if st.st_size != entry["size"]:
        return f"{rel} has {st.st_size} bytes, manifest says {entry['size']}"
    return None


def created(manifest: dict[str, Any]) -> float | None:
    """The manifest's ``created`` time when it is a plausible epoch time, else None."""
    created = manifest.get("created")
    if isinstance(created, bool) or not isinstance(created, int | float) or not 0 < created < MAX_EPOCH_S:
        return None
    return float(created)




def save_seq(manifest: dict[str, Any]) -> int | None:
    """The manifest's ``save_seq`` when it is a plausible sequence number, else None (older manifests)."""
    seq = manifest.get("save_seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 < seq <= SAVE_SEQ_MAX:
        return None
    return seq
