"""The state of one ``JitTrainer.train()`` call, shared by the trainer's rooms (stop, save, resume, evaluation).

Owns :class:`Run` (what this ``train()`` has seen, decided and written) and the two exceptions that leave the
Trainer's loop early; the rooms of ``train/`` reach the run through the session (``session.run``).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any

from slurm_jit.grace.calc import AGREE_BLOCKING
from slurm_jit.timing import TimingLog
from slurm_jit.train.data_position import Tracker
from slurm_jit.train.signals import SignalLatch
from slurm_jit.train.watchdog import Watchdog

LINEAGE_ID_CHARS = 12  # hex digits of a training lineage id (the manifest's run_id)


class StopBeforeFirstStep(Exception):
    """Raised when a stop was agreed before this run's first step: in on_train_begin, or during an evaluation
    that runs before it (the one owed on resume, eval_on_start)."""


class EvalAborted(Exception):
    """Raised from prediction_step when a stop was agreed during evaluation."""


def signal_name(signum: int | None) -> str | None:
    return signal.Signals(signum).name if signum is not None else None


@dataclass
class Run:
    """The state of one ``train()`` call."""

    latch: SignalLatch
    timing: TimingLog | None = None
    in_loop: bool = False  # between on_train_begin and the end of the training loop
    polled_step: int = -1  # the global_step of the last step-boundary poll
    stop_now: bool = False  # a stop has been agreed
    kill_wait_until: float = 0.0  # monotonic time when kill_wait since the earliest signal (any rank) has passed
    stopped: bool = False  # training stopped for a JIT checkpoint
    eval_aborted: bool = False
    eval_owed: bool = False  # an evaluation due at the stop step was skipped or aborted: run it first on resume
    owed_eval_step: int | None = None  # resumed from a checkpoint that owes the evaluation of this step
    lineage: str = ""  # the manifest's run_id: carried from the checkpoint resumed from, new on a fresh start
    resumed_from: str | None = None  # kept by rotation until this run has written a newer checkpoint
    load_from: str | None = None  # what the Trainer loads when not resumed_from: its universal copy (elastic.py)
    conversion: dict[str, Any] | None = None  # rank 0: the conversion this start did, for the timing log
    kept_batch: dict[str, int] | None = None  # the accumulation changed to keep the global batch (keep_batch.py)
    # What later manifests record: this run's change, else the resumed checkpoint's (a process whose args already
    # hold the changed accumulation, e.g. a second train(), changes nothing but must not drop it from the chain)
    batch_record: dict[str, int] | None = None
    user_batch: dict[str, int] | None = None  # the user's change of the batch, trained with (keep_batch.UserBatch)
    data_position: Tracker = field(default_factory=Tracker)  # where in the data this run is (data_position.py)
    stop_recorded: bool = False  # rank 0 wrote jit_stop (right after the stop checkpoint's manifest)
    finish_recorded: bool = False  # rank 0 wrote finished (train() returned): a hang after it keeps the record
    trackers_told: bool = False  # the trackers (W&B, TensorBoard) were told how this job ended
    trial: Any = None
    ignore_keys_for_eval: list[str] | None = None
    grace_due: list[str] = field(default_factory=list)  # runtime grace checks to run at the next calm boundary
    saved_step: int = -1  # the step of the last checkpoint written by this run
    saved_contents: str = "full"  # what it holds: full, or model_only (save_only_model)
    save_kind: str | None = None
    checkpoint: str | None = None  # the checkpoint to resume from after this run
    step_t0: float = field(default_factory=time.monotonic)
    est_step_s: float = 0.0  # duration of the last step: how far ahead a stop wish is sent
    steps_done: int = 0
    signal_step: int | None = None  # the step boundary at which this rank first saw its signal
    save_started_at: float | None = None  # monotonic times of the JIT save (after the kill_wait sleep)
    save_ended_at: float | None = None
    agreement_mode: str = AGREE_BLOCKING  # how this boundary's stop rounds are read (fixed after warm-up)
    grace_checked: set[str] = field(default_factory=set)
    frozen: Any = None  # rank 0: the frozen weights' fingerprint (frozen_weights.py), computed at the start
    frozen_refusal: str | None = None  # every rank: a frozen-weights refusal raised after the load (not before)
    watchdog: Watchdog | None = None  # this rank's hang watchdog, from the first step until train() ends
    async_saves: Any = None  # JitConfig(async_periodic_saves=True): train/async_save/in_flight.py's AsyncSaves
    hung: bool = False  # the watchdog fired: the process is writing its hang record and exiting
    chain_first_step: int | None = None  # the first step of this requeue chain's training (logging_window.py)
    capture_window: Any = None  # () -> this rank's logging_window.Window now (the trainer reads upstream's fields)
    finalizing: bool = False  # inside upstream's _finalize_training: its train_loss log is the training's summary
