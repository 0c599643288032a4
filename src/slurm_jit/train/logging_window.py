"""What the Trainer accumulates between two logs, kept in every checkpoint so that a resumed run logs the values the
uninterrupted run logs, for any ``logging_steps``.

Upstream (transformers 5.25, ``Trainer._inner_training_loop`` and ``_maybe_log_save_evaluate``) sums each rank's
step losses in ``_tr_loss`` from one log to the next, the logged windows in ``_total_loss_scalar``, and divides by
the steps since ``_globalstep_last_logged``. A resume starts all three afresh at the resumed step: the first window
after it averages only the steps since the resume, the steps before it in that window are never logged, and the
final ``train_loss`` covers only the last ``train()``. TRL's trainers also average ``_metrics["train"]`` at each log
and count ``_total_train_tokens`` since the start.

Each rank writes its window (:data:`FILE_PATTERN`, a few hundred bytes of JSON, floats written exactly) into every
checkpoint before its manifest; the resumed ``train()`` puts it back before its first step (:func:`restore`), so the
same float additions happen in the same order. On another number of ranks each rank takes the old ranks' mean loss
sum (the gathered mean upstream logs is then the same up to rounding).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

FILE_PATTERN = "jit-logging-rank{rank}.json"
VERSION = 1


def file_path(ckpt: str | os.PathLike[str], rank: int) -> Path:
    return Path(ckpt) / FILE_PATTERN.format(rank=rank)


def capture(trainer: Any, chain_first_step: int) -> dict[str, Any]:
    """This rank's logging window now (at a step boundary, after upstream's log of this step)."""
    tr_loss = getattr(trainer, "_tr_loss", None)
    metrics = getattr(trainer, "_metrics", None)
    train_metrics = metrics.get("train") if isinstance(metrics, dict) else None
    tokens = getattr(trainer, "_total_train_tokens", None)
    return {
        "version": VERSION,
        "step": int(trainer.state.global_step),
        "world_size": int(trainer.args.world_size),
        "tr_loss": float(tr_loss.item()) if isinstance(tr_loss, torch.Tensor) else None,
        "globalstep_last_logged": int(getattr(trainer, "_globalstep_last_logged", trainer.state.global_step)),
        "total_loss_scalar": float(getattr(trainer, "_total_loss_scalar", 0.0)),
        "chain_first_step": int(chain_first_step),
        "train_metrics": ({str(k): [float(x) for x in v] for k, v in train_metrics.items()}
                          if isinstance(train_metrics, dict) else None),
        "total_train_tokens": tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None,
    }


def write(ckpt: str | os.PathLike[str], rank: int, window: dict[str, Any]) -> None:
    """This rank's file in the checkpoint, durable before the manifest lists it (the async commit hashes it)."""
    path = file_path(ckpt, rank)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(window, f)  # floats as repr: read back bit for bit (NaN and inf as JSON's extensions)
        f.flush()
        os.fsync(f.fileno())


def read(ckpt: str | os.PathLike[str], rank: int, world_size: int) -> dict[str, Any] | None:
    """The window this rank resumes with: its own rank's where the world size is the checkpoint's, else rank 0's
    with the old ranks' mean loss sum. None where the checkpoint has none (an upstream or older checkpoint)."""
    try:
        first = _load(file_path(ckpt, 0))
        if first is None:
            return None
        old_world = int(first["world_size"])
        if old_world == world_size:
            return first if rank == 0 else _load(file_path(ckpt, rank))
        sums = [w["tr_loss"] for w in (_load(file_path(ckpt, r)) for r in range(old_world)) if w is not None]
        if len(sums) != old_world or any(s is None for s in sums):
            return None
        return {**first, "tr_loss": math.fsum(sums) / old_world}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("slurm_jit: the logging window in %s is unreadable (%s): the first log after the resume "
                       "averages only the steps since it", ckpt, exc)
        return None


def _load(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    window = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(window, dict) or window.get("version") != VERSION:
        raise ValueError(f"{path.name}: not a version {VERSION} logging window")
    return window


def restore(trainer: Any, window: dict[str, Any]) -> bool:
    """Before the first resumed step (upstream has just reset these at the resumed step): the window as it was.
    False where it is of another step (nothing restored)."""
    if int(window["step"]) != int(trainer.state.global_step):
        logger.warning("slurm_jit: the logging window is of step %s, the resume of step %s: not restored",
                       window["step"], trainer.state.global_step)
        return False
    tr_loss = getattr(trainer, "_tr_loss", None)
    if isinstance(tr_loss, torch.Tensor) and window["tr_loss"] is not None:
        tr_loss.fill_(float(window["tr_loss"]))  # in place: the tensor upstream's loop adds to
    trainer._globalstep_last_logged = int(window["globalstep_last_logged"])
    trainer._total_loss_scalar = float(window["total_loss_scalar"])
    metrics = getattr(trainer, "_metrics", None)
    train_metrics = metrics.get("train") if isinstance(metrics, dict) else None
    if isinstance(train_metrics, dict) and window.get("train_metrics") is not None:
        train_metrics.clear()
        train_metrics.update({k: list(v) for k, v in window["train_metrics"].items()})
    if window.get("total_train_tokens") is not None and isinstance(getattr(trainer, "_total_train_tokens", None), int):
        trainer._total_train_tokens = int(window["total_train_tokens"])
    return True


def chain_train_loss(total_loss_scalar: float, global_step: int, chain_first_step: int) -> float:
    """upstream's ``train_loss`` (``_finalize_training``) over the steps since the chain's first step, not only since
    this ``train()``'s: what the uninterrupted run reports."""
    return total_loss_scalar / max(global_step - chain_first_step, 0.001)
