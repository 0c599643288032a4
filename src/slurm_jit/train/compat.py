"""What JitTrainer needs from the installed Trainer, checked once at construction; and the few places where a
JitTrainer behaves differently from a Trainer on purpose (listed in the README's table).

JitTrainer overrides private Trainer methods. A transformers release that renames one, or changes what it is
called with, would otherwise break at the first stop on a cluster (a checkpoint never written, a resume that
diverges): instead the construction fails with one line naming the supported range.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import os
import signal
import sys
import weakref
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from slurm_jit.timing import TIMING_DIR
from slurm_jit.train import output_lock
from slurm_jit.train.refusals import JitRefusal
from slurm_jit.train.trackers import one_line, printable_name, write_small_json

logger = logging.getLogger(__name__)

TENSORBOARD_RECORD = "tensorboard.json"  # the TensorBoard run directory a resumed job continues
# A record is one short JSON object (~60 bytes): a bigger file is not one we wrote, and is not read whole.
TENSORBOARD_RECORD_MAX_BYTES = 64 * 1024
RUNS_DIR = "runs"  # transformers' default_logdir(): runs/<time>_<host>, the only run directory the record names
PROGRESS_BARS_ENV = "SLURM_JIT_PROGRESS_BARS"  # "1": tqdm bars even when stderr is a file (a Slurm job log)

# The range tested (keep equal to pyproject.toml's dependencies; tests/test_compat_hooks.py checks it).
SUPPORTED_RANGE = "transformers>=5.18,<6, accelerate>=1.15,<2, deepspeed>=0.19.8,<0.20"
# The stop/resume scenario runs on both ends of the transformers range (README "Versions"): the newest is what a
# fresh install resolves (every DeepSpeed test runs on it), the lowest is installed as an overlay by
# tests/test_compat_versions.py. Below 5.18 transformers requires huggingface_hub<2, outside the tested set.
LOWEST_TRANSFORMERS = "5.18.0"
TESTED_TRANSFORMERS = "5.24.0"  # the newest tested: the version the refusal's HINT names
# Every Trainer method JitTrainer overrides or calls by a private name, with the parameters (after self) that
# transformers 5.24 gives it, in order. Upstream may add parameters after these, with defaults.
TRAINER_HOOKS: dict[str, tuple[str, ...]] = {
    "_get_dataloader": ("dataset", "description", "batch_size", "sampler_fn", "is_training"),
    "_maybe_log_save_evaluate": ("tr_loss", "grad_norm", "model", "trial", "epoch", "ignore_keys_for_eval",
                                 "start_time"),
    "_evaluate": ("trial", "ignore_keys_for_eval", "skip_scheduler"),
    "_load_rng_state": ("checkpoint",),
    "set_initial_training_values": ("args", "dataloader"),
    "_init_training_state": ("max_steps", "num_update_steps_per_epoch", "num_train_epochs", "resume_from_checkpoint",
                             "trial"),
    "_determine_best_metric": ("metrics", "trial"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_finalize_training": ("trial", "num_train_samples", "start_time"),
    "_load_best_model": (),
    "_finish_current_push": (),
    "_save_checkpoint": ("model", "trial"),
    "_get_output_dir": ("trial",),
    "log": ("logs",),
}


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def hook_problem(trainer_cls: type, name: str, expected: tuple[str, ...]) -> str | None:
    """Why ``trainer_cls.name`` cannot be the hook JitTrainer expects, or None when it can."""
    method = getattr(trainer_cls, name, None)
    if not callable(method):
        return f"has no Trainer.{name}()"
    params = list(inspect.signature(method).parameters.values())[1:]  # without self
    names = [p.name for p in params]
    if tuple(names[:len(expected)]) != expected:
        return f"Trainer.{name}({', '.join(names)}) is not Trainer.{name}({', '.join(expected)}, ...)"
    extra = [p.name for p in params[len(expected):]
             if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if extra:
        return f"Trainer.{name}() requires new parameters {extra}"
    return None


def override_problem(trainer_cls: type, jit_cls: type, name: str, expected: tuple[str, ...]) -> str | None:
    """Why ``jit_cls``'s own override of ``name`` cannot take what the Trainer may pass it (a parameter added
    upstream after ``expected``: the Trainer's callers pass it, an override without it fails at the first save)."""
    override = vars(jit_cls).get(name)
    if override is None:
        return None  # called by JitTrainer, not overridden: upstream's optional parameters keep their defaults
    accepted = inspect.signature(override).parameters
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return None
    new = list(inspect.signature(getattr(trainer_cls, name)).parameters.values())[1 + len(expected):]
    # upstream's own *args/**kwargs are no parameter its callers pass by name
    missing = [p.name for p in new if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in accepted]
    return f"Trainer.{name}() has new parameters {missing} that JitTrainer.{name}() does not take" if missing \
        else None


def check_trainer_hooks(trainer_cls: type | None = None, jit_cls: type | None = None) -> None:
    """Raise JitRefusal (one line) when the installed Trainer lacks a hook JitTrainer relies on, or passes a hook
    JitTrainer overrides (``jit_cls``'s own methods; a user's subclass is its author's) a parameter it cannot take."""
    if trainer_cls is None:
        from transformers.trainer import Trainer  # the class itself: transformers.Trainer may be JitTrainer now

        trainer_cls = Trainer
    for name, expected in TRAINER_HOOKS.items():
        problem = hook_problem(trainer_cls, name, expected)
        if problem is None and jit_cls is not None:
            problem = override_problem(trainer_cls, jit_cls, name, expected)
        if problem:
            raise JitRefusal(f"slurm_jit: transformers {_version('transformers')} {problem}: JitTrainer "
                             f"supports {SUPPORTED_RANGE}. HINT: pip install 'transformers=={TESTED_TRANSFORMERS}' "
                             "(the version tested; a newer one inside the range can differ)")


@contextlib.contextmanager
def eval_on_start_once(args: Any, resuming: bool) -> Iterator[None]:
    """A resumed run is the continuation of one training, which evaluated at its start already: upstream's
    ``eval_on_start`` would evaluate again at the resumed step (a point the uninterrupted run never logged,
    next to the evaluation a stop left owed). Off while a resume runs, back afterwards."""
    if not (resuming and getattr(args, "eval_on_start", False)):
        yield
        return
    logger.info("slurm_jit: eval_on_start skipped on resume (this training evaluated at its start)")
    args.eval_on_start = False
    try:
        yield
    finally:
        args.eval_on_start = True


def _loaders(trainer: Any) -> list[Any]:
    handler = getattr(trainer, "callback_handler", None)
    loaders = [getattr(handler, "train_dataloader", None), getattr(handler, "eval_dataloader", None),
               *getattr(trainer, "_eval_dataloaders", {}).values()]
    return [getattr(loader, "base_dataloader", loader) for loader in loaders if loader is not None]


def shut_down_persistent_workers(trainer: Any) -> None:
    """Stop the DataLoader workers that ``dataloader_persistent_workers`` keeps alive after train()/evaluate().

    The Trainer keeps its loaders (and their worker iterators) until the interpreter exits. There torch's own
    shutdown is a no-op and multiprocessing stops daemonic children with SIGTERM, which JitTrainer's workers
    ignore (``ignore_signals_in_workers``): the process would wait for them forever. torch's orderly shutdown
    (a sentinel on each worker's queue) needs no signal. A later iteration starts new workers.
    """
    for loader in _loaders(trainer):
        iterator = getattr(loader, "_iterator", None)
        if iterator is None or not hasattr(iterator, "_shutdown_workers"):
            continue
        loader._iterator = None
        try:
            iterator._shutdown_workers()
        except Exception as exc:  # train()'s cleanup (signal handlers back, logs closed) and other loaders go on
            logger.warning("slurm_jit: shutting down DataLoader workers failed (%s: %s): the process may wait for "
                           "them at exit. HINT: if it hangs there, kill the leftover workers (ps --ppid %d)",
                           type(exc).__name__, exc, os.getpid())


def shut_down_workers_at_exit(trainer: Any) -> None:
    """At interpreter exit, before multiprocessing's own exit hook (registered earlier, so run later)."""
    ref = weakref.ref(trainer)

    def shut_down() -> None:
        alive = ref()
        if alive is not None:
            shut_down_persistent_workers(alive)

    atexit.register(shut_down)


def _job_log_printer() -> Any:
    """transformers' PrinterCallback printing on the world's rank 0 only (its own prints on every node's local
    rank 0: under srun all nodes write into the one job log), and leaving ``logs`` as later callbacks get them
    (its own pops ``total_flos``)."""
    from transformers.trainer_callback import PrinterCallback

    class JobLogPrinter(PrinterCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                super().on_log(args, state, control, logs=dict(logs or {}), **kwargs)

    return JobLogPrinter()


def quiet_progress_bars(trainer: Any) -> None:
    """Where stderr is not a terminal (a Slurm job log), one printed line per logging step instead of tqdm bars:
    every redraw of a bar is kept in a file (tens of MB per job). Set SLURM_JIT_PROGRESS_BARS=1 to keep them."""
    isatty = getattr(sys.stderr, "isatty", None)  # sys.stderr is None where fd 2 was closed (a daemon, pythonw)
    if os.environ.get(PROGRESS_BARS_ENV) == "1" or (isatty is not None and isatty()):
        return
    from transformers.trainer_callback import ProgressCallback
    from transformers.utils import logging as hf_logging

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(_job_log_printer())
        hf_logging.disable_progress_bar()  # the bars of save_pretrained ("Writing model shards") and downloads
        logger.info("slurm_jit: stderr is not a terminal: one line per logging step, no progress bars "
                    "(%s=1 keeps them)", PROGRESS_BARS_ENV)


def _step_of(checkpoint: str) -> int | None:
    name = os.path.basename(os.path.normpath(checkpoint))
    step = name.removeprefix("checkpoint-")
    return int(step) if step.isdigit() else None


def _recorded_log_dir(out_dir: Path, record: Path) -> str | None:
    """The run directory the record names inside ``out_dir``, or None (and one warning line) when it is unusable:
    corrupt, not ours, or pointing outside ``out_dir``, into a checkpoint or at a path that cannot be a directory
    (what it names is written into, never trusted blindly)."""
    try:
        data = output_lock.read_json(record, TENSORBOARD_RECORD_MAX_BYTES)
        name = data.get("log_dir") if isinstance(data, dict) else None
        if not printable_name(name) or not _run_dir_name(name):
            raise ValueError(f"log_dir {name!r:.100} is not a run directory inside OUT_DIR")
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)  # a name too long, a file in the way: not later
    except (OSError, ValueError) as exc:  # read_json raises nothing else
        logger.warning("slurm_jit: %s unusable (%s): TensorBoard starts a new run directory. HINT: delete the "
                       "file; to continue a run, set TENSORBOARD_LOGGING_DIR to its directory", record,
                       one_line(exc))
        return None
    return os.path.join(out_dir, name)


def _run_dir_name(name: str) -> bool:
    """A run directory as :func:`_write_record` names them, ``runs/<time>_<host>``: inside OUT_DIR and never in
    the way of what else is there (a directory ``model.safetensors`` or ``config.json`` would fail the final
    save; a checkpoint's, slurm-jit's or a directory being deleted are not the run's to write into)."""
    parts = Path(name).parts
    return (len(parts) >= 2 and parts[0] == RUNS_DIR and not os.path.isabs(name) and ".." not in parts
            and not any(part.startswith("checkpoint-") for part in parts))


def _write_record(out_dir: Path, record: Path) -> str:
    """A new run directory for this training, kept in the record relative to ``out_dir`` (a moved or copied
    OUT_DIR continues its own run)."""
    from transformers.integrations.integration_utils import default_logdir

    name = default_logdir()
    try:
        write_small_json(record, {"log_dir": name})
    except OSError as exc:
        logger.warning("slurm_jit: cannot write %s (%s): a requeued job will start a new TensorBoard run. HINT: "
                       "make %s a writable directory", record, exc, record.parent)
    return os.path.join(out_dir, name)


def continue_tensorboard_run(trainer: Any, resume_from: str | None) -> None:
    """With ``report_to`` TensorBoard, a resumed job writes into the run directory of the training it continues
    (kept in OUT_DIR/slurm-jit/tensorboard.json), not into a new ``runs/<time>_<host>``; points after the
    resumed step (redone after a crash) are purged, so no step is shown twice. A fresh start begins a new run."""
    callback = next((c for c in trainer.callback_handler.callbacks if type(c).__name__ == "TensorBoardCallback"),
                    None)
    # getattr: these are the callback's own attributes in transformers 5.24; another version goes without
    if (callback is None or getattr(callback, "tb_writer", None) is not None
            or getattr(callback, "_SummaryWriter", None) is None
            or os.environ.get("TENSORBOARD_LOGGING_DIR") or not trainer.is_world_process_zero()):
        return  # no TensorBoard, a writer the user made, or a directory the user chose
    out_dir = Path(trainer.args.output_dir)
    record = out_dir / TIMING_DIR / TENSORBOARD_RECORD
    log_dir = None
    if resume_from is not None and (record.exists() or record.is_symlink()):
        log_dir = _recorded_log_dir(out_dir, record)
    if log_dir is None:
        log_dir = _write_record(out_dir, record)
    callback.logging_dir = log_dir
    # The writer class as transformers made it: a later train() in this process must not inherit a purge step
    writer = callback.__dict__.setdefault("_slurm_jit_summary_writer", callback._SummaryWriter)
    step = _step_of(resume_from) if resume_from is not None else None
    callback._SummaryWriter = writer if step is None else functools.partial(writer, purge_step=step + 1)
    if step is not None:
        logger.info("slurm_jit: TensorBoard run %s continued from step %d", log_dir, step)


def drop_upstream_jit(callback_handler: Any) -> None:
    """With ``enable_jit_checkpoint=True`` transformers adds its own JIT callback, which saves on SIGTERM rank by
    rank: removed (its SIGTERM handler put back first), never run beside JitTrainer's."""
    for callback in list(callback_handler.callbacks):
        if type(callback).__name__ != "JITCheckpointCallback":
            continue
        manager = getattr(callback, "jit_manager", None)
        previous = getattr(manager, "_original_sigterm_handler", None)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        callback_handler.remove_callback(callback)
        logger.warning("slurm_jit: replaced transformers' JIT checkpoint callback (enable_jit_checkpoint=True)")
