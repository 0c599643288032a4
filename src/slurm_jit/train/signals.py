"""Signal latch: the handler only records that and when the first signal arrived.

No I/O, no locks, no collectives run inside the handler; the training loop reads the latch at step boundaries
(the pattern Lightning's SIGTERM path follows). Further signals after the first are counted and otherwise ignored.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

_Handler = Callable[[int, FrameType | None], Any] | int | None
_DATALOADER_RECEIVE = ("dataloader.py", "_try_get_data")  # torch's DataLoader, taking a batch from its workers


class SignalLatch:
    """Records the first of ``signums``; install() in the main thread, restore() when done."""

    def __init__(self, signums: Iterable[signal.Signals]) -> None:
        self.signums = tuple(signums)
        self.first_at: float | None = None  # time.monotonic() of the first signal
        self.first_signum: int | None = None
        self.count = 0
        self._previous: dict[int, _Handler] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.first_at is None:
            self.first_at = time.monotonic()
            self.first_signum = signum

    @property
    def seen(self) -> bool:
        return self.first_at is not None

    def install(self) -> None:
        for signum in self.signums:
            if signum not in self._previous:  # a signal named twice must not record this latch as "previous"
                self._previous[signum] = signal.signal(signum, self._handler)

    def restore(self, keep_ignoring: bool = False) -> None:
        """Put the previous handlers back; or, with ``keep_ignoring``, ignore the signals from now on."""
        for signum, previous in self._previous.items():
            if keep_ignoring:
                signal.signal(signum, signal.SIG_IGN)
            else:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


class IgnoreSignalsInWorker:
    """A DataLoader ``worker_init_fn`` wrapper: workers ignore the stop signals.

    Slurm signals every process of a task (with proctrack/linuxproc, forked DataLoader workers included). A worker
    that dies of SIGTERM makes the main process raise before it can checkpoint; the main process alone acts on it.
    Picklable, so it also works with the spawn and forkserver start methods.
    """

    def __init__(self, inner: Callable[[int], Any] | None, signums: Iterable[int]) -> None:
        self.inner = inner
        self.signums = tuple(int(s) for s in signums)

    def __call__(self, worker_id: int) -> None:
        for signum in self.signums:
            signal.signal(signum, signal.SIG_IGN)  # also discards one left pending by StartWorkersMasked
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signums)
        if self.inner is not None:
            self.inner(worker_id)


class StartWorkersMasked:
    """Wraps a DataLoader's ``_get_iterator``: the stop signals are blocked in this thread while it starts workers.

    A worker inherits the signal mask of the thread that starts it (through fork, and through the exec of the
    spawn and forkserver start methods; a forkserver started here passes it on too), so it is born with the stop
    signals blocked: one sent to the whole process group while the worker imports stays pending, and
    :class:`IgnoreSignalsInWorker` discards it (SIG_IGN) before unblocking. Blocked, not ignored, in the parent:
    a signal that arrives meanwhile stays pending and reaches the parent's latch when the old mask is restored.
    """

    def __init__(self, get_iterator: Callable[[], Any], signums: Iterable[int]) -> None:
        self.get_iterator = get_iterator
        self.signums = tuple(int(s) for s in signums)

    def __call__(self) -> Any:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, self.signums)
        try:
            return self.get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _HeldSigchld:
    """The SIGCHLD handler inside a hold: it only records that a child ended (a handler that only sets a flag)."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.seen = True


@contextlib.contextmanager
def worker_deaths_held(replay: bool = False) -> Iterator[None]:
    """A DataLoader worker's death cannot raise inside the block: what is written there is written whole.

    torch's DataLoader installs a SIGCHLD handler in the main process that raises ``RuntimeError: DataLoader worker
    (pid N) is killed by signal`` from whatever the main thread runs when a worker dies: inside a checkpoint's
    fsync or the stop record's write, that error left a half-written save or no record at all (seen: Slurm's step
    signal ending the workers while rank 0 wrote ``failed``). Inside the block a handler only notes the signal
    (no reaping: SIG_IGN would reap every child and break ``waitpid``). After it the previous handler is back, and
    with ``replay`` (a save, after which training fetches again) a SIGCHLD noted meanwhile is handed to it once the
    block has ended without an error: torch's raises then, with its message, instead of a later fetch waiting on
    a pipe the dead worker left half written. Without ``replay`` (the stop records, which no fetch follows) it is
    dropped. A handler set inside the block (a first DataLoader iterator) is kept. Main thread only (Python
    installs handlers nowhere else); a handler installed from C (``getsignal`` says None) is left alone.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGCHLD) is None:
        yield
        return
    held = _HeldSigchld()
    previous = signal.signal(signal.SIGCHLD, held)
    try:
        yield
    except BaseException:
        replay = False  # the block's own error goes on, not a worker's
        raise
    finally:
        seen = held.seen
        if signal.getsignal(signal.SIGCHLD) is held:
            signal.signal(signal.SIGCHLD, previous)
            outer = previous if isinstance(previous, _HeldSigchld) else None
            if seen and outer is not None:
                outer.seen = True  # a hold around this one decides (a stop record inside a save)
            elif seen and replay and callable(previous):
                previous(signal.SIGCHLD, None)


def mask_workers(loader: Any, signums: tuple[int, ...]) -> None:
    """A DataLoader's workers ignore the stop signals, and are born with them blocked (spawn/forkserver workers
    import for seconds before worker_init_fn runs)."""
    base = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderAdapter delegates to the one it wraps
    base.worker_init_fn = IgnoreSignalsInWorker(base.worker_init_fn, signums)
    base._get_iterator = StartWorkersMasked(base._get_iterator, signums)  # the instance attribute shadows the method


def failure_line(exc: BaseException) -> str:
    """``Type: message`` of a failed train(), as the stop record says it. A DataLoader worker that Slurm's step
    signal (or the OOM killer) ends while it hands a batch over leaves its rank an OSError or EOFError from inside
    the DataLoader's receive (the batch's shared-memory handle is fetched from the dead worker: "Connection
    refused"), raised before torch has seen the worker dead and so without the "DataLoader worker" words its own
    check adds: the line says it."""
    line = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError | EOFError) and exc.__traceback__ is not None and any(
            frame.filename.endswith(_DATALOADER_RECEIVE[0]) and frame.name == _DATALOADER_RECEIVE[1]
            for frame in traceback.extract_tb(exc.__traceback__)):
        line = f"DataLoader worker gone while handing over a batch ({line})"
    return line
