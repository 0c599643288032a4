"""When the callbacks' ``on_save`` runs: before a checkpoint's manifest where a callback may write into the
checkpoint, once the checkpoint is whole where it only reads it (issue #42 item 7).

transformers calls ``on_save`` right after ``_save_checkpoint`` returns. A JitTrainer checkpoint's manifest lists
every file with its checksum, so what a callback writes into ``checkpoint-N`` must be written before the manifest
(after it, a new file is unlisted and a rewritten one makes the checkpoint ``corrupt``), and what a callback reads
(an uploader: W&B with ``WANDB_LOG_MODEL=checkpoint``, MLflow, Neptune, ClearML, DVCLive, Flyte) must be read once
the checkpoint is whole, or an async save's background files are not there yet. So the callbacks are told in two
groups, on the training thread, on every rank:

- those that **may write** (:func:`may_write`: a callback whose class overrides ``on_save``, unless it is
  transformers' own or says ``slurm_jit_writes_checkpoint = False``) inside the save, before the manifest; a
  periodic save with such a callback is synchronous (:func:`sync_reason`);
- every other one once the checkpoint is complete on every rank: a synchronous save's after its manifest and the
  ranks' last barrier; an async save's at the first step boundary after its commit where the ranks agree that
  every rank's write is done, or in the wait of the next save, of a JIT stop or of the end of training, whichever
  comes first (:mod:`.async_save.periodic`). ``state.global_step`` and ``state.epoch`` are the checkpoint's during
  the call; the ``TrainerControl`` flags it sets act from there (``should_training_stop`` ends training at that
  boundary).

Either group is told through upstream's own ``CallbackHandler.on_save`` (the handler's callback list narrowed to
the group for the call), which also sets ``should_save`` back to False as upstream does after a save.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import transformers

if TYPE_CHECKING:
    from slurm_jit.train.session import JitTrainerLike, Session

logger = logging.getLogger(__name__)

WRITES_ATTR = "slurm_jit_writes_checkpoint"  # a callback's (or its class's) word on what its on_save does
# transformers' own callbacks upload or log checkpoint-N from on_save, never write into it (integration_utils.py)
READ_ONLY_MODULE_PREFIX = "transformers."


def may_write(callback: Any) -> bool:
    """Whether ``callback``'s ``on_save`` may write into the checkpoint: what it says (:data:`WRITES_ATTR`), else
    True for an ``on_save`` of its own that is not transformers'."""
    said = getattr(callback, WRITES_ATTR, None)
    return bool(said) if said is not None else class_may_write(type(callback))


def class_may_write(cls: type) -> bool:
    """Whether the ``on_save`` of callbacks of ``cls`` may write into the checkpoint, where they do not say."""
    if getattr(cls, "on_save", None) is transformers.TrainerCallback.on_save:
        return False
    return not cls.__module__.startswith(READ_ONLY_MODULE_PREFIX)


def sync_reason(trainer: JitTrainerLike) -> str | None:
    """Why a periodic save of this trainer must be synchronous (one line with a HINT), or None."""
    names = sorted({type(cb).__name__ for cb in trainer.callback_handler.callbacks if may_write(cb)})
    if not names:
        return None
    return (f"slurm_jit: periodic checkpoints written synchronously: the on_save of {', '.join(names)} may write "
            "into the checkpoint, which must come before its manifest. HINT: a callback whose on_save only reads "
            f"checkpoint-N (an upload) says so with {WRITES_ATTR} = False on its class, and is told once the "
            "checkpoint is whole")


def run_writers(session: Session) -> None:
    """Inside a save, before the manifest: the ``on_save`` of the callbacks that may write into the checkpoint."""
    trainer = session.trainer
    _on_save(session, [cb for cb in trainer.callback_handler.callbacks if may_write(cb)])


def tell_readers(session: Session, step: int, epoch: float | None) -> None:
    """Once checkpoint-``step`` is complete on every rank: the ``on_save`` of every other callback, with the
    state's ``global_step`` and ``epoch`` the checkpoint's for the call (``should_save`` as it was: the step's
    own save decision, where this runs at a later step boundary)."""
    trainer = session.trainer
    state, control = trainer.state, trainer.control
    now, keep_save = (state.global_step, state.epoch), control.should_save
    state.global_step = step
    if epoch is not None:
        state.epoch = epoch
    try:
        _on_save(session, [cb for cb in trainer.callback_handler.callbacks if not may_write(cb)])
    finally:
        state.global_step, state.epoch = now
        trainer.control.should_save = keep_save


def _on_save(session: Session, callbacks: list[Any]) -> None:
    trainer = session.trainer
    handler = trainer.callback_handler
    every = handler.callbacks
    handler.callbacks = callbacks  # upstream's call_event over the group (its keyword arguments, its control)
    try:
        trainer.control = session.hooks.upstream_on_save(trainer.args, trainer.state, trainer.control)
    finally:
        if handler.callbacks is callbacks:  # else a callback replaced the list itself: its change stays
            handler.callbacks = every
