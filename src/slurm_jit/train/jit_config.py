"""``JitConfig``: how JitTrainer reacts to stop signals, and the checks that refuse a bad one in one line.

Owns the config's fields, their bounds (:data:`MAX_CONFIG_S`) and the signals that cannot request a stop.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass

from slurm_jit.grace.calc import SLURM_SIGNAL_LEAD_MAX_S
from slurm_jit.signal_names import parse_signal
from slurm_jit.train import elastic, watchdog
from slurm_jit.train.agreement import SIDE_GROUP_TIMEOUT_S

# A JitConfig duration above Slurm's largest signal lead can never be waited out before the kill (and a huge one
# overflows time.sleep on the stop path).
MAX_CONFIG_S = SLURM_SIGNAL_LEAD_MAX_S
# Signals that cannot request a stop: uncatchable, sent for other reasons (SIGCHLD at every DataLoader worker's
# exit), or faults (a handler that only sets a flag returns to the faulting instruction).
UNFIT_STOP_SIGNALS = {
    signal.SIGKILL: "cannot be caught", signal.SIGSTOP: "cannot be caught",
    signal.SIGCHLD: "is sent whenever a child process (a DataLoader worker) exits",
    signal.SIGCONT: "is sent on every resume of a stopped process", signal.SIGURG: "is not a stop request",
    signal.SIGWINCH: "is not a stop request", signal.SIGSEGV: "is a fault", signal.SIGBUS: "is a fault",
    signal.SIGILL: "is a fault", signal.SIGFPE: "is a fault",
}
DEFAULT_KILL_WAIT_S = 3.0  # transformers' kill_wait: a SIGKILL this soon after SIGTERM makes a save pointless


@dataclass(frozen=True, kw_only=True)
class JitConfig:
    """How JitTrainer reacts to stop signals."""

    kill_wait_s: float = DEFAULT_KILL_WAIT_S  # a checkpoint is started only this long after the first signal
    signals: tuple[str, ...] = ("TERM",)  # signal names that request a JIT stop (e.g. ("TERM", "USR1"))
    jit_save_model_weights: bool = False  # also write model.safetensors (under ZeRO-3: gather 16-bit weights)
    # Under ZeRO-1/2 a JIT save writes the module weights once, in the optimizer shards' fp32 master copy, not again
    # in DeepSpeed's model-states file (train/slim_save.py); False: DeepSpeed's layout (a plain Trainer resumes it).
    # A PEFT model's saves are transformers' layout either way (the adapters only, no frozen base: both resume it)
    slim_jit_save: bool = True
    ignore_signals_in_workers: bool = True  # DataLoader workers ignore the stop signals
    grace_check: bool = True  # under Slurm, warn when the signal lead is shorter than the grace needed
    side_group_timeout_s: float = SIDE_GROUP_TIMEOUT_S  # timeout of the gloo side group's collectives
    # On a resume of the checkpoint's command by another number of ranks, set the gradient accumulation so that the
    # samples per optimizer step stay the checkpoint's (train/keep_batch.py; a batch the user changed is trained
    # with); False: refuse every resume whose samples per optimizer step differ, the user's change included
    keep_global_batch: bool = True
    convert_timeout_s: float = elastic.CONVERT_TIMEOUT_S  # an elastic resume's conversion (train/elastic.py)
    # A step (or evaluation batch) longer than this is a hang: stacks to the log, stop record ``hung``, exit 87
    # (train/watchdog.py). "auto": max(10 x the longest step, 300 s) after warm-up; None: no watchdog.
    hang_timeout_s: float | str | None = watchdog.AUTO
    # torch.save's CRC-32 of every zip record in this trainer's saves: 1-1.3 s per GB per core, half a ZeRO-2
    # save's time (docs/benchmarks.md). The manifest's xxh3-128 of every file guards the bytes; torch.load,
    # DeepSpeed and zero_to_fp32.py do not check the CRC (zipfile and `unzip -t` report it). True: torch's default
    zip_crc32: bool = False
    # Periodic saves staged in host memory and written by a background thread while training goes on
    # (train/async_save/periodic.py, issue #23): DeepSpeed ZeRO-0/1/2 only; JIT and final saves stay synchronous.
    # Off until proven by issue #23's kill tests: False is the synchronous save of every checkpoint
    async_periodic_saves: bool = False
    # After a JIT stop, end the process (status 0) once the checkpoint is durable and the stop record written, so
    # that nothing a script does after train() (its final save_model, metrics, evaluation, Hub push) runs in the
    # grace period; atexit handlers still run. False: train() returns and the script checks trainer.jit_stopped
    exit_after_jit_stop: bool = True

    def __post_init__(self) -> None:
        for name in ("kill_wait_s", "side_group_timeout_s", "convert_timeout_s"):
            _check_seconds(name, getattr(self, name), allow_zero=name == "kill_wait_s")
        if self.hang_timeout_s is not None and self.hang_timeout_s != watchdog.AUTO:
            if isinstance(self.hang_timeout_s, str):
                raise ValueError(f"hang_timeout_s={self.hang_timeout_s!r}. HINT: a number of seconds, "
                                 f"{watchdog.AUTO!r} (derived from the steps measured) or None (no watchdog)")
            _check_seconds("hang_timeout_s", self.hang_timeout_s, allow_zero=False)
        if not isinstance(self.async_periodic_saves, bool):
            raise ValueError(f"async_periodic_saves={self.async_periodic_saves!r}. HINT: True (periodic saves "
                             "written in the background) or False (the default: synchronous saves)")
        if not isinstance(self.exit_after_jit_stop, bool):
            raise ValueError(f"exit_after_jit_stop={self.exit_after_jit_stop!r}. HINT: True (the default: the process "
                             "ends after a JIT stop) or False (train() returns; check trainer.jit_stopped)")
        if not isinstance(self.keep_global_batch, bool):
            raise ValueError(f"keep_global_batch={self.keep_global_batch!r}. HINT: True (the default: change the "
                             "gradient accumulation on another world size) or False (refuse such a resume)")
        if isinstance(self.signals, str) or not isinstance(self.signals, tuple | list):
            raise ValueError(f"signals={self.signals!r} is not a tuple of names. HINT: signals=('TERM',)")
        if not self.signals:
            raise ValueError("signals is empty. HINT: signals=('TERM',)")
        seen: set[signal.Signals] = set()
        for name in self.signals:
            signum = parse_signal(name)
            if signum in UNFIT_STOP_SIGNALS:
                raise ValueError(f"signals: {name!r} {UNFIT_STOP_SIGNALS[signum]}. HINT: use TERM or USR1")
            if signum in seen:
                raise ValueError(f"signals={tuple(self.signals)!r} names {signum.name} twice. HINT: list each "
                                 "signal once, e.g. ('TERM', 'USR1')")
            seen.add(signum)


def _check_seconds(name: str, value: object, allow_zero: bool) -> None:
    """A JitConfig duration: a finite number of seconds, >= 0 (or > 0), at most MAX_CONFIG_S."""
    number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    if not (0 <= number <= MAX_CONFIG_S and (allow_zero or number > 0)):  # NaN fails every comparison
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r}. HINT: a number of seconds {bound} and <= {MAX_CONFIG_S}, e.g. 3")
