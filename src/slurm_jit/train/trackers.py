"""Experiment trackers across requeues (issue 12): a resumed job continues the W&B run of the training it resumes
(the TensorBoard run directory: ``compat.continue_tensorboard_run``), and each job's end is logged as what it is,
a JIT stop to be continued (a time limit or preemption) or the finished training, never left looking like a crash.

W&B: transformers' WandbCallback calls ``wandb.init()`` without an id, so every job would start a new run.
Before the Trainer's loop, rank 0 starts the run itself as the callback would, with the id kept in
``OUT_DIR/slurm-jit/wandb.json`` and ``resume="allow"``; the callback then uses that run. Offline
(``WANDB_MODE=offline``) each job writes its own ``offline-run-*-<id>`` directory of the same run id. The record
also keeps the last step logged per key: points of steps a job redoes (resumed from a checkpoint older than what
the crashed job had logged) are not logged twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import string
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeGuard

from slurm_jit.timing import TIMING_DIR
from slurm_jit.train import output_lock, stop_summary

logger = logging.getLogger(__name__)

WANDB_RECORD = "wandb.json"  # the W&B run id a resumed job continues, and the last step logged per key
# A record is a run id and one step per logged key: tens of keys (~2 KB) usually, ~100 KB with per-parameter
# metrics (a grad norm per LoRA matrix of an 80-layer model: 1120 keys). 16 MiB holds ~150,000 keys of ~100
# characters: a bigger file is not one we wrote.
WANDB_RECORD_MAX_BYTES = 16 * 1024 * 1024
RUN_ID_ENV = "WANDB_RUN_ID"  # a run the user chose: wandb.init() reads it, JitTrainer leaves it alone
RUN_ID_CHARS = string.ascii_lowercase + string.digits  # wandb's own generate_id() alphabet
RUN_ID_LEN = 8  # as wandb's generate_id(); W&B accepts ids up to 64 characters of [A-Za-z0-9_-]
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
ERROR_TEXT_MAX_CHARS = 300  # of wandb's error in the one warning line (pydantic's run to several lines)
STOP_KEY = "slurm_jit/stop"  # the W&B summary field and the TensorBoard text tag saying how the job ended


def _callback(trainer: Any, name: str) -> Any:
    return next((c for c in trainer.callback_handler.callbacks if type(c).__name__ == name), None)


def _record_path(trainer: Any) -> Path:
    return Path(trainer.args.output_dir) / TIMING_DIR / WANDB_RECORD


def one_line(exc: BaseException) -> str:
    """An error in a warning line: one line, bounded (a record's field may be megabytes)."""
    return " ".join(str(exc).split())[:ERROR_TEXT_MAX_CHARS]


def printable_name(value: object) -> TypeGuard[str]:
    """A path or id read from a record is a non-empty string without a control character (a NUL byte fails in the
    tracker; a newline breaks the one-line warnings)."""
    return isinstance(value, str) and bool(value) and value.isprintable()


def write_small_json(record: Path, data: Any) -> None:
    """Replace a small JSON record of ours whole (a temporary file, then a rename: a kill leaves the old or the
    new one); raises OSError. The temporary file is created anew: a FIFO or a symbolic link left in its place is
    neither waited on nor written through."""
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(json.dumps(data))
    os.replace(tmp, record)


def _read_record(record: Path) -> dict[str, Any] | None:
    """The record's run id and steps, or None (and one warning line) when it is unusable."""
    try:
        data = output_lock.read_json(record, WANDB_RECORD_MAX_BYTES)
        run_id = data.get("run_id") if isinstance(data, dict) else None
        if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
            raise ValueError(f"run_id {run_id!r:.100} is not a W&B run id")
        logged = data.get("logged", {})
        if not isinstance(logged, dict) or not all(isinstance(v, int) for v in logged.values()):
            raise ValueError("logged is not a mapping of keys to steps")
    except (OSError, ValueError) as exc:  # read_json raises nothing else
        logger.warning("slurm_jit: %s unusable (%s): W&B starts a new run. HINT: delete the file; to continue a "
                       "run, set WANDB_RUN_ID=<its id> and WANDB_RESUME=allow", record, one_line(exc))
        return None
    return {"run_id": run_id, "logged": {str(k): int(v) for k, v in logged.items()}}


def _write_record(record: Path, data: dict[str, Any]) -> bool:
    try:
        write_small_json(record, data)
    except OSError as exc:
        logger.warning("slurm_jit: cannot write %s (%s): a requeued job will start a new W&B run. HINT: make %s a "
                       "writable directory", record, exc, record.parent)
        return False
    return True


def _skip_redone_points(callback: Any, record: Path, data: dict[str, Any], writable: bool) -> None:
    """Wrap the callback's on_log (this instance only): a key an earlier job logged at this step or later is
    dropped; what is logged is written into the record. This job's own logs are never dropped: the Trainer logs
    several times at one step (the loss, the evaluation, train()'s end), each with ``epoch``."""
    logged: dict[str, int] = data["logged"]
    earlier_jobs = dict(logged)
    original = callback.on_log
    state = {"writable": writable}  # False: the one warning was given already

    def on_log(args: Any, trainer_state: Any, control: Any, logs: Any = None, **kwargs: Any) -> Any:
        step = int(trainer_state.global_step)
        fresh = {k: v for k, v in (logs or {}).items() if earlier_jobs.get(k, -1) < step}
        if logs and not fresh:
            return None  # every point of this log is there already, from the job that did this step first
        result = original(args, trainer_state, control, logs=fresh, **kwargs)
        logged.update(dict.fromkeys(fresh, step))
        if state["writable"]:  # one warning, not one per logging step
            state["writable"] = _write_record(record, data)
        return result

    callback.on_log = on_log


@contextlib.contextmanager
def continue_wandb_run(trainer: Any, resume_from: str | None) -> Iterator[None]:
    """While ``train()`` runs on rank 0 with ``report_to`` W&B: a resumed job continues the recorded run, a fresh
    start begins a new one (and records it). Nothing changes where the user chose the run (``WANDB_RUN_ID``, or
    a ``wandb.init()`` of their own) or where a hyperparameter search makes a run per trial."""
    callback = _callback(trainer, "WandbCallback")
    wandb = getattr(callback, "_wandb", None)
    if (wandb is None or getattr(wandb, "run", None) is not None or os.environ.get(RUN_ID_ENV)
            or not trainer.is_world_process_zero() or getattr(trainer, "hp_search_backend", None) is not None):
        yield
        return
    record = _record_path(trainer)
    data = _read_record(record) if resume_from is not None and (record.exists() or record.is_symlink()) else None
    writable = True
    if data is None:
        data = {"run_id": "".join(secrets.choice(RUN_ID_CHARS) for _ in range(RUN_ID_LEN)), "logged": {}}
        writable = _write_record(record, data)
    else:
        logger.info("slurm_jit: W&B run %s continued from %s", data["run_id"], resume_from)
    # transformers' own init (WandbCallback.setup), with the id: setup then finds the run and uses it. Not by
    # WANDB_RUN_ID: wandb reads its environment once per process, so a later train() would reuse the first id.
    name = {"name": trainer.args.run_name} if getattr(trainer.args, "run_name", None) is not None else {}
    try:
        wandb.init(project=os.getenv("WANDB_PROJECT", "huggingface"), id=data["run_id"], resume="allow", **name)
    except Exception as exc:  # refused (e.g. the user's WANDB_FORK_FROM with resume=): transformers' init decides
        logger.warning("slurm_jit: W&B run %s not continued (%s: %s): left to the WandbCallback's own init. HINT: "
                       "wandb's message says why; WANDB_FORK_FROM/WANDB_RESUME_FROM exclude continuing a run (unset "
                       "them after the first job)", data["run_id"], type(exc).__name__,
                       " ".join(str(exc).split())[:ERROR_TEXT_MAX_CHARS])
        yield
        return
    _skip_redone_points(callback, record, data, writable)
    try:
        yield
    finally:
        callback.__dict__.pop("on_log", None)


def stop_text(state: str, step: int, signal_name: str | None, error_after_stop: str | None = None,
              record: dict[str, Any] | None = None) -> str:
    """The stop summary's words; for a ``hung`` or lost-peer ``failed`` record, :func:`stop_summary.phrase`."""
    said = stop_summary.phrase(record)
    if said is not None:
        return f"{said}; a requeued job resumes from the newest complete checkpoint"
    if state == "jit_stop":
        text = (f"stopped for a JIT checkpoint at step {step} after {signal_name or 'a stop signal'} (a time "
                "limit or preemption, not a crash): a requeued job continues this run")
        return text if error_after_stop is None else f"{text}; after the checkpoint: {error_after_stop}"
    return f"finished at step {step}"


def log_stop_to_trackers(trainer: Any, state: str, step: int, signal_name: str | None,
                         error_after_stop: str | None = None, record: dict[str, Any] | None = None) -> None:
    """Rank 0, when ``train()`` returns (or fails after its stop checkpoint was complete, ``error_after_stop``):
    tell the trackers how this job ended (``jit_stop`` or ``finished``; ``hung`` or ``failed`` with the stop
    ``record`` that names the hung rank or the lost peer)."""
    if not trainer.is_world_process_zero():
        return
    text = stop_text(state, step, signal_name, error_after_stop, record)
    for name, log in (("WandbCallback", _log_stop_wandb), ("TensorBoardCallback", _log_stop_tensorboard)):
        callback = _callback(trainer, name)
        if callback is None:
            continue
        try:
            log(callback, state, step, signal_name, text)
        except Exception as exc:  # a tracker's failure must not turn a clean stop into a crash
            logger.warning("slurm_jit: could not log the %s to %s (%s: %s). HINT: the stop record "
                           "OUT_DIR/slurm-jit/stop.json says how the job ended", state, name, type(exc).__name__,
                           str(exc).replace("\n", " "))


TRACKER_WAIT_S = 5.0  # judgement: a hang's exit waits this long at most for the trackers (they may hang too)


def log_hang_to_trackers(trainer: Any, record: dict[str, Any]) -> None:
    """The watchdog's thread, before the exit: the ``hung`` (or lost-peer) record's phrase to the trackers, in a
    daemon thread waited for at most :data:`TRACKER_WAIT_S` (a tracker stuck too must not keep the job alive)."""
    step = record.get("step") if isinstance(record.get("step"), int) else 0
    worker = threading.Thread(target=log_stop_to_trackers, name="slurm-jit-hang-trackers", daemon=True,
                              args=(trainer, str(record.get("state")), step, None), kwargs={"record": record})
    worker.start()
    worker.join(TRACKER_WAIT_S)


def _log_stop_wandb(callback: Any, state: str, step: int, signal_name: str | None, text: str) -> None:
    run = getattr(getattr(callback, "_wandb", None), "run", None)
    if run is None:
        return
    if state == "jit_stop":
        run.mark_preempting()  # W&B shows the run as preempted (to be resumed), not crashed
    run.summary.update({STOP_KEY: state, f"{STOP_KEY}_step": step, f"{STOP_KEY}_signal": signal_name or "",
                        f"{STOP_KEY}_text": text})


def _log_stop_tensorboard(callback: Any, state: str, step: int, signal_name: str | None, text: str) -> None:
    """A text summary in the run directory (upstream's writer is closed by on_train_end: a new event file)."""
    writer_cls = callback.__dict__.get("_slurm_jit_summary_writer") or getattr(callback, "_SummaryWriter", None)
    log_dir = getattr(callback, "logging_dir", None)
    if writer_cls is None or log_dir is None:
        return
    writer = writer_cls(log_dir=log_dir)
    try:
        writer.add_text(STOP_KEY, text, step)
    finally:
        writer.close()
