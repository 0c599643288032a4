"""The optimizer step's gate: DeepSpeed's next ``engine.step`` waits for an async save's deferred staging copies.

The copies run in the background writer's thread beside the next step's forward and backward (DCP's
``async_staging`` contract, :mod:`.staging`); only the optimizer step changes the states they copy, so
:class:`StepGate` holds it until they are done. The wait is bounded (:func:`copy_wait_bound_s`): copies that never
end (on a GPU, a device-to-host copy queued behind a kernel that never ends, such as a collective whose peer was
lost) fail the step with :class:`CopyWaitTimeout`, one line that names them, before the hang watchdog's bound on
the same wait would end the rank as ``hung`` and hide the cause.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurm_jit.train.async_save import fault_points
from slurm_jit.train.async_save.staging import StagedSave

# Host memcpy and a pinned device-to-host copy run at several GB/s (docs/benchmarks.md: gpu_d2h_copy_pinned); copies
# slower than a quarter of 1 GB/s are stuck, not slow.
COPY_FLOOR_BYTES_PER_S = 250e6
COPY_WAIT_MIN_S = 60.0  # whatever the bytes: a loaded host's scheduling, first touches of freshly pinned pages
# The hang watchdog gives the wait a save's bound (train/watchdog.py long_bound_s): this one ends well before it,
# so that the line names the copies instead of a ``hung`` record naming a frame.
WATCHDOG_SHARE = 0.5


class CopyWaitTimeout(RuntimeError):
    """The staging copies an optimizer step waits for did not end within the bound; the message is one line."""


def copy_wait_bound_s(nbytes: int, watchdog_save_bound_s: float | None) -> float:
    """How long the optimizer step waits for the copies of ``nbytes`` staged bytes. Pure (but for the fault
    injection's shortened bound, :func:`fault_points.copy_wait_s`)."""
    shortened = fault_points.copy_wait_s()
    if shortened is not None:
        return shortened
    bound = max(COPY_WAIT_MIN_S, nbytes / COPY_FLOOR_BYTES_PER_S)
    if watchdog_save_bound_s is not None:
        bound = min(bound, WATCHDOG_SHARE * watchdog_save_bound_s)
    return bound


class StepGate:
    """Holds DeepSpeed's next ``engine.step`` (the optimizer step: what changes the staged tensors) until the
    snapshot's deferred copies are done, then records the save's blocked time (its own and this wait) and goes.
    Installed on the engine instance for one save; :meth:`open` removes it (at that step, or before any other save,
    or at the end of training); :meth:`restore` removes it without waiting (train() failed)."""

    def __init__(self, engine: Any, staged: StagedSave, ckpt: Path, *, record: Callable[[float], None],
                 feed: Callable[[str], None], watchdog_bound_s: Callable[[], float | None]) -> None:
        """``feed``: the hang watchdog's boundary (a wait for the copies has a save's bound, not a step's);
        ``watchdog_bound_s``: that bound now (None: no watchdog)."""
        self.engine, self.staged, self.ckpt = engine, staged, ckpt
        self.record, self.feed, self.watchdog_bound_s = record, feed, watchdog_bound_s
        self._own = engine.__dict__.get("step")  # an instance attribute of someone else's, put back as it was
        self._original = engine.step
        self._open = False
        engine.step = self._step

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        self.open()
        return self._original(*args, **kwargs)

    def open(self) -> None:
        """Wait for the copies (however they ended) within the bound, remove the gate, record; at most once.
        Raises :class:`CopyWaitTimeout` (the gate removed) when they are not done within it."""
        if self._open:
            return
        self._open = True
        t0 = time.monotonic()
        bound_s = None
        if not self.staged.copied:
            self.feed("save")
            bound_s = copy_wait_bound_s(self.staged.nbytes, self.watchdog_bound_s())
            done = self.staged.wait_copied(bound_s)
            self.feed("step")
            if not done:
                self.restore()
                raise CopyWaitTimeout(self._timeout_line(bound_s))
        self.restore()
        self.record(time.monotonic() - t0)

    def restore(self) -> None:
        """The engine's ``step`` its own again, without waiting (a wrapper put on meanwhile, which calls us, stays)."""
        self._open = True
        if self.engine.__dict__.get("step") == self._step:
            if self._own is not None:
                self.engine.step = self._own
            else:
                del self.engine.step

    def _timeout_line(self, bound_s: float) -> str:
        return (f"slurm_jit: DeepSpeed's optimizer step waited {bound_s:.0f} s for the staging copies of the async "
                f"save {self.ckpt} ({self.staged.nbytes} bytes) and they are not done: a device-to-host copy "
                "queued behind a kernel that never ends (a collective whose peer was lost) or a stalled host. "
                f"{self.ckpt.name} stays incomplete; earlier checkpoints are untouched. HINT: the other ranks' "
                "first error says whether a peer was lost; JitConfig(async_periodic_saves=False) saves with no "
                "deferred copies")
