"""What an async periodic save in flight is, and the state of one ``train()``'s async saves (``Run.async_saves``):
the data the saver (:mod:`.periodic`), the JIT stop's wait (:mod:`.stop_wait`) and the callbacks' claim
(:mod:`.claim`) share, below all three."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from slurm_jit.train.async_save import step_gate
from slurm_jit.train.async_save.staging import HostStager
from slurm_jit.train.async_save.writer import BackgroundWriter

SET_ASIDE_FILE_UNMEASURED_S = 5.0  # no file write measured yet (a fresh output_dir's first save in flight)


class CommitGate:
    """Rank 0's commit of one async save against a JIT stop's set-aside: whichever comes first wins, for good."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sealing = False
        self._closed = False
        self.stop_asked = False  # a JIT stop came for it: the commit, if kept, leaves the rotation to the JIT save

    def enter_seal(self) -> bool:
        """The writer's thread, before the manifest: False once the save was set aside (no manifest then)."""
        with self._lock:
            self._sealing = not self._closed
            return self._sealing

    def close(self) -> bool:
        """The training thread, setting the save aside: True when no manifest will be written for it; False when
        the commit has already begun it (every rank's files are durable: the save is kept)."""
        with self._lock:
            self.stop_asked = True
            self._closed = not self._sealing
            return self._closed


@dataclass(frozen=True)
class WriteHistory:
    """The background writes of the earlier runs of an output_dir (its timing log), each save's slowest rank."""

    longest_write_s: float = 0.0  # write + fsync + commit (a set-aside write's time so far: at least that)
    file_max_s: float | None = None  # the longest one file took (None: not recorded)


@dataclass
class InFlight:
    """One async save from its submission until the training thread has seen it committed."""

    step: int
    ckpt: Path
    contents: str
    kind: str
    submitted_at: float
    nbytes: int
    after_s: float = 0.0  # the background thread's marker, and on rank 0 the wait for the others and the commit
    gate: step_gate.StepGate | None = None  # DeepSpeed's next optimizer step held until the deferred copies are done
    commit_gate: CommitGate = field(default_factory=CommitGate)  # rank 0's manifest vs a set-aside
    epoch: float | None = None  # the state's epoch at the save: what the callbacks' on_save is told with it


@dataclass
class AsyncSaves:
    """The async periodic saves of one ``train()`` (``Run.async_saves``)."""

    stager: HostStager
    writer: BackgroundWriter
    disabled: bool = False  # a HostMemoryError: synchronous saves from then on
    in_flight: InFlight | None = None
    waited_s: float = 0.0  # the last wait for a save in flight (the next save's blocked time includes it)
    longest_write_s: float = 0.0  # of this run's background writes, commit included: what a JIT save may need
    longest_file_s: float | None = None  # of this run's background writes, the longest one file took
    earlier: WriteHistory = field(default_factory=WriteHistory)  # rank 0: the runs before
    set_aside: Path | None = None  # a save in flight a JIT stop did not wait for (stop_wait.py): never claimed
    set_aside_wait_s: float = SET_ASIDE_FILE_UNMEASURED_S  # the end of train()'s wait for its last file
    sync_said: bool = False  # the line saying why periodic saves are synchronous (a callback that may write) logged
    closed: bool = False
    abort: threading.Event = field(default_factory=threading.Event)  # rank 0's commit gives up (a peer lost)
