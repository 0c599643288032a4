"""Staging for async periodic saves (train/async_save/staging.py): a snapshot in reused host buffers that saves
byte for byte as the originals did at the instant of staging, whatever training does to them afterwards. Real
tensors shaped as a ZeRO-2 rank's files (zero2_states), real torch.save, no DeepSpeed ranks."""

from __future__ import annotations

import collections
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch
import torch.serialization
import zero2_states
from deepspeed.checkpoint import constants as ds

from slurm_jit.train.async_save import HostMemoryError, HostStager, StagingBusyError, locations, memory_guard, staging

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _saved(state: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _loaded(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Key by key, tensor by tensor (dtype, shape, values), objects by their attributes."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__"):
        _assert_same(vars(a), vars(b), where)
    else:
        assert a == b or (a != a and b != b), where  # NaN-safe


@pytest.fixture
def model_and_states() -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = zero2_states.flat_module(64)
    return model, zero2_states.zero2_states(model)


def test_staged_states_save_byte_identical_after_the_originals_change(model_and_states) -> None:
    model, states = model_and_states
    at_staging = {key: _saved(state) for key, state in states.items()}
    staged = HostStager(pin=False).stage(states)
    zero2_states.mutate_in_place(model, states)  # training continues
    assert all(_saved(states[key]) != at_staging[key] for key in (MODEL_FILE, OPTIM_FILE))  # they did change
    for key, state in staged.states.items():
        assert _saved(state) == at_staging[key], key


def test_zero2_optimizer_state_round_trips_key_by_key(model_and_states) -> None:
    model, states = model_and_states
    expected = _loaded(_saved(states[OPTIM_FILE]))
    staged = HostStager(pin=False).stage(states)
    zero2_states.mutate_in_place(model, states)
    got = _loaded(_saved(staged.states[OPTIM_FILE]))
    _assert_same(got, expected)
    optimizer = got["optimizer_state_dict"]
    assert optimizer[ds.LOSS_SCALER].cur_scale == 1.0  # the live loss scaler as it was at staging
    assert optimizer[ds.BASE_OPTIMIZER_STATE]["param_groups"][0]["lr"] == 1e-3


def test_views_of_one_flat_buffer_stay_views_of_one_staged_storage(model_and_states) -> None:
    model, states = model_and_states
    flat_bytes = next(model.parameters()).untyped_storage().nbytes()
    staged = HostStager(pin=False).stage({MODEL_FILE: states[MODEL_FILE]})
    module = staged.states[MODEL_FILE]["module"]
    assert len({t.untyped_storage().data_ptr() for t in module.values()}) == 1
    assert staged.nbytes == flat_bytes  # one copy of the flat buffer, as torch.save writes it once
    assert hasattr(module, "_metadata")  # the module state dict's versions, which load_state_dict reads
    reloaded = _loaded(_saved(staged.states[MODEL_FILE]))["module"]
    assert len({t.untyped_storage().data_ptr() for t in reloaded.values()}) == 1


def test_the_padded_fp32_partition_is_staged_whole(model_and_states) -> None:
    _, states = model_and_states
    partition = states[OPTIM_FILE]["optimizer_state_dict"][ds.SINGLE_PARTITION_OF_FP32_GROUPS][0]
    staged = HostStager(pin=False).stage({OPTIM_FILE: states[OPTIM_FILE]})
    view = staged.states[OPTIM_FILE]["optimizer_state_dict"][ds.SINGLE_PARTITION_OF_FP32_GROUPS][0]
    assert view.shape == partition.shape
    assert view.untyped_storage().nbytes() == partition.untyped_storage().nbytes() > partition.nbytes


def test_buffers_are_reused_and_resized_when_the_state_grows() -> None:
    states = {"a.pt": {"small": torch.ones(16), "big": torch.zeros(1024)}}
    stager = HostStager(pin=False)
    first = stager.stage(states)
    ptrs = [t.untyped_storage().data_ptr() for t in first.states["a.pt"].values()]
    first.release()
    states["a.pt"]["small"].fill_(2)
    second = stager.stage(states)
    assert [t.untyped_storage().data_ptr() for t in second.states["a.pt"].values()] == ptrs
    assert torch.equal(second.states["a.pt"]["small"], torch.full((16,), 2.0))
    second.release()
    states["a.pt"]["small"] = torch.ones(4096)  # the state grows
    third = stager.stage(states)
    small, big = (t.untyped_storage().data_ptr() for t in third.states["a.pt"].values())
    assert small != ptrs[0] and big == ptrs[1]
    assert stager.nbytes == third.nbytes == (4096 + 1024) * 4


def test_staging_again_before_the_write_is_over_is_refused() -> None:
    stager = HostStager(pin=False)
    stager.stage({"a.pt": torch.ones(4)})
    with pytest.raises(StagingBusyError) as caught:
        stager.stage({"a.pt": torch.ones(4)})
    assert "HINT: wait for the background writer" in str(caught.value) and "\n" not in str(caught.value)


def test_host_memory_too_small_refuses_before_anything_is_allocated(monkeypatch) -> None:
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=512 * 1024**2))
    stager = HostStager(pin=False)
    with pytest.raises(HostMemoryError) as caught:
        stager.stage({"a.pt": torch.ones(4)})
    assert "HINT:" in str(caught.value) and "\n" not in str(caught.value)
    assert stager.nbytes == 0


def test_a_staged_storage_keeps_the_location_tag_of_its_original() -> None:
    staged = torch.empty(8, dtype=torch.uint8).untyped_storage()
    try:
        locations.remember(staged, "cuda:0")
        assert torch.serialization.location_tag(staged) == "cuda:0"
        assert torch.serialization.location_tag(torch.ones(2).untyped_storage()) == "cpu"
    finally:
        locations.forget(staged)
    assert torch.serialization.location_tag(staged) == "cpu"


def test_pinned_buffers_are_counted_as_the_pinned_allocator_rounds_them(monkeypatch) -> None:
    mib = 1024**2
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: real._replace(available=memory_guard.HOST_MEMORY_MARGIN_BYTES + 50 * mib))
    monkeypatch.setattr(memory_guard, "cgroup_room", lambda *_: None)
    state = {"a.pt": torch.zeros(33 * mib, dtype=torch.uint8)}
    with pytest.raises(HostMemoryError, match="0.06 GiB"):  # 33 MiB pinned takes 64 MiB: refused before pinning
        HostStager(pin=True).stage(state)
    assert HostStager(pin=False).stage(state).nbytes == 33 * mib  # plain memory: 33 MiB fit


def test_a_deferred_copy_takes_the_snapshot_when_copy_pending_runs(model_and_states) -> None:
    """stage(defer=True): the structure and the Python values now, the tensors' bytes at copy_pending (the async
    save holds DeepSpeed's next optimizer step until then); what copy_now names is copied at once."""
    model, states = model_and_states
    buffer_storage = states[MODEL_FILE]["module"][next(iter(states[MODEL_FILE]["module"]))].untyped_storage()
    staged = HostStager(pin=False).stage(states, defer=True, copy_now=frozenset({buffer_storage._cdata}))
    assert not staged.copied and not staged.wait_copied(0.01)
    at_copy = {key: _saved(state) for key, state in states.items()}  # the originals at the copy
    staged.copy_pending()
    assert staged.copied and staged.wait_copied(0)
    zero2_states.mutate_in_place(model, states)  # training's optimizer step, after the copy
    for key, state in staged.states.items():
        assert _saved(state) == at_copy[key], key


def test_a_deferred_copy_made_in_another_thread_lets_this_one_run() -> None:
    """copy_pending in the writer's thread: the copy releases the GIL, and wait_copied returns once it is done."""
    import threading

    states = {"a.pt": {"big": torch.arange(8 * 1024**2, dtype=torch.float32)}}
    staged = HostStager(pin=False).stage(states, defer=True)
    thread = threading.Thread(target=staged.copy_pending)
    thread.start()
    assert staged.wait_copied(60)
    thread.join(60)
    assert torch.equal(staged.states["a.pt"]["big"], states["a.pt"]["big"])


def test_deferred_device_copies_are_awaited_on_their_own_devices_by_the_thread_that_made_them(monkeypatch) -> None:
    """Issue #42 item 1: the writer's thread makes the deferred copies of a rank on cuda:1 and cuda:3 (its current
    device is cuda:0: a thread's own, never set there); the wait must be for those devices' copies, never for the
    thread's current device (``torch.cuda.synchronize()``: a snapshot sealed before its copies land). The CUDA
    calls are stand-ins here (no GPU); tools/gpu-check runs the real copies (bench/staging_check.py)."""
    waits: list[tuple[str, str]] = []  # (what was waited for, the thread that waited)
    made: list[str] = []  # the thread that made the copies

    class _Stream:
        def __init__(self, device: torch.device) -> None:
            self.device = torch.device(device)

        def synchronize(self) -> None:
            waits.append((str(self.device), threading.current_thread().name))

    def synchronize(device: Any = None) -> None:
        waits.append((str(torch.device(device)) if device is not None else "current device",
                      threading.current_thread().name))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(device))
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(staging, "_copy_pairs", lambda pairs, pool=None: made.append(threading.current_thread().name))
    sources = [SimpleNamespace(device=torch.device("cuda", index)) for index in (3, 1, 3)]
    staged = staging.StagedSave(dict, 0, 0.0, 0.0, pending=[(torch.UntypedStorage(4), s) for s in sources])
    writer = threading.Thread(target=staged.copy_pending, name="slurm-jit-async-save")
    writer.start()
    writer.join(30)
    assert staged.copied and made == ["slurm-jit-async-save"]
    assert sorted(waits) == [("cuda:1", "slurm-jit-async-save"), ("cuda:3", "slurm-jit-async-save")], waits


def test_a_storage_held_by_two_files_is_staged_once_and_shared(model_and_states) -> None:
    """A module's weights in DeepSpeed's model-states file and in model.safetensors' dict: one buffer, one copy."""
    model, states = model_and_states
    weights = dict(states[MODEL_FILE]["module"])  # the same tensors, as save_pretrained's state dict holds them
    flat_bytes = next(model.parameters()).untyped_storage().nbytes()
    stager = HostStager(pin=False)
    staged = stager.stage({MODEL_FILE: states[MODEL_FILE], "model.safetensors": weights})
    module, again = staged.states[MODEL_FILE]["module"], staged.states["model.safetensors"]
    assert {t.untyped_storage().data_ptr() for t in module.values()} == {
        t.untyped_storage().data_ptr() for t in again.values()}
    assert staged.nbytes == stager.nbytes == flat_bytes
    before = _saved(weights)
    staged.release()
    zero2_states.mutate_in_place(model, states)
    second = stager.stage({MODEL_FILE: states[MODEL_FILE], "model.safetensors": weights})
    assert _saved(second.states["model.safetensors"]) == _saved(weights) != before  # reused buffers, new values


def test_files_that_shared_a_storage_and_no_longer_do_get_a_buffer_each(monkeypatch) -> None:
    """Issue #42 item 4: one buffer served two files that held one storage; in the next save (the same sizes) they
    hold two storages: each gets its own buffer and its own bytes, and the memory guard is asked for the new one."""
    shared = torch.arange(256, dtype=torch.float32)
    stager = HostStager(pin=False)
    stager.stage({"a.pt": {"w": shared}, "b.safetensors": {"w": shared}}).release()
    asked: list[int] = []
    check = memory_guard.check_host_memory
    monkeypatch.setattr(memory_guard, "check_host_memory", lambda nbytes, **kw: (asked.append(nbytes),
                                                                                  check(nbytes, **kw)))
    a, b = torch.full((256,), 1.0), torch.full((256,), 2.0)  # apart now (a tied weight untied), as large
    second = stager.stage({"a.pt": {"w": a}, "b.safetensors": {"w": b}})
    got_a, got_b = second.states["a.pt"]["w"], second.states["b.safetensors"]["w"]
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
    assert got_a.untyped_storage().data_ptr() != got_b.untyped_storage().data_ptr()
    assert asked == [b.nbytes] and stager.nbytes == second.nbytes == a.nbytes + b.nbytes


def test_a_placeholder_is_staged_with_the_values_of_its_source_at_the_copy() -> None:
    """sources: a placeholder's buffer gets its source tensor's values (a non-contiguous view too), taken when the
    deferred copy runs: the clone of a tied weight that save_pretrained must see as its own storage, made by the
    copy and not before it."""
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    source = weight.t()  # a view with other strides
    placeholder = torch.empty_like(source, memory_format=torch.contiguous_format)
    staged = HostStager(pin=False).stage({"model.safetensors": {"lm_head.weight": placeholder}}, defer=True,
                                         sources={placeholder.untyped_storage()._cdata: source})
    weight.add_(100)  # before the copy: the snapshot takes these values
    staged.copy_pending()
    weight.add_(1000)  # after it: not in the snapshot
    got = staged.states["model.safetensors"]["lm_head.weight"]
    assert torch.equal(got, (torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100).t())


def test_copies_made_at_the_staging_are_cut_into_pieces_for_the_copy_threads(model_and_states) -> None:
    """copy_threads: a host copy of PARALLEL_MIN_BYTES or more is cut into pieces that this thread and the pool's
    take in turn (a storage cut between them), and the snapshot is the same bytes; a smaller one this thread makes."""
    big = torch.randn(staging.PARALLEL_MIN_BYTES // 4 + 12345)  # just above the threshold, cut off the grid
    small = torch.arange(1000, dtype=torch.int64)
    model, states = model_and_states
    states = {**states, "big.pt": {"big": big, "small": small, "view": big[7:99]}}
    at_staging = {key: _saved(state) for key, state in states.items()}
    stager = HostStager(pin=False, copy_threads=3)
    threads: list[str] = []
    original = staging._drain

    def counted(pieces: Any) -> None:
        threads.append(threading.current_thread().name)
        original(pieces)

    staging._drain = counted
    try:
        staged = stager.stage(states)
    finally:
        staging._drain = original
    big.add_(1)
    zero2_states.mutate_in_place(model, states)
    for key, state in staged.states.items():
        assert _saved(state) == at_staging[key], key
    assert len(threads) == 3 and len(set(threads)) >= 2, threads  # this thread and the pool's two drained
    stager.free()


def test_pieces_cover_every_byte_once_and_none_is_larger_than_asked() -> None:
    targets = [torch.zeros(n, dtype=torch.uint8) for n in (10, 1, 33, 7)]
    sources = [torch.arange(n, dtype=torch.int64).to(torch.uint8) + i for i, n in enumerate((10, 1, 33, 7))]
    pieces = staging._pieces(list(zip(targets, sources, strict=True)), 8)
    assert [t.numel() for t, _ in pieces] == [8, 2, 1, 8, 8, 8, 8, 1, 7]
    staging._drain(collections.deque(pieces))
    assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))


def test_the_copy_threads_are_the_cores_this_process_may_use(monkeypatch) -> None:
    monkeypatch.setattr(staging.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert staging.copy_threads() == 2
    monkeypatch.setattr(staging.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert staging.copy_threads() == staging.MAX_COPY_THREADS


def test_a_failed_copy_returns_only_once_every_other_thread_has_ended(monkeypatch) -> None:
    """A copy that fails in this thread still waits for the pool's: no thread writes into a buffer after the
    staging has given up on it (the next save reuses it)."""
    ended: list[str] = []
    main = threading.current_thread()

    def drain(pieces: Any) -> None:
        if threading.current_thread() is main:
            raise RuntimeError("copy failed")
        time.sleep(0.3)
        ended.append(threading.current_thread().name)

    monkeypatch.setattr(staging, "_drain", drain)
    source = torch.empty(staging.PARALLEL_MIN_BYTES, dtype=torch.uint8)
    slot = torch.empty(staging.PARALLEL_MIN_BYTES, dtype=torch.uint8).untyped_storage()
    pool = ThreadPoolExecutor(1)
    with pytest.raises(RuntimeError, match="copy failed"):
        staging._copy_pairs([(slot, source.untyped_storage())], pool)
    assert len(ended) == 1  # before the pool's shutdown, which would wait for it anyway
    pool.shutdown()


def test_the_snapshot_is_rebuilt_around_its_buffers_only_when_first_looked_at(model_and_states) -> None:
    """stage() leaves the rebuild of the states (an unpickling of each file's structure, ~2.5 ms a save here) to
    the first look, the background writer's; what it then holds is the snapshot of the staging's instant."""
    model, states = model_and_states
    at_staging = {key: _saved(state) for key, state in states.items()}
    staged = HostStager(pin=False).stage(states)
    assert staged._states is None
    zero2_states.mutate_in_place(model, states)  # training goes on before the writer looks
    for key, state in staged.states.items():
        assert _saved(state) == at_staging[key], key
    assert staged.states is staged.states  # rebuilt once


def test_a_staged_save_does_not_hold_what_it_was_staged_from() -> None:
    """Found by a review: the lazy rebuild's closure held every original storage (a tied weight's placeholder, as
    large as the embedding, on the GPU) until the next save; it holds the pickled structures only."""
    import gc

    original = torch.arange(1000, dtype=torch.float32)
    staged = HostStager(pin=False).stage({"a.pt": {"x": original}})
    cdata = original.untyped_storage()._cdata
    held = [obj for cell in staged.rebuild.__closure__ or () for obj in _reachable(cell.cell_contents)]
    assert not [obj for obj in held if isinstance(obj, torch.UntypedStorage) and obj._cdata == cdata]
    assert torch.equal(staged.states["a.pt"]["x"], original)
    gc.collect()


def _reachable(root: Any, depth: int = 6) -> list[Any]:
    """Objects reachable from ``root`` through containers and instance attributes, ``depth`` levels down."""
    out, level = [], [root]
    for _ in range(depth):
        nxt = []
        for obj in level:
            out.append(obj)
            if isinstance(obj, dict):
                nxt.extend(obj.values())
            elif isinstance(obj, list | tuple | set):
                nxt.extend(obj)
            elif hasattr(obj, "__dict__") and not isinstance(obj, type):
                nxt.extend(vars(obj).values())
        level = nxt
    return out
