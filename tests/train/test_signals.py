"""The stop signals (train/signals.py, signal_names.py): the latch records the first signal only and restores the
handlers, signal names parsed, DataLoader workers (forked and spawned) survive a SIGTERM meant for the rank.
Real signals and real processes; no DeepSpeed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.utils.data

from slurm_jit.signal_names import parse_signal
from slurm_jit.train.signals import (
    IgnoreSignalsInWorker,
    SignalLatch,
    StartWorkersMasked,
    failure_line,
    worker_deaths_held,
)


def test_latch_records_first_signal_only_and_restores() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    latch = SignalLatch([signal.SIGUSR1])
    latch.install()
    try:
        assert not latch.seen
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR1)
        first = latch.first_at
        assert first is not None and first >= t0 and latch.first_signum == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGUSR1)
        assert latch.first_at == first and latch.count == 2
    finally:
        latch.restore()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_latch_keep_ignoring_after_a_stop() -> None:
    latch = SignalLatch([signal.SIGUSR2])
    latch.install()
    latch.restore(keep_ignoring=True)
    try:
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR2)  # would end the process if not ignored
    finally:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_parse_signal() -> None:
    assert parse_signal("TERM") == signal.SIGTERM
    assert parse_signal("sigusr1") == signal.SIGUSR1
    assert parse_signal(15) == signal.SIGTERM
    with pytest.raises(ValueError, match="HINT"):
        parse_signal("NOPE")


def _worker(ready: multiprocessing.synchronize.Event, init: IgnoreSignalsInWorker) -> None:  # type: ignore[name-defined]
    init(0)
    ready.set()
    time.sleep(3)


def test_worker_init_makes_a_forked_worker_survive_sigterm() -> None:
    ctx = multiprocessing.get_context("fork")
    for wrapper, survives in ((IgnoreSignalsInWorker(None, [signal.SIGTERM]), True),
                              (IgnoreSignalsInWorker(None, []), False)):
        ready = ctx.Event()
        proc = ctx.Process(target=_worker, args=(ready, wrapper))
        proc.start()
        assert ready.wait(10)
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(0.5 if survives else 10.0)  # dying can take long on a loaded machine; surviving is 0.5 s alive
        assert proc.is_alive() == survives
        proc.kill()
        proc.join()


@pytest.mark.parametrize("masked", [True, False])
def test_spawned_workers_are_born_with_the_stop_signals_blocked(masked: bool) -> None:
    """A signal sent while a spawn worker imports (before worker_init_fn) must not kill it; the parent's latch
    still gets one that arrived while the parent blocked it. SIGUSR1 stands in for the stop signal."""
    from torch.utils.data import DataLoader

    stop = signal.SIGUSR1
    latch = SignalLatch([stop])
    loader = DataLoader(list(range(4)), num_workers=1, multiprocessing_context="spawn",
                        worker_init_fn=IgnoreSignalsInWorker(None, [stop]))

    def start_and_signal():  # type: ignore[no-untyped-def]
        iterator = DataLoader._get_iterator(loader)
        os.kill(os.getpid(), stop)  # inside the blocked window when masked
        for worker in iterator._workers:  # still importing torch: seconds before worker_init_fn
            os.kill(worker.pid, stop)
        return iterator

    loader._get_iterator = StartWorkersMasked(start_and_signal, [stop]) if masked else start_and_signal
    latch.install()
    try:
        if masked:
            assert [int(b) for b in loader] == [0, 1, 2, 3]
        else:
            with pytest.raises(RuntimeError, match="DataLoader worker"):
                list(loader)
        assert latch.seen
        assert stop not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the parent's mask is back
    finally:
        latch.restore()


def test_latch_with_a_signal_named_twice_restores_the_original_handler() -> None:
    # install() recorded its own handler as the "previous" one of the second copy: after train() the latch stayed
    # installed, and every later SIGUSR1 was swallowed.
    seen: list[int] = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        latch = SignalLatch([signal.SIGUSR1, signal.SIGUSR1])
        latch.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert latch.seen and not seen
        latch.restore()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and latch.count == 1
    finally:
        signal.signal(signal.SIGUSR1, original)


class WorkerKilled(RuntimeError):
    """What torch's DataLoader SIGCHLD handler raises (torch/utils/data/_utils/signal_handling.py)."""


def _raising_sigchld_handler(signum: int, frame: object) -> None:
    raise WorkerKilled("DataLoader worker (pid 1) is killed by signal: Terminated.")


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _write_while_a_child_dies(path: str) -> None:
    """Write a record in two halves while a real child process exits in between (its SIGCHLD comes then)."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write('{"state": ')
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _state(child.pid) != "Z":  # a zombie: it exited, SIGCHLD is sent
            time.sleep(0.01)
        time.sleep(0.05)  # the handler runs at the next bytecode boundary of the main thread
        handle.write('"failed"}')
        handle.flush()
        os.fsync(handle.fileno())
    child.wait(timeout=30)  # SIG_DFL, not SIG_IGN: the child is still there to be reaped


def test_a_worker_death_inside_the_hold_does_not_cut_the_write_short(tmp_path: Path) -> None:
    previous = signal.signal(signal.SIGCHLD, _raising_sigchld_handler)
    try:
        with worker_deaths_held():
            assert signal.getsignal(signal.SIGCHLD) is not _raising_sigchld_handler
            _write_while_a_child_dies(str(tmp_path / "record"))
        assert signal.getsignal(signal.SIGCHLD) is _raising_sigchld_handler  # the DataLoader's handler is back
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert (tmp_path / "record").read_text() == '{"state": "failed"}'


def test_control_without_the_hold_the_worker_death_raises_inside_the_write(tmp_path: Path) -> None:
    previous = signal.signal(signal.SIGCHLD, _raising_sigchld_handler)
    try:
        with pytest.raises(WorkerKilled):
            _write_while_a_child_dies(str(tmp_path / "record"))
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert (tmp_path / "record").read_text() == '{"state": '  # the half the CI failure left


def test_the_hold_is_a_no_op_off_the_main_thread() -> None:
    seen: list[object] = []
    previous = signal.signal(signal.SIGCHLD, _raising_sigchld_handler)
    try:
        def off_main() -> None:
            with worker_deaths_held():
                seen.append(signal.getsignal(signal.SIGCHLD))
        thread = threading.Thread(target=off_main)
        thread.start()
        thread.join(timeout=30)
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert seen == [_raising_sigchld_handler]


def _a_child_dies() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _state(child.pid) != "Z":
        time.sleep(0.01)
    time.sleep(0.05)
    child.wait(timeout=30)


def test_with_replay_the_worker_death_raises_after_the_block(tmp_path: Path) -> None:
    previous = signal.signal(signal.SIGCHLD, _raising_sigchld_handler)
    try:
        with pytest.raises(WorkerKilled), worker_deaths_held(replay=True):  # a save: training fetches after it
            _write_while_a_child_dies(str(tmp_path / "record"))
        assert (tmp_path / "record").read_text() == '{"state": "failed"}'  # written whole first
        with worker_deaths_held(replay=True):
            pass  # no child ended: nothing to hand on
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_the_blocks_own_error_is_not_replaced_by_a_replayed_death() -> None:
    previous = signal.signal(signal.SIGCHLD, _raising_sigchld_handler)
    try:
        with pytest.raises(OSError, match="disk full"), worker_deaths_held(replay=True):
            _a_child_dies()
            raise OSError(28, "disk full")
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_a_hold_inside_a_replaying_hold_leaves_the_death_to_the_outer_one() -> None:
    previous = signal.signal(signal.SIGCHLD, _raising_sigchld_handler)
    try:
        with pytest.raises(WorkerKilled), worker_deaths_held(replay=True):  # the save
            with worker_deaths_held():  # the stop record inside it
                _a_child_dies()
            assert signal.getsignal(signal.SIGCHLD) is not _raising_sigchld_handler  # still held
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_a_handler_set_inside_the_hold_is_kept() -> None:
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        with worker_deaths_held(replay=True):
            signal.signal(signal.SIGCHLD, _raising_sigchld_handler)  # a first DataLoader iterator, torch's handler
        assert signal.getsignal(signal.SIGCHLD) is _raising_sigchld_handler
    finally:
        signal.signal(signal.SIGCHLD, previous)


class _BigItems(torch.utils.data.Dataset):
    """Items that travel pickled through the worker's pipe (not shared memory): 1 MiB, 16 x the pipe's buffer."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> bytes:
        return b"x" * (1 << 20)


def test_a_real_dataloader_worker_killed_during_a_save_raises_right_after_it() -> None:
    """torch's own handler: the worker dies with its next batch half in the pipe, inside the hold; the hold hands
    the SIGCHLD on at its end and torch raises then (without the replay the next fetch would wait forever)."""
    loader = torch.utils.data.DataLoader(_BigItems(), batch_size=None, num_workers=1)
    batches = iter(loader)
    next(batches)
    time.sleep(0.5)  # the worker is now blocked writing the next message
    pid = batches._workers[0].pid  # type: ignore[attr-defined]
    try:
        with pytest.raises(RuntimeError, match="DataLoader worker .* is killed by signal"):
            with worker_deaths_held(replay=True):
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and _state(pid) != "Z":
                    time.sleep(0.01)
                time.sleep(0.05)  # the SIGCHLD has come, and only the hold saw it
    finally:
        batches._shutdown_workers()  # type: ignore[attr-defined]


def _receive_error(exc: BaseException) -> BaseException:
    """What a real DataLoader with a live worker raises when taking a batch from its queue fails with ``exc`` (the
    worker's death half-way through the hand-over: the only thing not produced for real, since it is a race)."""
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=1)
    it = iter(loader)
    try:
        def fail(*args: object, **kwargs: object) -> None:
            raise exc
        it._data_queue.get = fail  # type: ignore[attr-defined]
        with pytest.raises(type(exc)) as raised:
            next(it)
        return raised.value
    finally:
        it._shutdown_workers()  # type: ignore[attr-defined]


@pytest.mark.parametrize("exc", [ConnectionRefusedError(111, "Connection refused"), EOFError()])
def test_a_worker_gone_while_handing_over_a_batch_is_named_in_the_failure_line(exc: BaseException) -> None:
    # seen in CI: Slurm's step signal ended rank 0's worker mid-hand-over; its record said only "Connection refused"
    line = failure_line(_receive_error(exc))
    assert line.startswith("DataLoader worker gone while handing over a batch (") and type(exc).__name__ in line


def test_other_errors_keep_their_own_line() -> None:
    assert failure_line(ConnectionRefusedError(111, "Connection refused")) == \
        "ConnectionRefusedError: [Errno 111] Connection refused"  # not raised in the DataLoader's receive
    assert failure_line(_receive_error(ValueError("bad batch"))) == "ValueError: bad batch"
