"""The timing log: step, save and evaluation times that the grace-period calculator sizes ``--signal`` from.

The JitTrainer appends one JSON object per line to ``OUT_DIR/slurm-jit/timing-rank<R>.jsonl`` (one file per
global rank, so ranks never contend for a lock, and kept across restarts: every run appends). Records::

    {"v": 1, "event": "start", "rank": 0, "world_size": 2, "run_id": "...", "job_id": "123", "restart": 0,
     "time": 1.7e9}
    {"v": 1, "event": "step",  "rank": 0, "world_size": 2, "run_id": "...", "step": 12, "dur_s": 0.21,
     "warmup": false}
    {"v": 1, "event": "save",  "rank": 0, "world_size": 2, "run_id": "...", "step": 12, "dur_s": 3.4,
     "kind": "jit", "bytes": 123456, "phases": {"begin": 0.01, "write": 2.1, ..., "rotate": 0.02}}
    {"v": 1, "event": "eval",  "rank": 0, "world_size": 2, "run_id": "...", "step": 12, "dur_s": 1.9,
     "aborted": false}
    {"v": 1, "event": "agreement", ..., "step": 3, "dur_s": 0.0004, "mode": "blocking", "step_s": 2.1,
     "threshold_s": 0.5, "kill_wait_s": 3.0}
    {"v": 1, "event": "stop", ..., "step": 14, "dur_s": 5.2, "signal_step": 14, "mode": "blocking",
     "kill_wait_s": 3.0, "signal_to_save_s": 3.0, "save_s": 1.9, "teardown_s": 0.3, "signal_time": 1.7e9,
     "save_start_time": 1.7e9, "end_time": 1.7e9}
    {"v": 1, "event": "batch", ..., "dur_s": 0, "from_world_size": 2, "to_world_size": 1,
     "accumulation_from": 1, "accumulation_to": 2, "samples_per_step": 4}
    {"v": 1, "event": "exit", ..., "step": 14, "dur_s": 1.2, "time": 1.7e9}
    {"v": 1, "event": "save_blocked", ..., "step": 12, "dur_s": 0.3, "kind": "periodic", "staged_bytes": 123456,
     "phases": {"wait_previous": 0.0, "begin": 0.01, "write": 0.2, "stage": 0.05, ...}}
    {"v": 1, "event": "save_background", ..., "step": 12, "dur_s": 2.9, "kind": "periodic", "bytes": 123456,
     "write_s": 2.1, "fsync_s": 0.5, "commit_s": 0.3, "file_max_s": 1.2, "staged_bytes": 123456}

``agreement`` (once per run, after warm-up): how the ranks read their stop rounds from then on (``dur_s``: the
agreed cost of one blocking round); ``stop`` (on a JIT stop): ``dur_s`` from this rank's first signal until
``train()`` returned, and where that time went. The grace calculator reads both. ``batch`` (rank 0, at a resume
on another world size): the gradient accumulation changed to keep the global batch (train/keep_batch.py).
``exit`` (after a JIT stop, written by a watcher process once the rank's process has ended, train/exit_watch.py):
``dur_s`` from ``train()`` returning (the stop record's ``end_time``) until the process was gone: DeepSpeed's and
gloo's shutdown, the script's own end, the interpreter's exit; the grace calculator adds the longest to the
teardown. ``save_blocked`` and ``save_background`` (an async periodic save, JitConfig(async_periodic_saves=True)):
the seconds training was blocked, and those of the background write and commit (rank 0: until the manifest); they
are not ``save`` records: the grace calculator sizes the (synchronous) JIT save from synchronous saves only, and
counts the longest background write and commit (with the longest block) as a term of its own, ``async_save``: a JIT
stop waits for the save in flight (:func:`async_save_stats`, grace/estimates.py).

The first ``WARMUP_STEPS`` steps of every run are marked ``warmup`` (they include one-time compilation and
allocation) and are left out of the step statistics. This module imports no torch.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from slurm_jit import held_locks, safe_read

FORMAT_VERSION = 1
TIMING_DIR = "slurm-jit"
WARMUP_STEPS = 2  # the first steps of a run pay for allocator warm-up and DeepSpeed's first-use op builds
logger = logging.getLogger(__name__)

FLUSH_EVERY_STEPS = 20  # bounded loss on a SIGKILL, without a write per step
SHOWN_ERROR_CHARS = 200  # of a parser's error in a one-line TimingLogError


def timing_dir(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / TIMING_DIR


def timing_path(output_dir: str | os.PathLike[str], rank: int) -> Path:
    return timing_dir(output_dir) / f"timing-rank{rank}.jsonl"


def _restart(job_id: str | None) -> int | None:
    """This run's restart of its Slurm job (status shows each restart's world size); Slurm sets
    SLURM_RESTART_COUNT only from the first restart on, so a job's first run is 0; None outside Slurm."""
    restart = os.environ.get("SLURM_RESTART_COUNT", "")
    return int(restart) if restart.isdigit() else (0 if job_id else None)


class TimingLog:
    """Appends one rank's timing records; cheap enough to call every step."""

    def __init__(self, output_dir: str | os.PathLike[str], rank: int, world_size: int, run_id: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self._steps_seen = 0
        self._unflushed = 0
        path = self.path = timing_path(output_dir, rank)
        self._file: IO[str] | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        except OSError as exc:  # no inode left, a quota of files: as a full disk later on, never the training
            self._give_up(exc)
        job_id = os.environ.get("SLURM_JOB_ID")
        self._write({"event": "start", "job_id": job_id, "restart": _restart(job_id), "time": time.time()})
        self.flush()

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps({**self.base(), **record}) + "\n")
        except OSError as exc:
            self._give_up(exc)
            return
        self._unflushed += 1

    def base(self) -> dict[str, Any]:
        """The fields every record of this log starts with (train/exit_watch.py writes its record with them)."""
        return {"v": FORMAT_VERSION, "rank": self.rank, "world_size": self.world_size, "run_id": self.run_id}

    def _give_up(self, exc: OSError) -> None:
        """The log is diagnostics: a full disk (or a lost mount) stops it, never the training, and never masks
        the error that ends training (close() runs in train()'s finally)."""
        handle, self._file = self._file, None
        logger.warning("slurm_jit: timing log of rank %d not written any further: %s", self.rank, exc)
        if handle is not None:
            try:
                handle.close()  # closes the descriptor even when its last flush fails
            except OSError:
                pass

    def step(self, step: int, dur_s: float) -> None:
        self._steps_seen += 1
        self._write({"event": "step", "step": step, "dur_s": dur_s, "warmup": self._steps_seen <= WARMUP_STEPS})
        if self._unflushed >= FLUSH_EVERY_STEPS:
            self.flush()

    def save(self, step: int, kind: str, dur_s: float, nbytes: int, phases: dict[str, float] | None = None) -> None:
        """One save on this rank; ``phases``: where its seconds went, in order (train/save_path.py SAVE_PHASES)."""
        self._write({"event": "save", "step": step, "kind": kind, "dur_s": dur_s, "bytes": nbytes,
                     **({"phases": phases} if phases else {})})
        self.flush()

    def save_blocked(self, step: int, kind: str, dur_s: float, nbytes: int, phases: dict[str, float]) -> None:
        """An async periodic save: the seconds training was blocked (train/async_save/periodic.py)."""
        self._write({"event": "save_blocked", "step": step, "kind": kind, "dur_s": dur_s, "staged_bytes": nbytes,
                     "phases": phases})
        self.flush()

    def save_background(self, step: int, kind: str, dur_s: float, nbytes: int, fields: dict[str, Any]) -> None:
        """An async periodic save: the seconds of its background write and commit, apart from training's."""
        self._write({**fields, "event": "save_background", "step": step, "kind": kind, "dur_s": dur_s,
                     "bytes": nbytes})
        self.flush()

    def conversion(self, step: int, dur_s: float, bytes: int, from_world_size: int) -> None:  # noqa: A002
        """Rank 0: an elastic resume's conversion to DeepSpeed's universal format (before the first step)."""
        self._write({"event": "convert", "step": step, "dur_s": dur_s, "bytes": bytes,
                     "from_world_size": from_world_size})
        self.flush()  # once per run, and what grace-calc sizes the next conversion by: kept if the run is killed

    def kept_batch(self, record: dict[str, int]) -> None:
        """Rank 0: the gradient accumulation changed to keep the global batch on another world size."""
        self._write({**record, "event": "batch", "dur_s": 0.0})
        self.flush()  # status names this run's accumulation even when it is killed before its first flush

    def evaluation(self, step: int, dur_s: float, aborted: bool) -> None:
        self._write({"event": "eval", "step": step, "dur_s": dur_s, "aborted": aborted})
        self.flush()

    def agreement(self, step: int, *, mode: str, allreduce_s: float, step_s: float, threshold_s: float,
                  kill_wait_s: float) -> None:
        self._write({"event": "agreement", "step": step, "dur_s": allreduce_s, "mode": mode, "step_s": step_s,
                     "threshold_s": threshold_s, "kill_wait_s": kill_wait_s})
        self.flush()

    def stop(self, step: int, *, signal_to_end_s: float, fields: dict[str, Any]) -> None:
        """A JIT stop: ``signal_to_end_s`` from this rank's first signal until train() returned; ``fields``: the
        parts (signal_step, mode, kill_wait_s, signal_to_save_s, save_s, teardown_s, wall-clock times)."""
        self._write({**fields, "event": "stop", "step": step, "dur_s": signal_to_end_s})
        self.flush()

    def flush(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
            except OSError as exc:
                self._give_up(exc)
            self._unflushed = 0

    def close(self) -> None:
        handle, self._file = self._file, None
        if handle is not None:
            try:
                handle.close()
            except OSError as exc:
                logger.warning("slurm_jit: timing log of rank %d: last records lost: %s", self.rank, exc)


class TimingLogError(ValueError):
    """The timing log is missing or malformed; the message says where."""


@dataclass(frozen=True, kw_only=True)
class SaveStats:
    count: int  # saves of this kind that finished
    max_dur_s: float  # the longest one (over all ranks: a save ends when its slowest rank ends)
    max_bytes: int  # the largest checkpoint of this kind, in bytes


@dataclass(frozen=True, kw_only=True)
class StepStats:
    n: int  # step samples (warm-up left out)
    max_s: float
    p99_s: float


@dataclass(frozen=True, kw_only=True)
class TimingSummary:
    """What the grace-period calculator needs from a timing log."""

    n_steps: int  # steps measured (each (run, step) once, whichever ranks recorded it; warm-up left out)
    n_runs: int  # how many starts (restarts included) the log covers
    world_sizes: frozenset[int]  # the world sizes the records were written with
    step_max_s: float | None
    step_p99_s: float | None
    step_median_s: float | None
    saves: dict[str, SaveStats] = field(default_factory=dict)  # by kind: jit / periodic / final
    n_evals: int = 0
    eval_max_s: float | None = None
    # Step statistics by how the runs read their stop rounds ("blocking", "overlapped"; "unknown": a run that
    # recorded no agreement mode, e.g. a log written before the modes existed).
    steps_by_mode: dict[str, StepStats] = field(default_factory=dict)
    kill_wait_s: float | None = None  # the longest kill_wait any run recorded
    n_stops: int = 0  # JIT stops recorded (all ranks)
    teardown_max_s: float | None = None  # longest time from a JIT save's end until train() returned
    n_exits: int = 0  # "exit" records: a rank's process gone after a JIT stop (train/exit_watch.py)
    exit_max_s: float | None = None  # longest time from train() returning after a JIT stop to the process's end
    async_saves: AsyncSaveStats | None = None  # async periodic saves (save_blocked/save_background); None: none


@dataclass(frozen=True, kw_only=True)
class AsyncSaveStats:
    """Async periodic saves (``save_blocked`` and ``save_background`` records): two separate figures, training's
    blocked seconds and the background's write and commit, each save's slowest rank (rank 0's background commits,
    so its record holds the wait for the other ranks' markers too)."""

    count: int  # async saves submitted (each (run, step) once)
    blocked_max_s: float  # the longest training was blocked by one (its wait for the save before it included)
    blocked_median_s: float  # the median, over saves, of each save's slowest rank
    n_background: int  # of those, saves whose background write was seen committed (a killed run's last one is not)
    background_max_s: float | None  # the longest write + fsync + commit in the background; None: none seen ended
    background_median_s: float | None
    staged_max_bytes: int  # the largest staging buffer one rank filled (its host memory's extra copy)
    set_aside_max_s: float | None = None  # the longest a write had taken when a JIT stop set it aside (at least)
    file_max_s: float | None = None  # the longest one file of a background write took; None: none recorded


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty list."""
    index = max(0, math.ceil(q / 100.0 * len(sorted_values)) - 1)
    return sorted_values[index]


def read_records(output_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of all ranks; raises TimingLogError with the file and line of a malformed one."""
    directory = timing_dir(output_dir)
    paths = sorted(directory.glob("timing-rank*.jsonl")) if directory.is_dir() else []
    if not paths:
        raise TimingLogError(
            f"no timing log in {directory}. HINT: run the training with slurm_jit.JitTrainer first, "
            "or give --step-time and --save-time"
        )
    records: list[dict[str, Any]] = []
    for path in paths:
        records.extend(_read_file(path))
    return records


def _read_lines(path: Path) -> list[str]:
    """A timing log's lines, read by :func:`slurm_jit.safe_read.open_regular`: from a regular file only (a FIFO is
    not waited on), and this process's output lock (through a hard link) is never opened: closing it would drop
    the lock (:mod:`slurm_jit.held_locks`)."""
    hint = "HINT: a timing log is a file slurm_jit writes: move this one away"
    lock_name = held_locks.held_lock(path)
    if lock_name is not None:
        raise TimingLogError(f"{path}: a link to this training's {lock_name}. {hint}")
    try:
        handle = safe_read.open_regular(path)
    except safe_read.UntrustedFile as exc:
        raise TimingLogError(f"{path}: {exc}. {hint}") from None
    except OSError as exc:
        raise TimingLogError(f"{path}: cannot be read as a file ({exc.strerror}). {hint}") from None
    with io.TextIOWrapper(handle, encoding="utf-8", errors="replace") as text:
        return text.readlines()


def _read_file(path: Path) -> Iterable[dict[str, Any]]:
    lines = _read_lines(path)
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = safe_read.parse_json(line)
        except ValueError as exc:  # not JSON, or nested past the recursion limit
            if lineno == len(lines) and not line.endswith("\n"):
                continue  # the last line of a killed run may be cut short: not an error
            raise TimingLogError(f"{path}:{lineno}: not JSON ({_short(exc)}). HINT: the file is damaged; move it "
                                 "away") from None
        if not isinstance(record, dict) or not isinstance(record.get("event"), str):
            raise TimingLogError(f"{path}:{lineno}: not a timing record")
        dur = record.get("dur_s")
        if record["event"] != "start" and _seconds(dur) is None:
            raise TimingLogError(f"{path}:{lineno}: bad dur_s {dur!r}")
        yield record


def _short(exc: Exception) -> str:
    """A parser's error in one bounded line (it may quote the input)."""
    return " ".join(str(exc).split())[:SHOWN_ERROR_CHARS]


def summarize(records: Iterable[dict[str, Any]]) -> TimingSummary:
    """Step, save and eval statistics over all ranks and all runs of a timing log."""
    records = list(records)
    steps: list[float] = []
    saves: dict[str, list[dict[str, Any]]] = {}
    evals: list[float] = []
    runs: set[str] = set()
    world_sizes: set[int] = set()
    # Every rank writes its own record of a step: a step counts once per (run, step), its duration the slowest
    # rank's (a 400-step run on 2 ranks is 400 steps, not 800).
    step_keys: set[tuple[str, Any]] = set()
    eval_keys: set[tuple[str, Any]] = set()
    for record in records:
        run_id = str(record.get("run_id"))
        runs.add(run_id)
        if _plain_int(record.get("world_size")):
            world_sizes.add(record["world_size"])
        event = record["event"]
        if event == "step" and not record.get("warmup"):
            steps.append(float(record["dur_s"]))
            step_keys.add(_sample_key(record))
        elif event == "save":
            saves.setdefault(str(record.get("kind", "unknown")), []).append(record)
        elif event == "eval":
            evals.append(float(record["dur_s"]))
            eval_keys.add(_sample_key(record))
    steps.sort()
    stops = [r for r in records if r["event"] == "stop"]
    teardowns = [float(r["teardown_s"]) for r in stops if _seconds(r.get("teardown_s")) is not None]
    exits = [float(r["dur_s"]) for r in records if r["event"] == "exit"]
    kill_waits = [float(r["kill_wait_s"]) for r in records
                  if r["event"] in ("agreement", "stop") and _seconds(r.get("kill_wait_s")) is not None]
    return TimingSummary(
        n_steps=len(step_keys),
        n_runs=len(runs),
        world_sizes=frozenset(world_sizes),
        step_max_s=steps[-1] if steps else None,
        step_p99_s=_percentile(steps, 99) if steps else None,
        step_median_s=_percentile(steps, 50) if steps else None,
        saves={
            kind: SaveStats(
                count=len({(str(r.get("run_id")), _step_of(r)) for r in recs}),
                max_dur_s=max(float(r["dur_s"]) for r in recs),
                max_bytes=max(_recorded_bytes(r.get("bytes")) for r in recs),
            )
            for kind, recs in saves.items()
        },
        n_evals=len(eval_keys),
        eval_max_s=max(evals) if evals else None,
        steps_by_mode=_steps_by_mode(records),
        kill_wait_s=max(kill_waits) if kill_waits else None,
        n_stops=len(stops),
        teardown_max_s=max(teardowns) if teardowns else None,
        n_exits=len(exits),
        exit_max_s=max(exits) if exits else None,
        async_saves=async_save_stats(records),
    )


def async_save_stats(records: Iterable[dict[str, Any]]) -> AsyncSaveStats | None:
    """The async periodic saves of a timing log, per save its slowest rank; None when it has none."""
    blocked: dict[tuple[str, Any], float] = {}
    background: dict[tuple[str, Any], float] = {}
    set_aside: dict[tuple[str, Any], float] = {}  # never ended: their time so far, apart from the writes seen ended
    staged, file_max = 0, []
    for record in records:
        event = record["event"]
        if event in ("save_blocked", "save_background"):
            into = blocked if event == "save_blocked" else set_aside if record.get("set_aside") else background
            key = _sample_key(record)
            into[key] = max(into.get(key, 0.0), float(record["dur_s"]))
            staged = max(staged, _recorded_bytes(record.get("staged_bytes")))
            file_max.append(_seconds(record.get("file_max_s")))  # one file's write (a set-aside write records none)
    if not blocked and not background and not set_aside:
        return None
    waits, writes = sorted(blocked.values()), sorted(background.values())
    return AsyncSaveStats(
        count=len(blocked.keys() | background.keys() | set_aside.keys()),
        blocked_max_s=waits[-1] if waits else 0.0,
        blocked_median_s=_percentile(waits, 50) if waits else 0.0,
        n_background=len(writes),
        background_max_s=writes[-1] if writes else None,
        background_median_s=_percentile(writes, 50) if writes else None,
        staged_max_bytes=staged,
        set_aside_max_s=max(set_aside.values()) if set_aside else None,
        file_max_s=max((s for s in file_max if s is not None), default=None),
    )


def _sample_key(record: dict[str, Any]) -> tuple[str, Any]:
    """What one step (or evaluation) is, whichever rank recorded it: its run and step; a record without a step
    number (an old log, or a step that is no plain integer) counts on its own."""
    step = _step_of(record)
    return str(record.get("run_id")), (step if step is not None else ("record", id(record)))


def _step_of(record: dict[str, Any]) -> int | None:
    """The record's step when it is a plain integer (a list or an object is no step, and no set key)."""
    step = record.get("step")
    return step if _plain_int(step) else None


def _plain_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seconds(value: Any) -> float | None:
    """``value`` as seconds when it is a finite number, 0 or more (an integer of 400 digits is valid JSON and
    too large for a float: no number of seconds either), else None."""
    if not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _steps_by_mode(records: list[dict[str, Any]]) -> dict[str, StepStats]:
    """Step statistics grouped by the agreement mode each run recorded (a run keeps one mode)."""
    modes = {str(r.get("run_id")): str(r.get("mode")) for r in records if r["event"] == "agreement"}
    slowest: dict[tuple[str, Any], float] = {}  # each step's slowest rank: the step the stop waits for
    for record in records:
        if record["event"] == "step" and not record.get("warmup"):
            key = _sample_key(record)
            slowest[key] = max(slowest.get(key, 0.0), float(record["dur_s"]))
    grouped: dict[str, list[float]] = {}
    for (run_id, _), dur_s in slowest.items():
        grouped.setdefault(modes.get(run_id, "unknown"), []).append(dur_s)
    return {mode: StepStats(n=len(d), max_s=max(d), p99_s=_percentile(sorted(d), 99)) for mode, d in grouped.items()}


# The largest file size there is (off_t, signed 64 bits): recorded bytes beyond it are not a measurement.
MAX_RECORDED_BYTES = 2**63 - 1


def conversions(records: Iterable[dict[str, Any]]) -> list[tuple[float, int]]:
    """(seconds, bytes written) of every elastic-resume conversion recorded (any world size); bytes 0 (unknown)
    where the record's are not a plain count of bytes (true, a float, negative, beyond any file)."""
    return [(float(r["dur_s"]), _recorded_bytes(r.get("bytes"))) for r in records if r["event"] == "convert"]


def starts(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's start record of every run, in the order the runs started (each run appends to rank 0's file)."""
    return [r for r in records if r["event"] == "start" and r.get("rank") == 0]


def _recorded_bytes(value: Any) -> int:
    """A record's bytes when they are a plain count of bytes, else 0 (unknown): text, true, a float (1e400 is
    infinite), a list, a negative count, one beyond any file."""
    return value if _plain_int(value) and 0 <= value <= MAX_RECORDED_BYTES else 0


def load_summary(output_dir: str | os.PathLike[str]) -> TimingSummary:
    """Read and summarize ``OUT_DIR/slurm-jit/timing-rank*.jsonl``."""
    return summarize(read_records(output_dir))
