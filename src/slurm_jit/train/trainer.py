"""``slurm_jit.JitTrainer``: a drop-in ``transformers.Trainer`` that survives SIGTERM with a JIT checkpoint.

On a stop signal (SIGTERM by default) every rank agrees on one optimizer step
(:mod:`slurm_jit.train.agreement`), a checkpoint of exactly that step is written through the crash-safe protocol
(:mod:`slurm_jit.checkpoint.protocol`), the stop record (:mod:`slurm_jit.train.stop_record`) says ``jit_stop`` so
that the job can be requeued, and the process exits with status 0 (``JitConfig(exit_after_jit_stop=False)``:
``train()`` returns and ``trainer.jit_stopped`` is True).
``train(resume_from_checkpoint=True)`` resumes from the newest checkpoint that ``ckpt-check`` calls resumable, or
starts fresh when there is none.

Where a stop lands:

- only after an optimizer step, where the Trainer's ``global_step`` and the DeepSpeed engine's step agree (never
  inside gradient accumulation, never in ``on_pre_optimizer_step``, where upstream saves step S+1's state as S);
- during evaluation: the evaluation loop is aborted at the next batch, then the checkpoint is written;
- during a periodic save: the save finishes, and training stops there without a second checkpoint of that step;
- before the first step: training returns at once and writes no new checkpoint;
- at the last step: nothing to stop; training finishes normally (final evaluation and save, ``finished``).

A stop records ``jit_stop`` right after the checkpoint's manifest, before anything upstream runs at the end of
training (best-model loading and Hub push waits are skipped on a JIT exit). Upstream never rotates or deletes a
checkpoint: rotation is ours, after the manifest (:func:`slurm_jit.train.save_path.rotate_checkpoints_safely`).

This module is the class users see; its body delegates, by concern, to the rooms of ``train/``, which take the
``session`` (the state they share, the upstream methods they call: ``session.py``), never this class's private
fields: ``run_state`` (one ``train()``'s state), ``jit_config`` (``JitConfig``), ``stop_path`` (the boundary
decision, the stop, the stop record), ``save_path`` (every save, the manifest, rotation), ``resume_path`` (pick,
refusals, elastic load), ``evaluation`` (aborted and owed evaluations, the best metric), ``exact_resume`` (RNG and
engine state restored).

Every Trainer method JitTrainer overrides, and why (signatures are transformers 5.24's; ``compat.TRAINER_HOOKS``
checks the private ones at construction):

==================================  ============================================================================
``train``                           signal latch; lock, pick, refuse, keep the global batch; stop record
``_get_dataloader``                 DataLoader workers ignore the stop signals, and are born with them blocked
``set_initial_training_values``     a resume's data position in samples: the steps left (data_position)
``_init_training_state``            ... and where the loop starts reading: epoch and batches skipped
``_maybe_log_save_evaluate``        the step boundary: the stop round, then the JIT save and stop (stop_path)
``_evaluate``                       an evaluation aborted by a stop leaves it owed (evaluation)
``prediction_step``                 polls the stop round at each evaluation batch, to abort (evaluation)
``_load_rng_state``                 the owed evaluation runs right after the RNG restore, as it would have
``_determine_best_metric``          an aborted evaluation has no metrics to call best
``evaluate``                        no evaluation moves training's random streams (exact_resume)
``_load_optimizer_and_scheduler``   the exact restore of the engine's state after DeepSpeed's load (exact_resume)
``_save_checkpoint``                every save through the protocol: sentinel, manifest, then rotation (save_path)
``save_model``                      a JIT save leaves out the consolidated weights unless asked (save_path)
``_finalize_training``              an async save in flight committed first; upstream's end-of-training deletion
                                    (save_total_limit=1) is turned off
``_load_best_model``                skipped after a JIT stop; across world sizes by the universal copy
``_finish_current_push``            a JIT stop does not wait for a Hub push in progress
``log``                             ``train_loss`` over the requeue chain, as the uninterrupted run's (every
                                    checkpoint keeps its logging window); no summary logged at a JIT stop
==================================  ============================================================================

The callbacks' ``on_save`` is called by the save, before or after the manifest (:mod:`slurm_jit.train.save_callbacks`).
"""

from __future__ import annotations

import functools
import logging
import uuid
from typing import Any

import transformers
from transformers.trainer_utils import TrainOutput

from slurm_jit.signal_names import parse_signal
from slurm_jit.timing import TimingLog
from slurm_jit.train import (
    compat,
    data_position,
    elastic,
    evaluation,
    exact_resume,
    exit_watch,
    frozen_weights,
    keep_batch,
    logging_window,
    output_lock,
    refusals,
    resume_path,
    save_path,
    slim_save,
    stop_path,
    stop_record,
    subclassing,
    writable,
)
from slurm_jit.train.async_save import periodic as async_periodic
from slurm_jit.train.async_save.saver import AsyncSaver
from slurm_jit.train.jit_config import JitConfig
from slurm_jit.train.refusals import JitRefusal, refused_settings
from slurm_jit.train.run_state import Run, StopBeforeFirstStep
from slurm_jit.train.save_path import FAULT_SAVE_SLEEP_ENV as FAULT_SAVE_SLEEP_ENV  # where tests set it
from slurm_jit.train.session import Hooks, Session
from slurm_jit.train.signals import SignalLatch, mask_workers
from slurm_jit.train.trackers import continue_wandb_run

logger = logging.getLogger(__name__)


class _JitCallback(transformers.TrainerCallback):
    def __init__(self, trainer: JitTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        logging_window.restore(self.trainer._jit_session)  # before the first step adds to it
        stop_path.on_train_begin(self.trainer._jit_session)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        evaluation.run_owed(self.trainer._jit_session)  # when no RNG restore ran it (ignore_data_skip)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        stop_path.on_step_end(self.trainer._jit_session)


def _already_called_on_save(args: Any, state: Any, control: Any) -> Any:
    return control


class JitTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` with rank-agreed JIT checkpoints, crash-safe saves and exact resume.

    Same constructor as ``Trainer`` plus ``jit_config``. With ``TrainingArguments(enable_jit_checkpoint=True)``
    transformers' own JIT callback is removed, never run beside this one.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        subclassing.refuse_wrong_order(cls, JitTrainer)  # class X(SFTTrainer, JitTrainer): one line, a HINT

    def __init__(self, *args: Any, jit_config: JitConfig | None = None, **kwargs: Any) -> None:
        # A transformers without the hooks below, or passing them what they cannot take, fails here, not at the
        # first stop
        subclassing.check_hooks(type(self), JitTrainer)
        # before upstream's os.makedirs (a traceback): a directory the launcher does not read, or one it cannot write
        unusable = refusals.output_dir_at_construction(args, kwargs) or writable.refusal_at_construction(args, kwargs)
        if unusable:
            raise JitRefusal(unusable)
        super().__init__(*args, **kwargs)
        self.jit_config = jit_config or JitConfig()
        self._jit_signums = tuple(parse_signal(s) for s in self.jit_config.signals)
        self._jit_held: Session | None = None  # from its first use to the end of the next train() (session.py)
        self.jit_stopped = False  # after train(): did it stop for a JIT checkpoint?
        compat.drop_upstream_jit(self.callback_handler)
        refusal = refused_settings(save_on_each_node=bool(self.args.save_on_each_node), ds_config=self._ds_config())
        refusal = refusal or keep_batch.refusal_at_construction(self) or async_periodic.refusal(self)
        refusal = refusal or refusals.output_dir_of_job(str(self.args.output_dir))  # no args: upstream's default
        if refusal:
            raise JitRefusal(f"slurm_jit: {refusal}")
        self.add_callback(_JitCallback(self))
        compat.shut_down_workers_at_exit(self)  # persistent workers ignore SIGTERM: exit must not wait on them
        compat.quiet_progress_bars(self)  # a Slurm job log gets one line per logging step, not tqdm redraws
        # Upstream calls on_save after _save_checkpoint returns; ours runs the callbacks from the save: before the
        # manifest those that may write into it (so that it lists what they write), after it the others (save_callbacks)
        self._upstream_on_save = self.callback_handler.on_save
        setattr(self.callback_handler, "on_save", _already_called_on_save)  # noqa: B010 - an instance override

    def _ds_config(self) -> dict[str, Any] | None:
        return self.accelerator.state.deepspeed_plugin.deepspeed_config if self.is_deepspeed_enabled else None

    @property
    def _jit_session(self) -> Session:
        if self._jit_held is None:  # the upstream methods the rooms call, bound late: an override is the one called
            self._jit_held = Session(self, JitTrainer, Hooks(
                save_checkpoint=lambda *a: self._save_checkpoint(*a), evaluate=lambda *a: self._evaluate(*a),
                determine_best_metric=lambda **k: self._determine_best_metric(**k),
                output_dir=lambda **k: self._get_output_dir(**k), ds_config=lambda: self._ds_config(),
                upstream_on_save=lambda *a: self._upstream_on_save(*a)), AsyncSaver)
        return self._jit_held

    @property
    def _jit_run(self) -> Run | None:  # this train()'s state, None outside one (reading it makes no session)
        return self._jit_held.run if self._jit_held is not None else None

    @property
    def jit_side_group_open(self) -> bool:
        """Whether the ranks' side group is open: from its first use (a train(), a save) to the next train()'s end."""
        return self._jit_held is not None and self._jit_held.open_agreement is not None

    def _get_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        loader = super()._get_dataloader(*args, **kwargs)
        if self.jit_config.ignore_signals_in_workers and self.args.dataloader_num_workers > 0:
            mask_workers(loader, self._jit_signums)
        return loader

    # ------------------------------------------------------------ train

    def train(  # type: ignore[override]
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        output = self._jit_train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        if self.jit_stopped and self.jit_config.exit_after_jit_stop:
            stop_path.exit_after_stop(int(self.args.process_index) == 0)  # nothing more runs in the grace period
        return output

    def _jit_train(self, resume_from_checkpoint: str | bool | None, trial: Any,
                   ignore_keys_for_eval: list[str] | None) -> TrainOutput:
        run = Run(latch=SignalLatch(self._jit_signums), trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)
        session = self._jit_session
        session.run = run
        self.jit_stopped = False
        run.latch.install()
        clean = False
        try:
            resume = self._jit_start(run, resume_from_checkpoint)
            try:
                with (compat.eval_on_start_once(self.args, resuming=resume is not None),
                      continue_wandb_run(self, resume)):
                    output = super().train(resume_from_checkpoint=run.load_from or resume, trial=trial,
                                           ignore_keys_for_eval=ignore_keys_for_eval)
            except StopBeforeFirstStep:
                output = TrainOutput(self.state.global_step, 0.0, {})
            self.jit_stopped = run.stopped
            if run.chain_first_step is not None and "train_loss" in (output.metrics or {}):  # the chain's
                loss = logging_window.chain_loss(self, run.chain_first_step)
                output = TrainOutput(output.global_step, loss, {**output.metrics, "train_loss": loss})
            stop_path.record_end(session, run)
            clean = True
            return output
        except BaseException as exc:
            stop_path.record_failure(session, run, exc)
            raise
        finally:
            self._jit_end(run, clean)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        run = self._jit_run
        if run is not None and run.finalizing and "train_loss" in logs:  # upstream's summary of the training
            if run.stopped:  # the training did not end: the run that finishes logs it, over the whole chain
                return
            if run.chain_first_step is not None:
                logs = {**logs, "train_loss": logging_window.chain_loss(self, run.chain_first_step)}
        super().log(logs, *args, **kwargs)

    def _jit_start(self, run: Run, resume_from_checkpoint: str | bool | None) -> str | None:
        """Before upstream's train(): the checkpoint to resume (resume_path), the timing log, ``running``."""
        out_dir, session = str(self.args.output_dir), self._jit_session
        slim_save.install_load()  # before elastic's universal load, which goes on top of it
        run.frozen = frozen_weights.at_start(self.model, session.is_rank0)  # once, before DeepSpeed casts it
        resume = resume_path.resolve(session, resume_from_checkpoint)  # sets run.checkpoint, run.resumed_from
        compat.continue_tensorboard_run(self, resume)
        run_id = session.agreement.broadcast(uuid.uuid4().hex[:12])  # one id for all ranks of this train()
        run.timing = TimingLog(out_dir, int(self.args.process_index), int(self.args.world_size), run_id)
        resume_path.record_timing(session, run)
        if session.is_rank0:
            stop_record.write(out_dir, "running", step=None, resumed_from=resume)
        return resume

    def _jit_end(self, run: Run, clean: bool) -> None:
        """Every train() ends here, whatever ended it."""
        try:
            self._jit_close(run, clean)
        finally:  # whatever raised above: a watchdog left running would end this process later (a notebook's)
            stop_path.stop_watchdog(run)
            session = self._jit_held
            if session is not None:
                session.run = None  # a background commit ending later reads no run, as outside train()
            if session is not None and session.open_agreement is None and session.output_lock is None:
                self._jit_held = None  # else the next train() closes what this one could not

    def _jit_close(self, run: Run, clean: bool) -> None:
        # First, as nothing below may raise before them: the load wrappers are for this train() only.
        elastic.uninstall_universal_load()
        slim_save.uninstall_load()
        session = self._jit_session
        session.saver.close_after_failure()  # after finish(): nothing left; after a failure: bounded
        # Every path closes the side group: a failed train() must not leave a round in flight for the next
        # one, nor a gloo group for the interpreter's exit. After a failure no barrier (a peer may be gone).
        session.close_agreement(clean)
        lock, session.output_lock = session.output_lock, None
        output_lock.release(lock)
        run.in_loop = False
        compat.shut_down_persistent_workers(self)
        # After a JIT stop the process is on its way out: a late signal (another node's copy, or Slurm's
        # second SIGTERM at the time limit) must not kill it mid-exit, so the stop signals stay ignored.
        # Otherwise the original handlers come back.
        run.latch.restore(keep_ignoring=run.stopped)
        if run.timing is not None:
            stop_path.record_stop_timing(self, run)
            run.timing.close()
            if run.stopped:  # from here to the process's end: the grace's exit term
                exit_watch.start(run.timing.path, {
                    **run.timing.base(), "event": "exit", "step": self.state.global_step})

    # ------------------------------------------------------------ the stop decision

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        run = self._jit_run
        upstream = functools.partial(super()._maybe_log_save_evaluate, *args, **kwargs)
        if run is None or not run.in_loop:
            upstream()
            return
        model, trial = args[2] if len(args) > 2 else kwargs["model"], args[3] if len(args) > 3 else None
        stop_path.log_save_evaluate(self._jit_session, run, upstream, model, trial)

    def _evaluate(self, trial: Any, ignore_keys_for_eval: Any, skip_scheduler: bool = False, *args: Any,
                  **kwargs: Any) -> dict[str, float]:
        # *args/**kwargs here and in the other pass-through hooks: what a newer Trainer adds goes through
        upstream = functools.partial(super()._evaluate, trial, ignore_keys_for_eval, skip_scheduler, *args, **kwargs)
        run = self._jit_run
        return upstream() if run is None or not run.in_loop else evaluation.evaluate_in_loop(self._jit_session, run,
                                                                                             upstream)

    def _load_rng_state(self, checkpoint: str | None, *args: Any, **kwargs: Any) -> None:
        super()._load_rng_state(checkpoint, *args, **kwargs)
        # The uninterrupted run evaluated before this point; its evaluation draws from the RNG (the DataLoader's
        # base seed), so the owed one runs right after the RNG is restored, before the next batch is trained on.
        evaluation.run_owed(self._jit_session)

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any, *args: Any, **kwargs: Any) -> bool:
        if evaluation.no_best_from_aborted(self._jit_session):
            return False  # no metrics from an aborted evaluation
        return bool(super()._determine_best_metric(metrics, trial, *args, **kwargs))

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        evaluation.abort_if_stopping(self._jit_session)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    # ------------------------------------------------------------ exact resume

    def set_initial_training_values(self, *args: Any, **kwargs: Any) -> Any:
        run = self._jit_run
        return data_position.training_values(self, run.data_position if run else None,
                                             super().set_initial_training_values(*args, **kwargs))

    def _init_training_state(self, *args: Any, **kwargs: Any) -> Any:
        run = self._jit_run
        started = super()._init_training_state(*args, **kwargs)
        return data_position.started(self, run.data_position if run else None, *started)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None, *args: Any, **kwargs: Any) -> None:
        # Trainer calls this right after DeepSpeed's load_checkpoint and before the first resumed step.
        super()._load_optimizer_and_scheduler(checkpoint, *args, **kwargs)
        run = self._jit_run
        frozen_weights.raise_deferred(run.frozen_refusal if run else None)
        if checkpoint is not None and self.is_deepspeed_enabled:
            exact_resume.restore(self.model_wrapped)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        # A JIT stop aborts or postpones the evaluation due at its step, which the uninterrupted run does in place:
        # evaluations must not move training's random streams (each eval DataLoader iterator draws a seed there).
        with exact_resume.rng_untouched():
            return dict(super().evaluate(*args, **kwargs))

    # ------------------------------------------------------------ the end of training

    def _finalize_training(self, trial: Any, num_train_samples: Any, start_time: Any, *args: Any,
                           **kwargs: Any) -> Any:
        # Upstream deletes every checkpoint-* but the best here when save_total_limit == 1 (the JIT checkpoint
        # and quarantined directories included): rotation is ours alone, after each manifest.
        self._jit_session.saver.finish()  # an async save in flight committed before the best model is loaded
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        run = self._jit_run
        if run is not None:
            run.finalizing = True  # its log() of train_loss is the summary (log), not a user's own train_loss
        try:
            return super()._finalize_training(trial, num_train_samples, start_time, *args, **kwargs)
        finally:
            self.args.save_total_limit = limit
            if run is not None:
                run.finalizing = False

    def _load_best_model(self, *args: Any, **kwargs: Any) -> None:
        if self._jit_run is not None and self._jit_run.stopped:
            logger.warning("slurm_jit: JIT stop: not loading the best model (%s); the job is on its way out",
                           self.state.best_model_checkpoint)
            return
        resume_path.load_best_model(self._jit_session, functools.partial(super()._load_best_model, *args, **kwargs))

    def _finish_current_push(self, *args: Any, **kwargs: Any) -> None:
        if self._jit_run is not None and self._jit_run.stopped:
            push = getattr(self, "push_in_progress", None)
            if push is not None and not push.is_done():
                logger.warning("slurm_jit: JIT stop: not waiting for the Hub push in progress")
            return
        super()._finish_current_push(*args, **kwargs)

    # ------------------------------------------------------------ saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not save_path.leaves_out_weights(self._jit_session, output_dir, _internal_call):
            super().save_model(output_dir, _internal_call=_internal_call)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        save_path.save_checkpoint(self._jit_session, model, trial, upstream=super()._save_checkpoint)


def with_jit(trainer_cls: type) -> type:
    """``slurm_jit.with_jit``: ``trainer_cls`` (TRL's SFTTrainer, ...) with JIT checkpoints (subclassing.py)."""
    return subclassing.with_jit(trainer_cls, JitTrainer)
