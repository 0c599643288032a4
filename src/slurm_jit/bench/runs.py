"""Start 2 real DeepSpeed CPU ranks of ``slurm_jit.demo_train``, signal them as Slurm would, watch them end.

The one place the benchmarks touch ranks: every run owns its processes and kills them at its deadline.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from slurm_jit import local_ranks

logger = logging.getLogger(__name__)

WORLD_SIZE = 2
START_TIMEOUT_S = 600  # model build + DeepSpeed init of the biggest (--full) model on a loaded 2-core host
POLL_S = 0.02  # how often a run is looked at: RSS samples, new checkpoints, exits
STEP_TIMES = "step-times-rank0.jsonl"  # written by demo_train --step-times


@dataclass(frozen=True, kw_only=True)
class Model:
    """The demo model of a benchmark: GPT-2 from a config, fp32 on CPU."""

    width: int  # hidden size
    layers: int
    heads: int = 8

    def args(self) -> list[str]:
        return ["--width", str(self.width), "--layers", str(self.layers), "--heads", str(self.heads)]

    def params(self) -> int:
        """GPT-2 parameters with the demo's tiny vocabulary: 12 w^2 + 13 w per layer, embeddings, final norm."""
        from slurm_jit.demo_train import SEQ_LEN, VOCAB

        w = self.width
        return self.layers * (12 * w * w + 13 * w) + (VOCAB + 2 * SEQ_LEN) * w + 2 * w


@dataclass
class Outcome:
    """What one run of ranks did, in seconds of ``time.monotonic()`` (system-wide, so the ranks' too)."""

    out: Path
    codes: list[int | None]  # None: still running at the deadline (killed: a hang)
    started: float  # when the ranks were started
    first_step_at: float | None = None  # when rank 0 ended its first step of this run
    signal_at: float | None = None  # the first signal
    ckpt_seen_at: float | None = None  # a new checkpoint directory appeared after the signal
    ckpt_seen_wall: float | None = None  # the same moment in time.time(), to compare with file mtimes
    ended_at: float | None = None  # every rank had exited (or was killed)
    steady_rss_bytes: int = 0  # largest sum of the ranks' RSS before the signal (after the warm-up steps)
    stop_rss_bytes: int = 0  # largest sum of the ranks' RSS from the signal until the end
    new_ckpts: list[Path] = field(default_factory=list)

    @property
    def hung(self) -> bool:
        return any(c is None for c in self.codes)

    @property
    def clean(self) -> bool:
        return self.codes == [0] * len(self.codes)

    @property
    def signal_to_exit_s(self) -> float | None:
        return None if self.signal_at is None or self.ended_at is None else self.ended_at - self.signal_at


def step_times(out: Path) -> list[float]:
    path = out / STEP_TIMES
    if not path.exists():
        return []
    return [json.loads(line)["time"] for line in path.read_text().splitlines() if line.strip()]


def rss_bytes(ranks: local_ranks.Ranks) -> int:
    total = 0
    for proc in ranks.procs:
        try:
            total += psutil.Process(proc.pid).memory_info().rss
        except psutil.Error:
            pass
    return total


def _ckpts(out: Path) -> set[Path]:
    return set(out.glob("checkpoint-*")) if out.is_dir() else set()


def start(out: Path, train_args: list[str]) -> local_ranks.Ranks:
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = ["-m", "slurm_jit.demo_train", "--output-dir", str(out), "--step-times", *train_args]
    return local_ranks.start(argv, WORLD_SIZE, out.parent / f"logs-{out.name}")


def _wait_steps(ranks: local_ranks.Ranks, out: Path, before: int, steps: int, outcome: Outcome) -> bool:
    """Until rank 0 ended ``steps`` steps of this run; samples the steady RSS after the first two."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        times = step_times(out)[before:]
        if times and outcome.first_step_at is None:
            outcome.first_step_at = times[0]
        if len(times) >= 2:
            outcome.steady_rss_bytes = max(outcome.steady_rss_bytes, rss_bytes(ranks))
        if len(times) >= steps:
            return True
        if any(p.poll() is not None for p in ranks.procs):
            return False
        time.sleep(POLL_S)
    return False


def run(out: Path, train_args: list[str], *, after_steps: int = 3, plan: tuple[float, ...] | None = (0.0, 0.0),
        hang_after_s: float = 60.0) -> Outcome:
    """Start 2 ranks; once ``after_steps`` steps ended, signal rank r (its whole process group, as Slurm does)
    ``plan[r]`` seconds after the first signal; a rank alive ``hang_after_s`` after the last signal is a hang.
    ``plan=None``: no signal, the run goes to its end."""
    before = len(step_times(out))
    ranks = start(out, train_args)
    outcome = Outcome(out=out, codes=[None] * WORLD_SIZE, started=ranks.started)
    try:
        reached = _wait_steps(ranks, out, before, after_steps if plan is not None else 1, outcome)
        if plan is None or not reached:
            outcome.codes = ranks.wait(START_TIMEOUT_S)
            outcome.ended_at = time.monotonic()
            return outcome
        _signal_and_watch(ranks, out, plan, hang_after_s, outcome)
    finally:
        ranks.kill()
    if not outcome.clean:
        logger.warning("bench: run %s ended with %s; log tail:\n%s", out, outcome.codes, ranks.log(0)[-1500:])
    return outcome


def _signal_and_watch(ranks: local_ranks.Ranks, out: Path, plan: tuple[float, ...], hang_after_s: float,
                      outcome: Outcome) -> None:
    before = _ckpts(out)
    first = time.monotonic()
    outcome.signal_at = first
    due = sorted((first + delay_s, rank) for rank, delay_s in enumerate(plan))
    deadline = first + max(plan) + hang_after_s
    while time.monotonic() < deadline and (due or any(p.poll() is None for p in ranks.procs)):
        now = time.monotonic()
        while due and due[0][0] <= now:
            ranks.signal(due.pop(0)[1], signal.SIGTERM)
        outcome.stop_rss_bytes = max(outcome.stop_rss_bytes, rss_bytes(ranks))
        if outcome.ckpt_seen_at is None and _ckpts(out) - before:
            outcome.ckpt_seen_at, outcome.ckpt_seen_wall = now, time.time()
        time.sleep(POLL_S)
    outcome.ended_at = time.monotonic()
    outcome.codes = ranks.wait(0.1)  # SIGKILLs what still runs: a hang
    outcome.new_ckpts = sorted(_ckpts(out) - before)


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def write_span_s(outcome: Outcome, ckpt: Path) -> float:
    """From the checkpoint directory first seen (polled every POLL_S) to its last file's mtime: the save's wall
    time as seen from outside, the same measure for any trainer."""
    if outcome.ckpt_seen_wall is None:
        raise ValueError(f"{ckpt} was never seen appearing")
    last = max(p.stat().st_mtime for p in ckpt.rglob("*") if p.is_file() and not p.is_symlink())
    return last - outcome.ckpt_seen_wall


def fsync_tree_s(path: Path) -> float:
    """Seconds to fsync every file under ``path``: what a writer that never syncs leaves to be made durable."""
    start_s = time.monotonic()
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.monotonic() - start_s
