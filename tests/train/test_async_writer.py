"""The background writer of async periodic saves (train/async_save/writer.py): one thread, one save in flight at
most, the staged bytes on disk and durable, and every failure (a real full tmpfs, a real read-only mount, a state
that cannot be pickled) handed to the caller as one line instead of lost in the thread."""

from __future__ import annotations

import os
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
import zero2_states
from disk_helpers import assert_one_line, fill, tmpfs
from torch.utils.serialization import config as torch_serialization

from slurm_jit.train import save_errors
from slurm_jit.train.async_save import BackgroundWriter, HostStager, Submitted
from slurm_jit.train.save_errors import CheckpointWriteError
from slurm_jit.train.zip_crc import zip_crc32

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
WAIT_S = 60  # every wait has a deadline: a hung writer fails its test


@pytest.fixture
def writer():
    made = BackgroundWriter(zip_crc32=False)
    yield made
    made.close(timeout_s=WAIT_S)


def test_written_files_are_the_states_at_staging_and_durable(tmp_path, writer) -> None:
    torch.manual_seed(0)
    model = zero2_states.flat_module(32)
    states = zero2_states.zero2_states(model)
    expected = {}
    for key, state in states.items():  # the synchronous save at the instant of staging (same names: torch.save
        sync = tmp_path / "sync" / key  # names the records inside the zip after the file)
        sync.parent.mkdir(exist_ok=True)
        with zip_crc32(False):  # as the synchronous save writes them (JitConfig.zip_crc32's default)
            torch.save(state, sync)
        expected[key] = sync.read_bytes()
    staged = HostStager(pin=False).stage(states)
    zero2_states.mutate_in_place(model, states)
    ckpt = tmp_path / "checkpoint-5"
    items = [(ckpt / "global_step5" / key, state) for key, state in staged.states.items()]
    assert writer.submit(ckpt, items, wait_if_busy=False, release=staged.release) is Submitted.STARTED
    assert writer.wait(WAIT_S) is True
    for key, data in expected.items():
        assert (ckpt / "global_step5" / key).read_bytes() == data, key
    assert staged.released
    assert writer.last_stats is not None and writer.last_stats.nbytes == sum(len(d) for d in expected.values())


def test_the_longest_file_write_is_measured(tmp_path, writer) -> None:
    """What a JIT stop budgets for a set-aside writer's current file (async_save/stop_wait.py): the longest one
    file took, of the files of one write."""
    class Slow:  # a state whose pickling takes 0.3 s: its file is the longest write
        def __reduce__(self):  # type: ignore[no-untyped-def]
            time.sleep(0.3)
            return (int, (1,))

    ckpt = tmp_path / "checkpoint-1"
    items = [(ckpt / "fast.pt", {"x": torch.zeros(4)}), (ckpt / "slow.pt", {"x": Slow()})]
    assert writer.submit(ckpt, items, wait_if_busy=False) is Submitted.STARTED
    assert writer.wait(WAIT_S) is True
    stats = writer.last_stats
    assert stats is not None and 0.3 <= stats.file_max_s <= stats.write_s, stats


def test_a_second_save_waits_or_is_refused_by_the_callers_choice(tmp_path, writer) -> None:
    gate = threading.Event()
    ckpt = tmp_path / "checkpoint-1"
    assert writer.submit(ckpt, [(ckpt / "a.pt", torch.ones(2))], wait_if_busy=False,
                         after=lambda: gate.wait(WAIT_S)) is Submitted.STARTED
    assert writer.in_flight
    later = tmp_path / "checkpoint-2"
    assert writer.submit(later, [(later / "a.pt", torch.ones(2))], wait_if_busy=False) is Submitted.REFUSED_BUSY
    assert writer.submit(later, [(later / "a.pt", torch.ones(2))], wait_if_busy=True,
                         timeout_s=0.2) is Submitted.REFUSED_BUSY
    assert writer.wait(0.1) is False
    opener = threading.Timer(0.3, gate.set)
    opener.start()
    try:
        assert writer.submit(later, [(later / "a.pt", torch.ones(2))], wait_if_busy=True,
                             timeout_s=WAIT_S) is Submitted.STARTED_AFTER_WAIT
    finally:
        opener.join()
    assert writer.wait(WAIT_S)
    assert (later / "a.pt").is_file()


@needs_root
def test_a_full_disk_in_the_background_is_raised_by_wait_once(tmp_path, writer) -> None:
    released = threading.Event()
    with tmpfs(tmp_path / "full", 256 * 1024) as mount:
        ckpt = mount / "checkpoint-3"
        writer.submit(ckpt, [(ckpt / "big.pt", torch.zeros(256 * 1024))], wait_if_busy=False,
                      release=released.set)
        with pytest.raises(CheckpointWriteError) as caught:
            writer.wait(WAIT_S)
        assert_one_line(str(caught.value), "checkpoint-3", "free space on")
        assert released.is_set()  # the staging buffers are free again
        assert writer.wait(WAIT_S) is True  # raised once, not again


@needs_root
def test_a_read_only_directory_is_raised_by_the_next_submit(tmp_path, writer) -> None:
    with tmpfs(tmp_path / "ro", 1024 * 1024, read_only=True) as mount:
        ckpt = mount / "checkpoint-4"
        writer.submit(ckpt, [(ckpt / "a.pt", torch.ones(2))], wait_if_busy=False)
        deadline = time.monotonic() + WAIT_S  # over without wait(): the next submit must still get its error
        while writer.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        other = tmp_path / "checkpoint-5"
        with pytest.raises(CheckpointWriteError) as caught:
            writer.submit(other, [(other / "a.pt", torch.ones(2))], wait_if_busy=True, timeout_s=WAIT_S)
        assert_one_line(str(caught.value), "Read-only file system", "have it made writable")
        assert not other.exists()  # the refused submit started nothing


def test_any_other_failure_is_one_line_naming_it(tmp_path, writer) -> None:
    ckpt = tmp_path / "checkpoint-6"
    writer.submit(ckpt, [(ckpt / "a.pt", {"fn": lambda: 0})], wait_if_busy=False)  # not picklable
    with pytest.raises(CheckpointWriteError) as caught:
        writer.wait(WAIT_S)
    assert_one_line(str(caught.value), "background write of", "checkpoint-6", "failed: ", "logged at DEBUG")


def test_a_failed_write_is_told_to_on_error_and_still_raised(tmp_path, writer) -> None:
    # on_error is how rank 0 learns of another rank's failure at once (its failed marker); an on_error that fails
    # too (its own file on a full disk) leaves the write's own error to the caller
    told: list[str] = []
    ckpt = tmp_path / "checkpoint-7"
    writer.submit(ckpt, [(ckpt / "a.pt", {"fn": lambda: 0})], wait_if_busy=False, on_error=told.append)
    with pytest.raises(CheckpointWriteError) as caught:
        writer.wait(WAIT_S)
    assert told == [str(caught.value)] and "\n" not in told[0]

    def fails(why: str) -> None:
        raise OSError(28, "No space left on device")

    writer.submit(ckpt, [(ckpt / "b.pt", {"fn": lambda: 0})], wait_if_busy=False, on_error=fails)
    with pytest.raises(CheckpointWriteError, match="background write of"):
        writer.wait(WAIT_S)


@needs_root
def test_an_error_already_one_line_passes_the_disk_full_guard_unchanged(tmp_path) -> None:
    # rank 0's commit error (another rank failed) inside the writer's disk-full guard: on a full disk it was
    # probed and wrapped again ("... could not be written: CheckpointWriteError: slurm_jit: ...")
    with tmpfs(tmp_path / "full", 256 * 1024) as mount:
        fill(mount)
        inner = CheckpointWriteError("slurm_jit: checkpoint-8 not committed: rank 1 failed. HINT: its log says why")
        with pytest.raises(CheckpointWriteError) as caught, save_errors.disk_full_is_one_line(mount / "checkpoint-8"):
            raise inner
        assert caught.value is inner
        assert not list(mount.glob(f"{save_errors.PROBE_NAME}*"))


@pytest.mark.parametrize("crc", [True, False])
def test_the_zip_crc32_setting_is_honoured_and_torchs_own_is_back_after(tmp_path, crc: bool) -> None:
    before = torch_serialization.save.compute_crc32
    writer = BackgroundWriter(zip_crc32=crc)
    ckpt = tmp_path / "checkpoint-7"
    try:
        writer.submit(ckpt, [(ckpt / "a.pt", torch.arange(100.0))], wait_if_busy=False)
        assert writer.wait(WAIT_S)
    finally:
        assert writer.close(WAIT_S)
    crcs = [info.CRC for info in zipfile.ZipFile(ckpt / "a.pt").infolist()]
    assert all(crcs) if crc else not any(crcs)
    assert torch_serialization.save.compute_crc32 == before


def test_close_waits_for_the_write_in_flight_and_ends_the_thread(tmp_path) -> None:
    writer = BackgroundWriter(zip_crc32=False)
    gate = threading.Event()
    ckpt = tmp_path / "checkpoint-8"
    writer.submit(ckpt, [(ckpt / "a.pt", torch.ones(2))], wait_if_busy=False, after=lambda: gate.wait(WAIT_S))
    assert writer.close(timeout_s=0.2) is False  # still writing
    gate.set()
    assert writer.close(timeout_s=WAIT_S) is True
    assert (ckpt / "a.pt").is_file()
    with pytest.raises(RuntimeError, match="writer is closed. HINT"):
        writer.submit(ckpt, [(ckpt / "b.pt", torch.ones(2))], wait_if_busy=False)


def test_a_file_outside_the_checkpoint_directory_is_refused(tmp_path: Path, writer) -> None:
    with pytest.raises(ValueError, match="not under the checkpoint directory"):
        writer.submit(tmp_path / "checkpoint-9", [(tmp_path / "elsewhere.pt", torch.ones(2))], wait_if_busy=False)


def test_a_deferred_snapshot_is_copied_by_prepare_before_its_safetensors_file_is_written(tmp_path, writer) -> None:
    """prepare (the staging's deferred copies) runs in the thread before any file; a safetensors item is written
    as safetensors.torch.save_file writes it: the same bytes as the synchronous call at the instant of the copy."""
    from safetensors.torch import save_file

    from slurm_jit.train.async_save.files import SafetensorsFile

    weights = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 4)}
    staged = HostStager(pin=False).stage({"model.safetensors": SafetensorsFile(weights, {"format": "pt"})}, defer=True)
    save_file(weights, str(tmp_path / "sync.safetensors"), metadata={"format": "pt"})
    ckpt = tmp_path / "checkpoint-1"
    gate = threading.Event()
    assert writer.submit(ckpt, [(ckpt / "model.safetensors", staged.states["model.safetensors"])],
                         wait_if_busy=False, release=staged.release,
                         prepare=lambda: (gate.wait(WAIT_S), staged.copy_pending())) is Submitted.STARTED
    assert not staged.wait_copied(0.2) and not (ckpt / "model.safetensors").exists()  # held before the copy
    gate.set()
    assert staged.wait_copied(WAIT_S) and writer.wait(WAIT_S)
    weights["a"].add_(1)  # training's optimizer step, after the copy: not in the file
    assert (ckpt / "model.safetensors").read_bytes() == (tmp_path / "sync.safetensors").read_bytes()


@needs_root
def test_a_full_disk_under_a_safetensors_file_is_the_oserror_it_is(tmp_path) -> None:
    """safetensors raises its own SafetensorError for an I/O error; files.write makes it the OSError it is (errno
    from its "(os error N)"), so that the writer's disk-full line with its HINT comes, not the generic one."""
    import errno

    from slurm_jit.train.async_save import files

    with tmpfs(tmp_path / "mnt", 256 * 1024) as mount:
        fill(mount)
        with pytest.raises(OSError) as caught:
            files.write(mount / "model.safetensors", files.SafetensorsFile({"w": torch.ones(1024)}, None))
    assert caught.value.errno == errno.ENOSPC, caught.value


def test_cancel_stops_the_save_before_its_next_file_and_keeps_no_error(tmp_path, writer) -> None:
    """A JIT stop sets the save in flight aside (async_save/stop_wait.py): the file being written is finished, no
    later file is begun, ``after`` (the done marker) never runs, the buffers are released, nothing is raised."""
    from slurm_jit.train.async_save.files import Later  # noqa: PLC0415

    in_second, go_on, released, after = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def slow_state() -> dict[str, torch.Tensor]:
        in_second.set()
        assert go_on.wait(WAIT_S)
        return {"w": torch.ones(4)}

    ckpt = tmp_path / "checkpoint-3"
    items = [(ckpt / "a.pt", {"w": torch.zeros(4)}), (ckpt / "b.pt", Later(slow_state)), (ckpt / "c.pt", {"w": 1})]
    writer.submit(ckpt, items, wait_if_busy=False, after=after.set, release=released.set)
    assert in_second.wait(WAIT_S)
    writer.cancel()
    go_on.set()
    assert writer.wait(WAIT_S) is True  # nothing raised
    assert (ckpt / "a.pt").exists() and (ckpt / "b.pt").exists() and not (ckpt / "c.pt").exists()
    assert released.is_set() and not after.is_set()
    # the next save is written whole: the cancel was for the one in flight only
    again = tmp_path / "checkpoint-4"
    writer.submit(again, [(again / "a.pt", {"w": 2}), (again / "b.pt", {"w": 3})], wait_if_busy=False,
                  after=after.set)
    assert writer.wait(WAIT_S) is True and (again / "b.pt").exists() and after.is_set()
