"""Staging: a snapshot of the states one save writes, in host memory that is allocated once and reused.

:meth:`HostStager.stage` takes the states of one save (file key -> what ``torch.save`` would get: nested dicts,
lists, tuples, objects, tensors on any device) and returns a snapshot that training may no longer change: every
storage a ``torch.save`` of the state would write is copied into a buffer of this stager (pinned when CUDA is
available), and every other object is rebuilt. A caller may rely on:

- ``torch.save`` of a staged state writes the bytes ``torch.save`` of the original would have written at the
  instant of staging (checked byte for byte by the tests, CPU tensors): the snapshot is found and rebuilt by
  pickling the state with the pickle protocol, the persistent ids and the storage identity (``_cdata``) that
  ``torch.save`` uses, so views of one storage stay views of one staged storage (the whole storage is copied, as
  ``torch.save`` writes it), shared Python objects stay shared, an ``OrderedDict``'s ``_metadata`` stays, and the
  str and bytes objects are the originals' own (pickle writes a repeated one as a back-reference, so byte identity
  needs the same ones). A staged copy of a CUDA storage keeps its location tag (:mod:`.locations`). An object whose
  pickle depends on more than its value (a set: its order follows its insertion history, which the rebuilt set
  does not replay) may come back with the same items in another order: equal ``torch.load`` results, not equal
  bytes.
- Changing the originals after ``stage`` returns (training continues) changes nothing staged: the copies are done
  (CUDA: each source's device waited for, from the thread that made the copies) when ``stage`` returns.
- Buffers are per storage, keyed by (file key, the storage's order in that file's pickle): a storage of the same
  size next time reuses its buffer (same ``data_ptr``); one that changed size gets a new buffer. Before any new
  buffer is allocated, :mod:`.memory_guard` checks that host memory can hold it (a one-line
  :class:`~.memory_guard.HostMemoryError` with a HINT, nothing allocated, when it cannot).
- A storage that several files of one save hold (a module's weights in DeepSpeed's model-states file and in
  ``model.safetensors``) is staged once: one buffer, one copy, the staged files share it as the originals do.
- ``stage(states, defer=True)`` returns before the copies (the buffers are allocated, the snapshot's structure and
  every Python value are taken now): :meth:`StagedSave.copy_pending` does them later (the background writer, first
  thing in its thread, with the GIL released), :meth:`StagedSave.wait_copied` waits for them. The caller must not
  change the originals' tensors until then (the async periodic save holds DeepSpeed's next optimizer step); the
  storages named in ``copy_now`` (a module's buffers, which a forward may change) are copied before ``stage``
  returns. This is DCP's ``DefaultStager(use_async_staging=True)`` contract.
- One snapshot at a time: the buffers belong to the snapshot until :meth:`StagedSave.release` (the background
  writer calls it when its write is over); staging again before that is refused (:class:`StagingBusyError`).
"""

from __future__ import annotations

import collections
import io
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.serialization

from slurm_jit.train.async_save import locations, memory_guard

logger = logging.getLogger(__name__)

PARALLEL_MIN_BYTES = 32 * 2**20  # below this, one thread copies: a share would not pay for the hand-over
PIECE_BYTES = 4 * 2**20  # what one thread takes at a time: small enough that no thread waits long for another
MAX_COPY_THREADS = 4  # host memory bandwidth: more threads than this add little (measured 2x with 2 threads here)

_Source = torch.UntypedStorage | torch.Tensor  # what a buffer is copied from: a storage, or a placeholder's tensor
_Pid = tuple[int, "torch.dtype | None"]  # (the storage's order in the file, its TypedStorage dtype or None: untyped)


@dataclass(frozen=True)
class _Found:
    """One state pickled as torch.save pickles it, with its storages and str/bytes objects kept aside."""

    pickled: bytes
    storages: list[torch.UntypedStorage]
    atoms: list[str | bytes]


class StagingBusyError(RuntimeError):
    """The buffers still hold a snapshot being written; the message is one line with a HINT."""


class _StorageFinder(pickle.Pickler):
    """torch.save's pickling, recording each distinct storage (by torch.save's key, ``_cdata``) in order, and each
    str and bytes object: the rebuilt state holds the same (immutable) objects, so that which of them are one object
    (pickle's memo writes a second reference to one as a back-reference) stays as in the original, down to a dict key
    ``"cpu"`` that is the very string torch.save's location tag ``"cpu"`` is (the Trainer's RNG state file)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=torch.serialization.DEFAULT_PROTOCOL)  # torch.save's default
        self.storages: list[torch.UntypedStorage] = []
        self.atoms: list[str | bytes] = []
        self._keys: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> _Pid | int | None:
        if type(obj) is str or type(obj) is bytes:
            self.atoms.append(obj)
            return len(self.atoms) - 1
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype  # torch.save's own access (no deprecation warning)
        elif torch.is_storage(obj):
            untyped, dtype = obj, None
        else:
            return None
        key = self._keys.setdefault(untyped._cdata, len(self._keys))
        if key == len(self.storages):
            self.storages.append(untyped)
        return key, dtype


class _StagedRebuilder(pickle.Unpickler):
    """Rebuilds the pickled state around the staged storages (as torch.load rebuilds a file around its records)."""

    def __init__(self, file: io.BytesIO, staged: list[torch.UntypedStorage], atoms: list[str | bytes]) -> None:
        super().__init__(file)
        self._staged = staged
        self._atoms = atoms

    def persistent_load(self, pid: _Pid | int) -> Any:
        if isinstance(pid, int):
            return self._atoms[pid]
        key, dtype = pid
        if dtype is None:
            return self._staged[key]
        # torch.load's own call (_internal: no TypedStorage deprecation warning)
        return torch.storage.TypedStorage(wrap_storage=self._staged[key], dtype=dtype, _internal=True)


@dataclass
class StagedSave:
    """One save's snapshot: ``states[key]`` is what to ``torch.save`` for the file ``key`` (rebuilt around the
    buffers at the first look, in whichever thread looks first: the background writer's, out of training's time)."""

    rebuild: Callable[[], dict[str, Any]] = field(repr=False)
    nbytes: int  # bytes copied (the storages torch.save writes, each shared storage once)
    copy_s: float  # seconds the copies took (CUDA: until synchronized); a deferred copy: set by copy_pending
    stage_s: float  # seconds stage() took in all (the pickling included; the rebuild is the writer's)
    pending: list[tuple[torch.UntypedStorage, _Source]] = field(repr=False, default_factory=list)
    _copied: threading.Event = field(repr=False, default_factory=threading.Event)
    _released: threading.Event = field(repr=False, default_factory=threading.Event)
    _states: dict[str, Any] | None = field(repr=False, default=None)
    _rebuilding: threading.Lock = field(repr=False, default_factory=threading.Lock)

    @property
    def states(self) -> dict[str, Any]:
        with self._rebuilding:
            if self._states is None:
                self._states = self.rebuild()
            return self._states

    def copy_pending(self) -> None:
        """The copies ``stage(defer=True)`` left (any thread; the GIL is released while copying); the snapshot is
        taken once this returns, and :meth:`wait_copied` returns, whatever happened."""
        t0 = time.monotonic()
        try:
            _copy_pairs(self.pending)
            _await_device_copies(self.pending)
            self.copy_s = time.monotonic() - t0
        finally:
            self.pending = []
            self._copied.set()

    def wait_copied(self, timeout_s: float | None = None) -> bool:
        """True once the copies are done (at once for a snapshot not deferred); False at the timeout."""
        return self._copied.wait(timeout_s)

    @property
    def copied(self) -> bool:
        return self._copied.is_set()

    def release(self) -> None:
        """The buffers are free for the next snapshot (the write of this one is over, or it is dropped)."""
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()


class HostStager:
    """Stages the states of one save at a time into host buffers sized once and reused (module docstring)."""

    def __init__(self, *, pin: bool | None = None, sharing_ranks: int = 1, copy_threads: int = 1) -> None:
        """``pin``: page-locked buffers (default: when CUDA is available); ``sharing_ranks``: the ranks on this node
        that stage at the same time (the memory guard gives each its share of host memory); ``copy_threads``: threads
        for the host copies :meth:`stage` makes before it returns (the deferred ones take one)."""
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.sharing_ranks = sharing_ranks
        self._pool = ThreadPoolExecutor(copy_threads - 1, thread_name_prefix="slurm-jit-stage") \
            if copy_threads > 1 else None
        self._slots: dict[str, list[torch.UntypedStorage]] = {}
        self._current: StagedSave | None = None

    def _buffers(self) -> list[torch.UntypedStorage]:
        """Each buffer once (a storage shared by two files of a save has one buffer in both files' slots)."""
        return list({id(s): s for slots in self._slots.values() for s in slots}.values())

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold now (the storages' sizes)."""
        return sum(s.nbytes() for s in self._buffers())

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the buffers take now (pinned ones: rounded up, :meth:`footprint`)."""
        return sum(self.footprint(s.nbytes()) for s in self._buffers())

    def footprint(self, nbytes: int) -> int:
        """Host memory a buffer of ``nbytes`` takes: torch's pinned allocator rounds each allocation up to a power of
        two (ATen/core/CachingHostAllocator.h; pinned_max_round_threshold has no limit by default)."""
        return 1 << (nbytes - 1).bit_length() if self.pin and nbytes > 1 else nbytes

    def stage(self, states: Mapping[str, Any], *, defer: bool = False, copy_now: frozenset[int] = frozenset(),
              sources: Mapping[int, torch.Tensor] | None = None) -> StagedSave:
        """A snapshot of ``states`` (file key -> state) that later changes to the originals do not reach; with
        ``defer``, only once :meth:`StagedSave.copy_pending` has run (``copy_now``: the ``_cdata`` of storages
        copied before this returns all the same). ``sources``: a placeholder storage's ``_cdata`` -> the tensor
        whose values its buffer gets instead of the placeholder's (a clone made by the copy, not before it)."""
        sources = sources or {}
        if self._current is not None and not self._current.released:
            raise StagingBusyError(
                "slurm_jit: the staging buffers still hold the save being written in the background. HINT: wait for "
                "the background writer (BackgroundWriter.wait) before staging the next save")
        t0 = time.monotonic()
        found = {key: _find_storages(state) for key, state in states.items()}
        firsts = _first_holders(found)
        self._ensure_buffers({key: f.storages for key, f in found.items()}, firsts)
        pairs: list[tuple[torch.UntypedStorage, _Source]] = [
            (self._slots[key][i], sources.get(storage._cdata, storage)) for key, f in found.items()
            for i, storage in enumerate(f.storages) if firsts[storage._cdata] == (key, i)]
        now = [pair for pair in pairs if not defer or _storage_of(pair[1])._cdata in copy_now]
        later = [pair for pair in pairs if defer and _storage_of(pair[1])._cdata not in copy_now]
        t_copy = time.monotonic()
        _copy_pairs(now, self._pool)
        _await_device_copies(now)  # the non-blocking copies are done before training changes the originals
        copy_s = time.monotonic() - t_copy
        slots = {key: self._slots[key] for key in found}  # this snapshot's (the next stage makes new lists)
        # the pickled structures and their atoms only: the originals' storages are not held past the copies
        structures = {key: (f.pickled, f.atoms) for key, f in found.items()}
        del found

        def rebuild() -> dict[str, Any]:
            return {key: _StagedRebuilder(io.BytesIO(pickled), slots[key], atoms).load()
                    for key, (pickled, atoms) in structures.items()}

        nbytes = sum(slot.nbytes() for slot, _ in pairs)
        self._current = StagedSave(rebuild, nbytes, copy_s, time.monotonic() - t0, pending=later)
        if not later:
            self._current._copied.set()
        return self._current

    def _ensure_buffers(self, wanted: dict[str, list[torch.UntypedStorage]],
                        firsts: dict[int, tuple[str, int]]) -> None:
        """Per key, a buffer of each storage's size (and device tag), one per distinct storage (``firsts``: where each
        is first held); only missing or resized ones are allocated, after the memory guard says the new ones fit.
        An old buffer is reused by one storage at most: one that two files shared last time (one storage then) and
        that they hold apart now goes to the first, the second gets a new one."""
        keep: dict[str, list[torch.UntypedStorage | None]] = {}
        claimed: set[int] = set()  # id() of the old buffers reused so far
        new_bytes = 0
        for key, storages in wanted.items():
            old = self._slots.get(key, [])
            keep[key] = []
            for i, s in enumerate(storages):
                reused = old[i] if i < len(old) and old[i].nbytes() == s.nbytes() else None
                if firsts[s._cdata] != (key, i):
                    reused = None  # a later holder: its first holder's buffer, whatever this slot held
                elif reused is None or id(reused) in claimed:
                    reused = None
                    new_bytes += self.footprint(s.nbytes())
                else:
                    claimed.add(id(reused))
                keep[key].append(reused)
        if new_bytes:
            memory_guard.check_host_memory(new_bytes, sharing_ranks=self.sharing_ranks)
            logger.info("slurm_jit: async save staging: %d bytes of %s host memory allocated (%d held before)",
                        new_bytes, "pinned" if self.pin else "plain", self.host_bytes)
        for slot in self._buffers():  # what is not kept is freed (and untagged) before allocating
            if id(slot) not in claimed:
                locations.forget(slot)
        self._slots, self._current = {}, None  # the dropped buffers go now (unless a caller still holds a snapshot)
        slots: dict[str, list[torch.UntypedStorage]] = {}
        for key, storages in wanted.items():  # in order: a storage's first holder comes before its later ones
            slots[key] = []
            for i, s in enumerate(storages):
                first_key, first_i = firsts[s._cdata]
                if (first_key, first_i) != (key, i):
                    slots[key].append(slots[first_key][first_i])
                else:
                    reused = keep[key][i]
                    slots[key].append(reused if reused is not None else self._allocate(s.nbytes()))
        self._slots = slots
        for key, storages in wanted.items():
            for slot, original in zip(self._slots[key], storages, strict=True):
                location = torch.serialization.location_tag(original)
                if location == "cpu":
                    locations.forget(slot)
                else:
                    locations.remember(slot, location)

    def _allocate(self, nbytes: int) -> torch.UntypedStorage:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin).untyped_storage()

    def free(self) -> None:
        """Drop every buffer (the end of training, or a fall-back to synchronous saves)."""
        for slots in self._slots.values():
            for slot in slots:
                locations.forget(slot)
        self._slots = {}
        self._current = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _find_storages(state: Any) -> _Found:
    buffer = io.BytesIO()
    finder = _StorageFinder(buffer)
    finder.dump(state)
    return _Found(buffer.getvalue(), finder.storages, finder.atoms)


def _first_holders(found: dict[str, _Found]) -> dict[int, tuple[str, int]]:
    """Each distinct storage (``_cdata``) -> the (file key, order) that holds it first."""
    firsts: dict[int, tuple[str, int]] = {}
    for key, f in found.items():
        for i, storage in enumerate(f.storages):
            firsts.setdefault(storage._cdata, (key, i))
    return firsts


def _storage_of(source: _Source) -> torch.UntypedStorage:
    return source.untyped_storage() if isinstance(source, torch.Tensor) else source


def _copy_pairs(pairs: list[tuple[torch.UntypedStorage, _Source]], pool: ThreadPoolExecutor | None = None) -> None:
    """Each (buffer, source) copied: a storage whole, a tensor's values into its placeholder's buffer (contiguous,
    as empty_like made it). Through tensor views: a tensor's ``copy_`` releases the GIL, a storage's does not
    (measured: a storage copy in a thread held training's thread to 29 % of its pace). With ``pool``, host-to-host
    copies of :data:`PARALLEL_MIN_BYTES` or more are cut into pieces of :data:`PIECE_BYTES` that this thread and
    the pool's take in turn (a thread the host does not run meanwhile holds up at most its one piece)."""
    views = [_views(slot, source) for slot, source in pairs
             if source.device.type != "meta" and slot.nbytes() > 0]  # else nothing to copy (torch.save writes none)
    host = [(t, s) for t, s in views if t.device.type == "cpu" and s.device.type == "cpu" and s.is_contiguous()]
    if pool is None or sum(t.nbytes for t, _ in host) < PARALLEL_MIN_BYTES:
        host = []
    pooled = {id(t) for t, _ in host}
    for target, source in views:
        if id(target) not in pooled:
            target.copy_(source, non_blocking=source.device.type != "cpu")
    if pool is None or not host:
        return
    pieces = collections.deque(_pieces(host, PIECE_BYTES))
    futures = [pool.submit(_drain, pieces) for _ in range(pool._max_workers)]
    try:
        _drain(pieces)
    finally:  # never return (or raise) while a pool thread still writes into a buffer
        for future in futures:
            exception = future.exception()  # waits
            if exception is not None:
                raise exception


def _await_device_copies(pairs: list[tuple[torch.UntypedStorage, _Source]]) -> None:
    """Wait for the non-blocking device-to-host copies of ``pairs`` that this thread made: on each source's device,
    the stream they went on (a copy runs on its CUDA side's current stream, current streams being per thread and per
    device). Never ``torch.cuda.synchronize()``: it waits for this thread's current device only, cuda:0 in a thread
    that never set one (the background writer's), while a rank's tensors live on cuda:3."""
    devices = {source.device for _, source in pairs if source.device.type == "cuda"}
    for device in sorted(devices, key=str):
        torch.cuda.current_stream(device).synchronize()


def _views(slot: torch.UntypedStorage, source: _Source) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, source) tensors over the buffer and what it is copied from: bytes for a storage, the placeholder's
    shape and dtype for a tensor."""
    target = torch.empty(0, dtype=torch.uint8, device=slot.device).set_(slot)
    if isinstance(source, torch.Tensor):
        return target.view(source.dtype).view(source.shape), source
    return target, torch.empty(0, dtype=torch.uint8, device=source.device).set_(source)


_Pair = tuple[torch.Tensor, torch.Tensor]  # (target, source) of one copy


def _pieces(pairs: list[_Pair], piece_bytes: int) -> list[_Pair]:
    """The bytes of ``pairs`` (contiguous) cut into (target, source) pieces of at most ``piece_bytes``."""
    pieces: list[_Pair] = []
    for target, source in pairs:
        flat_target, flat_source = target.reshape(-1).view(torch.uint8), source.reshape(-1).view(torch.uint8)
        for start in range(0, flat_target.numel(), piece_bytes):
            pieces.append((flat_target[start:start + piece_bytes], flat_source[start:start + piece_bytes]))
    return pieces


def _drain(pieces: collections.deque[_Pair]) -> None:
    """Copy pieces until none is left (``popleft`` is atomic: each piece is taken by one thread)."""
    while True:
        try:
            target, source = pieces.popleft()
        except IndexError:
            return
        target.copy_(source)


def copy_threads() -> int:
    """Threads for the copies made while training waits: the cores this process may run on (the other ranks of the
    node wait at the save's agreement meanwhile), at most :data:`MAX_COPY_THREADS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_COPY_THREADS, cores))
