"""What the Trainer accumulates between two logs, kept in every checkpoint so that a resumed run logs the values the
uninterrupted run logs, for any ``logging_steps``.

Upstream (transformers 5.25, ``Trainer._inner_training_loop`` and ``_maybe_log_save_evaluate``) sums each rank's
step losses in ``_tr_loss`` from one log to the next, the logged windows in ``_total_loss_scalar``, and divides by
the steps since ``_globalstep_last_logged``. A resume starts all three afresh at the resumed step: the first window
after it averages only the steps since the resume, the steps before it in that window are never logged, and the
final ``train_loss`` covers only the last ``train()``. TRL's trainers also average ``_metrics["train"]`` at each log
and count ``_total_train_tokens`` since the start.

Each rank writes its :class:`Window` (:data:`FILE_PATTERN`, a few hundred bytes of JSON, floats written exactly,
non-finite ones as strings) into every checkpoint before its manifest; the resumed ``train()`` puts it back before
its first step, so the same float additions happen in the same order. On another number of ranks each rank takes the
old ranks' mean loss sum (the gathered mean upstream logs is then the same up to rounding). This module is the file
format and its checks, and the one place that reads and sets upstream's fields.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from slurm_jit.train.session import Session

logger = logging.getLogger(__name__)

FILE_PATTERN = "jit-logging-rank{rank}.json"
VERSION = 1


class WindowError(ValueError):
    """A logging window file that cannot be used; the message says which and why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Window:
    """One rank's logging window at a step boundary, after upstream's log of that step."""

    step: int  # the checkpoint's global step
    world_size: int  # of the run that wrote it
    tr_loss: float  # this rank's loss sum since the last log (upstream's _tr_loss)
    globalstep_last_logged: int  # the step of the last log
    total_loss_scalar: float  # the sum of the logged windows (upstream's _total_loss_scalar)
    chain_first_step: int  # the step the requeue chain's training started from
    train_metrics: dict[str, list[float | int]] | None = None  # TRL's _metrics["train"] since the last log
    total_train_tokens: int | None = None  # TRL's _total_train_tokens


def file_path(ckpt: str | os.PathLike[str], rank: int) -> Path:
    return Path(ckpt) / FILE_PATTERN.format(rank=rank)


def _number(value: float | int) -> float | int | str:
    """JSON has no NaN or infinity: those as strings, float() reads them back."""
    return value if isinstance(value, int) or math.isfinite(value) else repr(value)


def write(ckpt: str | os.PathLike[str], rank: int, window: Window) -> None:
    """This rank's file in the checkpoint, durable before the manifest lists it (the async commit hashes it)."""
    fields = dataclasses.asdict(window)
    fields["tr_loss"], fields["total_loss_scalar"] = _number(window.tr_loss), _number(window.total_loss_scalar)
    if window.train_metrics is not None:
        fields["train_metrics"] = {k: [_number(x) for x in v] for k, v in window.train_metrics.items()}
    with open(file_path(ckpt, rank), "w", encoding="utf-8") as f:
        json.dump({"version": VERSION, **fields}, f, allow_nan=False)  # floats as repr: read back bit for bit
        f.flush()
        os.fsync(f.fileno())


def read(ckpt: str | os.PathLike[str], rank: int, world_size: int) -> Window | None:
    """The window this rank resumes with: its own rank's where the world size is the checkpoint's, else rank 0's
    with the old ranks' mean loss sum. None where the checkpoint has none (transformers' Trainer or an older
    slurm-jit wrote it). Raises :class:`WindowError` for a file that is there but cannot be used."""
    first = _load(file_path(ckpt, 0))
    if first is None:
        return None
    if first.world_size == world_size:
        own = first if rank == 0 else _load(file_path(ckpt, rank))
        if own is None:
            raise WindowError(f"{FILE_PATTERN.format(rank=rank)} is missing beside rank 0's")
        return own
    others = [_load(file_path(ckpt, r)) for r in range(first.world_size)]
    sums = [w.tr_loss for w in others if w is not None]
    if len(sums) != first.world_size:
        raise WindowError(f"{len(sums)} of the {first.world_size} ranks' windows are there")
    return dataclasses.replace(first, tr_loss=math.fsum(sums) / first.world_size)


def _load(path: Path) -> Window | None:
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict) or raw.pop("version", None) != VERSION:
            raise WindowError(f"{path.name}: not a version {VERSION} logging window")
        window = Window(**raw)
        _check(window)
    except (OSError, TypeError, json.JSONDecodeError) as exc:
        raise WindowError(f"{path.name}: {exc}") from None
    return _with_floats(window)


def _check(window: Window) -> None:
    for name in ("step", "world_size", "globalstep_last_logged", "chain_first_step"):
        value = getattr(window, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise WindowError(f"{name}={value!r} is not a step")
    if window.world_size < 1 or window.globalstep_last_logged > window.step or window.chain_first_step > window.step:
        raise WindowError(f"inconsistent steps: {window}")
    for name in ("tr_loss", "total_loss_scalar"):
        _float(getattr(window, name), name)
    if window.train_metrics is not None:
        if not isinstance(window.train_metrics, dict) or not all(
                isinstance(k, str) and isinstance(v, list) for k, v in window.train_metrics.items()):
            raise WindowError("train_metrics is not a dict of lists")
        for key, values in window.train_metrics.items():
            for value in values:
                _float(value, f"train_metrics[{key!r}]")
    tokens = window.total_train_tokens
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool)):
        raise WindowError(f"total_train_tokens={tokens!r} is not a count")


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise WindowError(f"{name}={value!r} is not a number")
    try:
        return float(value)
    except ValueError:
        raise WindowError(f"{name}={value!r} is not a number") from None


def _with_floats(window: Window) -> Window:
    metrics = window.train_metrics
    return dataclasses.replace(
        window, tr_loss=float(window.tr_loss), total_loss_scalar=float(window.total_loss_scalar),
        train_metrics=None if metrics is None else
        {k: [x if isinstance(x, int) else float(x) for x in v] for k, v in metrics.items()})


def chain_train_loss(total_loss_scalar: float, global_step: int, chain_first_step: int) -> float:
    """upstream's ``train_loss`` (``_finalize_training``) over the steps since the chain's first step, not only since
    this ``train()``'s: what the uninterrupted run reports."""
    return total_loss_scalar / max(global_step - chain_first_step, 0.001)


# Upstream's fields (transformers 5.25, Trainer._inner_training_loop and TRL's trainers): this module is the one
# place that reads or sets them.
TR_LOSS, LAST_LOGGED, TOTAL = "_tr_loss", "_globalstep_last_logged", "_total_loss_scalar"
TRL_METRICS, TRL_TOKENS = "_metrics", "_total_train_tokens"


def _trl_train_metrics(trainer: Any) -> dict[str, list[Any]] | None:
    metrics = getattr(trainer, TRL_METRICS, None)
    train = metrics.get("train") if isinstance(metrics, dict) else None
    return train if isinstance(train, dict) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def capture(trainer: Any, chain_first_step: int) -> Window | None:
    """This rank's window now (a step boundary, after upstream's log of it), or None where upstream keeps none."""
    tr_loss = getattr(trainer, TR_LOSS, None)
    if not isinstance(tr_loss, torch.Tensor):
        return None
    train = _trl_train_metrics(trainer)
    return Window(
        step=int(trainer.state.global_step), world_size=int(trainer.args.world_size), tr_loss=float(tr_loss.item()),
        globalstep_last_logged=int(getattr(trainer, LAST_LOGGED)), total_loss_scalar=float(getattr(trainer, TOTAL)),
        chain_first_step=chain_first_step,
        train_metrics=None if train is None else
        {str(k): [x if _count(x) is not None else float(x) for x in v] for k, v in train.items()},
        total_train_tokens=_count(getattr(trainer, TRL_TOKENS, None)))


def usable(trainer: Any, checkpoint: str) -> Window | None:
    """This rank's window of ``checkpoint`` where it can be put back now, else None (a warning says why)."""
    try:
        window = read(checkpoint, int(trainer.args.process_index), int(trainer.args.world_size))
    except WindowError as exc:
        logger.warning("slurm_jit: the logging window in %s is unusable (%s): not restored", checkpoint, exc)
        return None
    if window is not None and window.step != trainer.state.global_step:
        logger.warning("slurm_jit: the logging window in %s is of step %d, the resume of step %d: not restored",
                       checkpoint, window.step, trainer.state.global_step)
        return None
    if window is not None and not isinstance(getattr(trainer, TR_LOSS, None), torch.Tensor):
        logger.warning("slurm_jit: this transformers keeps no Trainer.%s: the logging window is not restored", TR_LOSS)
        return None
    return window


def apply(trainer: Any, window: Window) -> None:
    """Before the first resumed step, once upstream has reset its fields at the resumed step: the window as it was."""
    getattr(trainer, TR_LOSS).fill_(window.tr_loss)  # in place: the tensor upstream's loop adds to
    setattr(trainer, LAST_LOGGED, window.globalstep_last_logged)
    setattr(trainer, TOTAL, window.total_loss_scalar)
    train = _trl_train_metrics(trainer)
    if train is not None and window.train_metrics:
        train.clear()
        train.update({k: list(v) for k, v in window.train_metrics.items()})
    if window.total_train_tokens is not None and _count(getattr(trainer, TRL_TOKENS, None)) is not None:
        setattr(trainer, TRL_TOKENS, window.total_train_tokens)


def start_step(trainer: Any) -> int:
    """The step this train() started from (upstream's ``_initial_global_step``): a chain's first without a window."""
    return int(getattr(trainer, "_initial_global_step", trainer.state.global_step))


def chain_loss(trainer: Any, chain_first_step: int) -> float:
    return chain_train_loss(float(getattr(trainer, TOTAL)), int(trainer.state.global_step), chain_first_step)


def restore(session: Session) -> None:
    """The resumed checkpoint's logging window, once upstream has reset its own (``on_train_begin``): on every rank
    or on none (a rank without it would make the first gathered mean wrong); then what the next saves capture."""
    trainer, run = session.trainer, session.run
    if run is None:
        return
    window = usable(trainer, run.resumed_from) if run.resumed_from else None
    restored = bool(run.resumed_from) and session.agreement.all_true(window is not None)
    if restored and window is not None:
        apply(trainer, window)
    elif run.resumed_from and session.is_rank0:
        logger.info("slurm_jit: no logging window restored from %s: the first log after the resume averages "
                    "only the steps since it, train_loss only this run's", run.resumed_from)
    first = window.chain_first_step if restored and window is not None else start_step(trainer)
    run.chain_first_step = first
    run.capture_window = functools.partial(capture, trainer, first)
