"""The probe inside every rank of a ``tools/goodput`` training: the timeline and the schedule's faults.

Each rank appends JSON lines to ``EVENTS_DIR/events-rank<R>.jsonl``, every record with the job id and restart count
of its run and a wall time ``t`` (``time.time()``: comparable with Slurm's start and end times)::

    {"event": "start", "t_process": ...}     the process's creation (psutil), before the interpreter's imports
    {"event": "imports"}                      torch, transformers and deepspeed imported
    {"event": "train_begin"}                  Trainer.on_train_begin: model built, engine initialised
    {"event": "first_step", "step": S}        the first on_step_begin: the checkpoint loaded, resuming after step S
    {"event": "step", "step": S}              rank 0: the end of every step
    {"event": "kill", "step": S}              this rank SIGKILLs itself now
    {"event": "hang", "step": S}              this rank blocks forever from now
    {"event": "train_end", "step": S}

Faults (``EVENTS_DIR/faults.json``, from :meth:`~.schedule.Schedule.faults`) fire once per chain: a marker
``EVENTS_DIR/fired-<kind>`` is created (``O_EXCL``) first, so a run that resumes before the fault's step does not
fire it again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

HANG_SLEEP_S = 3600.0  # the hung rank sleeps in a loop: only SIGKILL ends it (the JitTrainer's handler returns)
FAULTS_FILE = "faults.json"


def events_path(events_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(events_dir) / f"events-rank{rank}.jsonl"


def process_start_time() -> float:
    """This process's creation, wall time (the interpreter's start and imports come after)."""
    import psutil

    return float(psutil.Process().create_time())


class EventLog:
    """One rank's event file; every record flushed at once (a SIGKILL loses none written before it)."""

    def __init__(self, events_dir: str | os.PathLike[str], rank: int) -> None:
        self.rank = rank
        self.run = {"job": os.environ.get("SLURM_JOB_ID", ""),
                    "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)}
        Path(events_dir).mkdir(parents=True, exist_ok=True)
        self._file = open(events_path(events_dir, rank), "a", encoding="utf-8")  # noqa: SIM115 - for the process

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "rank": self.rank, **self.run, "t": time.time(), **fields}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


def read_faults(events_dir: str | os.PathLike[str]) -> dict[str, dict[str, int]]:
    """The faults to fire ({} for the uninterrupted reference: no faults file)."""
    path = Path(events_dir) / FAULTS_FILE
    if not path.is_file():
        return {}
    faults: dict[str, dict[str, int]] = json.loads(path.read_text(encoding="utf-8"))
    return faults


def _claim(events_dir: str | os.PathLike[str], kind: str) -> bool:
    """True once per chain: this call created the fault's marker."""
    try:
        os.close(os.open(Path(events_dir) / f"fired-{kind}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def callback(events_dir: str | os.PathLike[str], log: EventLog) -> Any:
    """The TrainerCallback that writes the timeline and fires the faults of ``events_dir``'s faults.json."""
    import transformers

    faults = read_faults(events_dir)
    kill, hang = faults.get("kill"), faults.get("hang")

    def due(fault: dict[str, int] | None, step: int) -> bool:
        return fault is not None and fault["rank"] == log.rank and step >= fault["step"]

    class Probe(transformers.TrainerCallback):
        first = True

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            log.write("train_begin")

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.first:
                self.first = False
                log.write("first_step", step=state.global_step)
            if due(hang, state.global_step) and _claim(events_dir, "hang"):
                log.write("hang", step=state.global_step)
                while True:  # a rank stuck (a deadlock, a driver): no step end, no collective, no exit
                    time.sleep(HANG_SLEEP_S)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if log.rank == 0:
                log.write("step", step=state.global_step)
            if due(kill, state.global_step) and _claim(events_dir, "kill"):
                log.write("kill", step=state.global_step)
                os.kill(os.getpid(), signal.SIGKILL)  # an OOM kill, a lost node: no warning

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            log.write("train_end", step=state.global_step)

    return Probe()
