"""What the trainer's rooms share: one :class:`Session` per ``JitTrainer``, from its first use to the end of the next
``train()``.

The rooms of ``train/`` (the stop, the saves, the resume, the evaluation, the records) take a session, never the
trainer's private fields: it owns this ``train()``'s :class:`~slurm_jit.train.run_state.Run`, the rank facts, the
side group's agreement, rank 0's lock on the output directory; the rooms reach the ``Trainer`` through its public
attributes (``session.trainer.args``, ``.state``, ``.model``, ...) and through :class:`Hooks`, the few upstream
methods they call, bound late so that a user's subclass overriding one is still the one called.

The agreement is created at its first use (creating it is a collective: every rank gets there in the same order)
and closed with the session, at the end of ``train()`` (``JitTrainer._jit_end``); a save outside ``train()`` (a
user's own ``_save_checkpoint`` call) uses a session that the next ``train()`` takes over and closes, as it did
before sessions existed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from slurm_jit.train.agreement import StopAgreement
from slurm_jit.train.output_lock_record import OutputLock
from slurm_jit.train.run_state import Run

# The JitTrainer as the rooms see it: its public attributes (its class would import trainer.py, a cycle)
JitTrainerLike = Any


@dataclass(frozen=True)
class Hooks:
    """The upstream (and overridable) methods of the trainer the rooms call, each bound late in ``trainer.py``."""

    save_checkpoint: Callable[[Any, Any], None]  # Trainer._save_checkpoint(model, trial): the JIT save's
    evaluate: Callable[..., dict[str, float]]  # Trainer._evaluate(trial, ignore_keys_for_eval): an owed evaluation
    determine_best_metric: Callable[..., bool]  # Trainer._determine_best_metric(metrics=, trial=)
    output_dir: Callable[..., str]  # Trainer._get_output_dir(trial=): where checkpoint-N goes
    upstream_on_save: Callable[[Any, Any, Any], Any]  # the callback handler's on_save, which the trainer took over
    ds_config: Callable[[], dict[str, Any] | None]  # the DeepSpeed config in use, None without DeepSpeed


class Saver(Protocol):
    """The async periodic saves as the save and stop paths call them (``async_save/saver.py``'s AsyncSaver): the
    paths do not import the saver, which calls them."""

    def before_save(self) -> None: ...
    def collecting(self, kind: str, ckpt: Path) -> contextlib.AbstractContextManager[Any]: ...
    def submit(self, collected: Any, ckpt: Path, step: int, kind: str, phases: Any, t0: float, *,
               fields: dict[str, Any]) -> bool: ...
    def in_flight_step(self) -> int | None: ...
    def in_flight_contents(self, step: int) -> str | None: ...
    def done_step(self) -> int: ...
    def tell_committed(self, agreed_step: int) -> None: ...
    def finish(self) -> None: ...
    def close_after_failure(self) -> None: ...


class Session:
    """The state the rooms share, one owner for each piece (the module docstring)."""

    def __init__(self, trainer: Any, jit_class: type, hooks: Hooks, saver: Callable[[Session], Saver]) -> None:
        self.trainer = trainer  # the JitTrainer: its public attributes only
        self.jit_class = jit_class  # JitTrainer itself: whether one of its methods is overridden (async_save/collect)
        self.hooks = hooks
        self.run: Run | None = None  # this train()'s state, between its start and its end
        self.output_lock: OutputLock | None = None  # rank 0, during train(): the output_dir's lock (resume_path)
        self._agreement: StopAgreement | None = None
        self.saver = saver(self)  # the async periodic saves (async_save/saver.py), made last

    @property
    def is_rank0(self) -> bool:
        """The one notion of rank 0: the global process index (the rank that writes records and manifests)."""
        return int(self.trainer.args.process_index) == 0

    @property
    def agreement(self) -> StopAgreement:
        """The side group's agreement, created at the first use (a collective)."""
        if self._agreement is None:
            self._agreement = StopAgreement(self.trainer.jit_config.side_group_timeout_s)
        return self._agreement

    @property
    def open_agreement(self) -> StopAgreement | None:
        """The agreement if one was created and is not closed yet (reading it creates nothing)."""
        return self._agreement

    def close_agreement(self, clean: bool) -> None:
        """Close the side group; after a failure without the last barrier (a peer may be gone)."""
        agreement, self._agreement = self._agreement, None
        if agreement is not None:
            agreement.close(wait_for_peers=clean)
