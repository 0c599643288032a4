"""Evaluation under ``JitTrainer``: aborted by a stop, owed to the resumed run, and the best metric kept honest.

Owns the abort (a stop agreed during evaluation is polled at each prediction step and ends the evaluation), what an
aborted evaluation leaves (no metrics, no best-metric update, the evaluation owed in the stop checkpoint's manifest;
before this run's first step, no new checkpoint at all), the owed evaluation run first on resume, right after the
RNG restore, as the uninterrupted run would have, and the best checkpoint it may name. The RNG isolation of every
evaluation is :mod:`.exact_resume`'s.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_jit.train import stop_path
from slurm_jit.train.run_state import EvalAborted, Run, StopBeforeFirstStep

if TYPE_CHECKING:
    from slurm_jit.train.session import JitTrainerLike, Session

logger = logging.getLogger(__name__)


def evaluate_in_loop(session: Session, run: Run, upstream: Callable[[], dict[str, float]]) -> dict[str, float]:
    """Upstream's ``_evaluate`` inside the training loop: aborted when a stop is agreed during it (empty metrics,
    the evaluation owed), else a stop round read at its end; timed in the timing log either way."""
    trainer = session.trainer
    t0 = time.monotonic()
    compute = trainer.compute_metrics
    if compute is not None:  # after the last batch, over the whole set: no batch feeds the watchdog meanwhile
        trainer.compute_metrics = _fed_first(session, compute)
    try:
        metrics = upstream()
    except EvalAborted:
        metrics = _aborted(trainer, run)
    else:
        stop_path.agree_now(session)
    finally:
        trainer.compute_metrics = compute
    if run.timing is not None:
        run.timing.evaluation(trainer.state.global_step, time.monotonic() - t0, run.eval_aborted)
    return metrics


def _fed_first(session: Session, compute: Callable[..., dict[str, float]]) -> Callable[..., dict[str, float]]:
    """``compute_metrics`` that first feeds the hang watchdog the long phase ``metrics``."""

    @functools.wraps(compute)  # its signature too: batch_eval_metrics passes compute_result
    def compute_metrics(*args: Any, **kwargs: Any) -> dict[str, float]:
        stop_path.feed(session, "metrics")
        return compute(*args, **kwargs)

    return compute_metrics


def _aborted(trainer: JitTrainerLike, run: Run) -> dict[str, float]:
    run.eval_aborted = run.eval_owed = True
    trainer.control.should_save = False  # the JIT save takes the place of this step's periodic one
    if run.steps_done == 0:
        # No step trained yet: the state is the checkpoint resumed from, which still owes this
        # evaluation (a new checkpoint one step on would owe it at the wrong step, and lose this one).
        run.stopped = True
        logger.warning("slurm_jit: evaluation at step %d aborted before this run's first step: exiting "
                       "without a new checkpoint (%s still owes it)", trainer.state.global_step,
                       run.resumed_from or "a fresh start")
        raise StopBeforeFirstStep from None
    logger.warning("slurm_jit: evaluation aborted at step %d for a JIT checkpoint", trainer.state.global_step)
    return {}


def abort_if_stopping(session: Session) -> None:
    """At each prediction step inside the training loop (not at its last step): raise EvalAborted once a stop is
    agreed."""
    trainer = session.trainer
    stop_path.feed(session, "evaluation")  # each batch is a boundary for the hang watchdog
    run = session.run
    if (run is not None and run.in_loop and not stop_path.at_last_step(trainer)
            and stop_path.take(session, session.agreement.poll(*stop_path.wish(session)))):
        raise EvalAborted


def run_owed(session: Session) -> None:
    """Run the evaluation that the stop skipped or aborted, as the uninterrupted run would have."""
    trainer = session.trainer
    run = session.run
    if run is None or run.owed_eval_step is None:
        return
    step, run.owed_eval_step = run.owed_eval_step, None
    if step != trainer.state.global_step or trainer.eval_dataset is None or trainer.args.eval_strategy == "no":
        return  # not this step's state, or this run does not evaluate
    logger.warning("slurm_jit: running the evaluation owed from step %d (skipped by the stop)", step)
    metrics = session.hooks.evaluate(run.trial, run.ignore_keys_for_eval)
    if session.hooks.determine_best_metric(metrics=metrics, trial=run.trial) and trainer.state.best_global_step == step:
        # Upstream names the best checkpoint when it saves; this step's checkpoint is the one resumed from.
        best = Path(session.hooks.output_dir(trial=run.trial)) / f"checkpoint-{step}"
        if best.is_dir():
            trainer.state.best_model_checkpoint = str(best)


def no_best_from_aborted(session: Session) -> bool:
    """Whether this run's evaluation was aborted: it has no metrics to compare with the best."""
    return session.run is not None and session.run.eval_aborted
