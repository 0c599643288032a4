"""``slurm_jit.JitTrainer``: a drop-in ``transformers.Trainer`` that survives SIGTERM with a JIT checkpoint.

On a stop signal (SIGTERM by default) every rank agrees on one optimizer step
(:mod:`slurm_jit.train.agreement`), a checkpoint of exactly that step is written through the crash-safe protocol
(:mod:`slurm_jit.checkpoint.protocol`), ``train()`` returns normally and the stop record
(:mod:`slurm_jit.train.stop_record`) says ``jit_stop`` so that the job can be requeued.
``train(resume_from_checkpoint=True)`` resumes from the newest checkpoint that ``ckpt-check`` calls resumable, or
starts fresh when there is none.

Where a stop lands:

- only after an optimizer step, where the Trainer's ``global_step`` and the DeepSpeed engine's step agree (never
  inside gradient accumulation, never in ``on_pre_optimizer_step``, where upstream saves step S+1's state as S);
- during evaluation: the evaluation loop is aborted at the next batch, then the checkpoint is written;
- during a periodic save: the save finishes, and training stops there without a second checkpoint of that step;
- before the first step: training returns at once and writes no new checkpoint;
- after the last step: nothing more to do.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import transformers
from transformers.trainer_utils import TrainOutput

from slurm_jit.checkpoint import protocol
from slurm_jit.signal_names import parse_signal
from slurm_jit.timing import WARMUP_STEPS, TimingLog
from slurm_jit.train import exact_resume, runtime_grace, stop_record
from slurm_jit.train.agreement import SIDE_GROUP_TIMEOUT_S, Decision, StopAgreement
from slurm_jit.train.signals import IgnoreSignalsInWorker, SignalLatch

logger = logging.getLogger(__name__)

FAULT_SAVE_SLEEP_ENV = "SLURM_JIT_FAULT_SAVE_SLEEP_S"  # fault injection: seconds to stall inside every save
DEFAULT_KILL_WAIT_S = 3.0  # transformers' kill_wait: a SIGKILL this soon after SIGTERM makes a save pointless
# Files that hold the model weights again beside the fp32 master copy in the optimizer shards: what a JIT save
# writes over the minimum a resume needs (the DeepSpeed format requires its model-states file).
DUPLICATE_WEIGHT_RE = re.compile(
    r"^(mp_rank_\d+_model_states\.pt|model(-\d+-of-\d+)?\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin)$"
)


@dataclass(frozen=True, kw_only=True)
class JitConfig:
    """How JitTrainer reacts to stop signals."""

    kill_wait_s: float = DEFAULT_KILL_WAIT_S  # a checkpoint is started only this long after the first signal
    signals: tuple[str, ...] = ("TERM",)  # signal names that request a JIT stop (e.g. ("TERM", "USR1"))
    jit_save_model_weights: bool = False  # also write model.safetensors (under ZeRO-3: gather 16-bit weights)
    ignore_signals_in_workers: bool = True  # DataLoader workers ignore the stop signals
    grace_check: bool = True  # under Slurm, warn when the signal lead is shorter than the grace needed
    side_group_timeout_s: float = SIDE_GROUP_TIMEOUT_S  # timeout of the gloo side group's collectives

    def __post_init__(self) -> None:
        if not (math.isfinite(self.kill_wait_s) and self.kill_wait_s >= 0):
            raise ValueError(f"kill_wait_s={self.kill_wait_s!r}. HINT: a number of seconds >= 0, e.g. 3")
        if not self.signals:
            raise ValueError("signals is empty. HINT: signals=('TERM',)")
        for name in self.signals:
            if parse_signal(name) in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(f"{name} cannot be caught. HINT: use TERM or USR1")


def _signal_name(signum: int | None) -> str | None:
    return signal.Signals(signum).name if signum is not None else None


class _StopBeforeFirstStep(Exception):
    """Raised from on_train_begin when a stop was agreed before the first step."""


class _EvalAborted(Exception):
    """Raised from prediction_step when a stop was agreed during evaluation."""


@dataclass
class _Run:
    """The state of one ``train()`` call."""

    latch: SignalLatch
    timing: TimingLog | None = None
    in_loop: bool = False  # between on_train_begin and the end of the training loop
    polled_step: int = -1  # the global_step of the last step-boundary poll
    stop_now: bool = False  # a stop has been agreed
    kill_wait_until: float = 0.0  # monotonic time when kill_wait since the earliest signal (any rank) has passed
    stopped: bool = False  # training stopped for a JIT checkpoint
    eval_aborted: bool = False
    saved_step: int = -1  # the step of the last checkpoint written by this run
    save_kind: str | None = None
    checkpoint: str | None = None  # the checkpoint to resume from after this run
    step_t0: float = field(default_factory=time.monotonic)
    est_step_s: float = 0.0  # duration of the last step: how far ahead a stop wish is sent
    steps_done: int = 0
    grace_checked: set[str] = field(default_factory=set)


class _JitCallback(transformers.TrainerCallback):
    def __init__(self, trainer: JitTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._jit_on_train_begin()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._jit_on_step_end()


class JitTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` with rank-agreed JIT checkpoints, crash-safe saves and exact resume.

    Same constructor as ``Trainer`` plus ``jit_config``. With ``TrainingArguments(enable_jit_checkpoint=True)``
    transformers' own JIT callback is removed, never run beside this one.
    """

    def __init__(self, *args: Any, jit_config: JitConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.jit_config = jit_config or JitConfig()
        self._jit_signums = tuple(parse_signal(s) for s in self.jit_config.signals)
        self._jit_agreement: StopAgreement | None = None
        self._jit_run: _Run | None = None
        self.jit_stopped = False  # after train(): did it stop for a JIT checkpoint?
        self._drop_upstream_jit()
        self.add_callback(_JitCallback(self))

    # ------------------------------------------------------------ set-up

    def _drop_upstream_jit(self) -> None:
        for callback in list(self.callback_handler.callbacks):
            if type(callback).__name__ != "JITCheckpointCallback":
                continue
            manager = getattr(callback, "jit_manager", None)
            previous = getattr(manager, "_original_sigterm_handler", None)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self.callback_handler.remove_callback(callback)
            logger.warning("slurm_jit: replaced transformers' JIT checkpoint callback (enable_jit_checkpoint=True)")

    @property
    def _agreement(self) -> StopAgreement:
        if self._jit_agreement is None:
            self._jit_agreement = StopAgreement(self.jit_config.side_group_timeout_s)
        return self._jit_agreement

    @property
    def _is_rank0(self) -> bool:
        return int(self.args.process_index) == 0

    def _get_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        loader = super()._get_dataloader(*args, **kwargs)
        if self.jit_config.ignore_signals_in_workers and self.args.dataloader_num_workers > 0:
            # accelerate's DataLoaderAdapter delegates to the torch DataLoader it wraps: set it there.
            base = getattr(loader, "base_dataloader", loader)
            base.worker_init_fn = IgnoreSignalsInWorker(base.worker_init_fn, self._jit_signums)
        return loader

    # ------------------------------------------------------------ train

    def train(  # type: ignore[override]
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        run = _Run(latch=SignalLatch(self._jit_signums))
        self._jit_run = run
        self.jit_stopped = False
        out_dir = str(self.args.output_dir)
        run.latch.install()
        try:
            resume = self._resolve_resume(resume_from_checkpoint)
            run.checkpoint = resume
            run_id = self._agreement.broadcast(uuid.uuid4().hex[:12])  # one id for all ranks of this run
            run.timing = TimingLog(out_dir, int(self.args.process_index), int(self.args.world_size), run_id)
            if self._is_rank0:
                stop_record.write(out_dir, "running", step=None, resumed_from=resume)
            try:
                output = super().train(resume_from_checkpoint=resume, trial=trial,
                                       ignore_keys_for_eval=ignore_keys_for_eval)
            except _StopBeforeFirstStep:
                output = TrainOutput(self.state.global_step, 0.0, {})
            self._agreement.close()
            self._jit_agreement = None
            self.jit_stopped = run.stopped
            if self._is_rank0:
                state = "jit_stop" if run.stopped else "finished"
                stop_record.write(out_dir, state, step=self.state.global_step, checkpoint=run.checkpoint,
                                  signal=_signal_name(run.latch.first_signum))
            return output
        except BaseException as exc:
            if self._is_rank0:
                stop_record.write(out_dir, "failed", step=getattr(self.state, "global_step", None),
                                  error=f"{type(exc).__name__}: {exc}"[:2000])
            raise
        finally:
            run.in_loop = False
            # After a JIT stop the process is on its way out: a late signal (another node's copy, or Slurm's
            # second SIGTERM at the time limit) must not kill it mid-exit, so the stop signals stay ignored.
            # Otherwise the original handlers come back.
            run.latch.restore(keep_ignoring=run.stopped)
            if run.timing is not None:
                run.timing.close()
            self._jit_run = None

    def _resolve_resume(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """``True``: rank 0 picks the newest resumable checkpoint (as ckpt-check does) and tells every rank."""
        if resume_from_checkpoint is not True:
            return resume_from_checkpoint or None
        decision = None
        if self._is_rank0:
            resolution = protocol.find_resumable(str(self.args.output_dir))
            for ckpt in resolution.passed_over:
                logger.warning("slurm_jit: passing over %s: %s (%s)", ckpt.path, ckpt.status.value, ckpt.reason)
            if resolution.checkpoint is None:
                logger.warning("slurm_jit: no resumable checkpoint in %s: starting fresh", self.args.output_dir)
            else:
                decision = str(resolution.checkpoint.path)
                logger.warning("slurm_jit: resuming from %s (%s)", decision, resolution.checkpoint.status.value)
        return self._agreement.broadcast(decision)

    # ------------------------------------------------------------ the stop decision

    def _wish(self) -> tuple[bool, float | None]:
        """(stop, remaining kill_wait): this rank wants to stop once kill_wait since its first signal will have
        passed by the next boundary, where the answer of this round is read."""
        run = self._jit_run
        if run is None or run.latch.first_at is None:
            return False, None
        remaining_s = run.latch.first_at + self.jit_config.kill_wait_s - time.monotonic()
        return run.est_step_s >= remaining_s, remaining_s

    def _take(self, decision: Decision) -> bool:
        """Record an agreed stop and when kill_wait (since the earliest signal on any rank) will have passed."""
        run = self._jit_run
        if decision.stop and run is not None and not run.stop_now:
            run.stop_now = True
            run.kill_wait_until = time.monotonic() + decision.wait_s
        return decision.stop

    def _jit_on_train_begin(self) -> None:
        run = self._jit_run
        if run is None:
            return
        if self._agreement.agree_now(run.latch.seen).stop:
            run.stopped = True
            logger.warning("slurm_jit: stop signal before the first step: exiting without a new checkpoint")
            raise _StopBeforeFirstStep
        run.in_loop = True
        run.step_t0 = time.monotonic()

    def _jit_on_step_end(self) -> None:
        run = self._jit_run
        if run is None:
            return
        run.est_step_s = time.monotonic() - run.step_t0
        run.steps_done += 1
        if run.timing is not None:
            run.timing.step(self.state.global_step, run.est_step_s)
        if run.steps_done == WARMUP_STEPS + 1:
            self._grace_check("warm-up")

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        run = self._jit_run
        if run is None or not run.in_loop:
            super()._maybe_log_save_evaluate(*args, **kwargs)
            return
        step = self.state.global_step
        last_step = bool(self.state.max_steps) and step >= self.state.max_steps  # training ends here anyway
        if step != run.polled_step:  # once per optimizer step; epoch ends call this again at the same step
            run.polled_step = step
            self._take(self._agreement.poll(*self._wish()))
        if run.stop_now and not last_step:
            self.control.should_evaluate = False
            self.control.should_save = False
        super()._maybe_log_save_evaluate(*args, **kwargs)
        if not run.stop_now and run.saved_step == step:
            # A periodic save just ended: a stop that came during it is taken here, not a step later.
            self._take(self._agreement.agree_now(*self._wish()))
        if (run.stop_now or run.eval_aborted) and not last_step:
            if run.saved_step != step:
                self._save_jit(args[2] if len(args) > 2 else kwargs["model"], args[3] if len(args) > 3 else None)
            run.checkpoint = str(Path(self._get_output_dir(trial=None)) / f"checkpoint-{step}")
            run.stopped = True
            self.control.should_training_stop = True
        else:
            run.step_t0 = time.monotonic()

    def _evaluate(self, trial: Any, ignore_keys_for_eval: Any, skip_scheduler: bool = False) -> dict[str, float]:
        run = self._jit_run
        if run is None or not run.in_loop:
            return super()._evaluate(trial, ignore_keys_for_eval, skip_scheduler=skip_scheduler)
        t0 = time.monotonic()
        try:
            metrics = super()._evaluate(trial, ignore_keys_for_eval, skip_scheduler=skip_scheduler)
        except _EvalAborted:
            run.eval_aborted = True
            metrics = {}
            logger.warning("slurm_jit: evaluation aborted at step %d for a JIT checkpoint", self.state.global_step)
        else:
            self._take(self._agreement.agree_now(*self._wish()))
        if run.timing is not None:
            run.timing.evaluation(self.state.global_step, time.monotonic() - t0, run.eval_aborted)
        return metrics

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool:
        if self._jit_run is not None and self._jit_run.eval_aborted:
            return False  # no metrics from an aborted evaluation
        return bool(super()._determine_best_metric(metrics=metrics, trial=trial))

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        run = self._jit_run
        if run is not None and run.in_loop and self._take(self._agreement.poll(*self._wish())):
            raise _EvalAborted
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    # ------------------------------------------------------------ exact resume

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # Trainer calls this right after DeepSpeed's load_checkpoint and before the first resumed step.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.is_deepspeed_enabled:
            exact_resume.restore(self.model_wrapped)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        # A JIT stop skips the evaluation due at its step, which the uninterrupted run does: evaluations must
        # not move training's random streams (each eval DataLoader iterator draws its base seed from them).
        with exact_resume.rng_untouched():
            return dict(super().evaluate(*args, **kwargs))

    # ------------------------------------------------------------ saving

    def _save_jit(self, model: Any, trial: Any) -> None:
        run = self._jit_run
        assert run is not None
        engine_step = getattr(self.model_wrapped, "global_steps", None) if self.is_deepspeed_enabled else None
        if engine_step is not None and engine_step != self.state.global_step:
            raise RuntimeError(
                f"slurm_jit: DeepSpeed engine at step {engine_step} but Trainer at {self.state.global_step}; "
                "refusing a checkpoint whose name and contents would disagree"
            )
        remaining_s = run.kill_wait_until - time.monotonic()  # the wish was sent a step ahead of kill_wait
        if remaining_s > 0:
            time.sleep(remaining_s)
        run.save_kind = "jit"
        try:
            self._save_checkpoint(model, trial)
        finally:
            run.save_kind = None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        run = self._jit_run
        if _internal_call and run is not None and run.save_kind == "jit" and not self.jit_config.jit_save_model_weights:
            # A resume reads the DeepSpeed shards; the consolidated weights would be a third copy (and a ZeRO-3
            # gather). Keep the config so that the directory still says what model it holds.
            if self.is_deepspeed_enabled:
                config = getattr(self.model, "config", None)
                if self._is_rank0 and output_dir and config is not None:
                    config.save_pretrained(output_dir)
                return
        super().save_model(output_dir, _internal_call=_internal_call)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        run = self._jit_run
        step = self.state.global_step
        if run is not None and run.saved_step == step:
            return  # this step is already saved by this run
        kind = (run.save_kind if run and run.save_kind else None) or (
            "final" if self.state.max_steps and step >= self.state.max_steps else "periodic")
        run_dir = Path(self._get_output_dir(trial=trial))
        ckpt = run_dir / f"checkpoint-{step}"
        t0 = time.monotonic()
        if self._is_rank0:
            if os.path.lexists(ckpt):
                aside = protocol.quarantine_path(ckpt)
                logger.warning("slurm_jit: %s exists from an earlier run: moved to %s", ckpt, aside)
                os.rename(ckpt, aside)
            protocol.write_sentinel(ckpt, step, kind)
        self._agreement.barrier()
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # rotation runs below, after the manifest, protocol-aware
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        fault_sleep_s = float(os.environ.get(FAULT_SAVE_SLEEP_ENV, "0") or 0)
        if fault_sleep_s > 0:
            time.sleep(fault_sleep_s)
        protocol.fsync_tree(ckpt)
        self._agreement.barrier()
        nbytes = self._write_manifest(ckpt, step, kind)
        if self._is_rank0:
            self._rotate_checkpoints_safely(run_dir)
        self._agreement.barrier()
        dur_s = time.monotonic() - t0
        if run is not None:
            run.saved_step = step
            run.checkpoint = str(ckpt)
            if run.timing is not None:
                run.timing.save(step, kind, dur_s, nbytes)
        logger.info("slurm_jit: %s checkpoint %s complete in %.2f s", kind, ckpt, dur_s)
        self._grace_check("first save")

    def _write_manifest(self, ckpt: Path, step: int, kind: str) -> int:
        """Ranks hash a share of the files each; rank 0 writes the manifest. Returns the bytes (rank 0)."""
        agreement = self._agreement
        rels = agreement.broadcast(protocol.payload_files(ckpt) if self._is_rank0 else None)
        parts = agreement.gather(protocol.file_entries(ckpt, rels[agreement.rank::agreement.world_size]))
        if not self._is_rank0 or parts is None:
            return 0
        files = {rel: entry for part in parts for rel, entry in part.items()}
        duplicate = sum(e["size"] for rel, e in files.items()
                        if DUPLICATE_WEIGHT_RE.match(rel.rsplit("/", 1)[-1]))
        total = sum(e["size"] for e in files.values())
        latest = ckpt / "latest"
        tag = latest.read_text().strip() if latest.is_file() else None
        engine: Any = self.model_wrapped
        zero_stage = engine.zero_optimization_stage() if self.is_deepspeed_enabled else None
        protocol.write_manifest(
            ckpt, step=step, kind=kind, world_size=int(self.args.world_size), zero_stage=zero_stage,
            deepspeed_tag=tag, files=files,
            extra={"bytes_weights_duplicate": duplicate, "bytes_needed_for_resume": total - duplicate},
        )
        logger.warning("slurm_jit: %s checkpoint-%d: %d bytes written, %d needed for resume, %d over (model "
                       "weights again beside the fp32 master copy in the optimizer shards)",
                       kind, step, total, total - duplicate, duplicate)
        return total

    def _rotate_checkpoints_safely(self, run_dir: Path) -> None:
        """save_total_limit over resumable checkpoints only; never the newest resumable or the best one."""
        limit = self.args.save_total_limit
        if not limit or limit <= 0:
            return
        checkpoints, _ = protocol.scan(run_dir)
        resumable = [c for c in checkpoints if c.resumable()]
        best = self.state.best_model_checkpoint
        for ckpt in resumable[limit:]:
            if best is not None and Path(best).resolve() == ckpt.path.resolve():
                continue
            logger.info("slurm_jit: deleting %s (save_total_limit=%d)", ckpt.path, limit)
            shutil.rmtree(ckpt.path, ignore_errors=True)

    # ------------------------------------------------------------ grace

    def _grace_check(self, when: str) -> None:
        run = self._jit_run
        if run is None or not self.jit_config.grace_check or when in run.grace_checked or not self._is_rank0:
            return
        run.grace_checked.add(when)
        runtime_grace.check_and_warn(str(self.args.output_dir), self.jit_config.kill_wait_s, when)
