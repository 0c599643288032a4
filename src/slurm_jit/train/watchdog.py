"""The hang watchdog: a per-rank daemon thread that ends a rank stuck between two boundaries.

A JIT stop needs a step boundary; a rank stuck in a collective whose peer is gone, in user code, in a DataLoader
worker or in I/O never reaches one, and the job would burn its allocation. The trainer's rooms *feed* the watchdog
at each boundary (a step's end, each evaluation batch, a save's start and end) with the phase they enter; feeding is
one tuple assignment. The thread only reads that tuple: when its deadline has passed it writes every thread's
stack to the job log (:mod:`faulthandler`), hands what it saw to ``on_hang`` (the stop path writes the ``hung``
stop record) and ends the process with :data:`HUNG_EXIT_CODE`.

Bounds (:func:`bound_s`): a step or an evaluation batch gets ``hang_timeout_s``; with ``"auto"`` that is
``max(AUTO_STEP_FACTOR x the longest step so far, AUTO_MIN_S)`` after warm-up and :data:`AUTO_WARMUP_S` before.
Phases that are legitimately long and not cut into batches here (the first step's compilation and op builds, a
save, ``compute_metrics`` over the whole evaluation set, the end of training) get :func:`long_bound_s`, never less
than :data:`LONG_PHASE_MIN_S`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slurm_jit.timing import WARMUP_STEPS
from slurm_jit.train import dist_env

logger = logging.getLogger(__name__)

AUTO = "auto"
# The derived bound: nvidia-resiliency-ext's in-job detection defaults to minutes, not steps; ten of the longest
# step leaves room for a slow batch (a long sequence, a logging step) without waiting out a whole allocation.
AUTO_STEP_FACTOR = 10
AUTO_MIN_S = 300.0  # the derived bound's floor: a filesystem hiccup or a checkpoint's page-cache flush is minutes
AUTO_WARMUP_S = 1800.0  # before warm-up nothing is measured: torch.distributed's own collective timeout
# Phases not fed from inside (a save's writes, the first step's compilation, upstream's end of training):
LONG_PHASE_FACTOR = 10  # ... get ten times a step's bound
LONG_PHASE_MIN_S = 600.0  # ... and never under ten minutes (a slow writer's save of a large model)
LONG_PHASES = frozenset({"first step", "save", "end of training", "metrics"})  # metrics: compute_metrics
POLL_MAX_S = 5.0  # the thread wakes at most this far apart: a hang is seen within bound + 5 s
POLL_FRACTION = 4  # ... and four times per bound for short test bounds
HUNG_EXIT_CODE = 87  # the process exit code of a rank the watchdog ended (not a signal's 128+N, not 1 or 2)
# Rank 0 waits this long for the other ranks' hang reports before writing the record, past one poll interval of
# theirs (:meth:`Watchdog.report_wait_s`): fed at the same boundary, a peer's thread may wake a whole interval later
PEER_REPORT_WAIT_S = 3.0
# The longest a firing thread takes before its exit: the report wait (a poll interval and PEER_REPORT_WAIT_S), the
# trackers' TRACKER_WAIT_S (5 s, train/trackers.py), a second for the writes. A train() that ends meanwhile (its
# collective failed as the peer exited) waits this long for it: the process must not exit before the record
FIRING_MAX_S = POLL_MAX_S + PEER_REPORT_WAIT_S + 5.0 + 1.0


def bound_s(hang_timeout_s: float | str, longest_step_s: float, steps_done: int) -> float:
    """How long a step or an evaluation batch may take before it is a hang."""
    if hang_timeout_s != AUTO:
        return float(hang_timeout_s)
    if steps_done <= WARMUP_STEPS:
        return AUTO_WARMUP_S
    return max(AUTO_STEP_FACTOR * longest_step_s, AUTO_MIN_S)


def long_bound_s(step_bound_s: float) -> float:
    """How long a save, the first step or the end of training may take."""
    return max(LONG_PHASE_FACTOR * step_bound_s, LONG_PHASE_MIN_S)


@dataclass(frozen=True)
class Hang:
    """What the watchdog saw when it fired."""

    rank: int
    step: int
    phase: str
    since_s: float  # seconds since the last boundary
    bound_s: float
    node: str
    frame: str  # the innermost frame of the main thread when it fired: where it waits


def main_thread_frame() -> str:
    """``file:line in function`` of the main thread's innermost Python frame."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


class Watchdog:
    """One rank's watchdog for one ``train()``; :meth:`feed` at boundaries, :meth:`stop` at its end."""

    def __init__(self, hang_timeout_s: float | str, rank: int, on_hang: Callable[[Hang], None],
                 exit_fn: Callable[[int], Any] = os._exit) -> None:
        self.hang_timeout_s = hang_timeout_s
        self.rank = rank
        self._on_hang = on_hang
        self._exit = exit_fn
        self._longest_step_s = 0.0
        self._longest_after_first_s = 0.0  # every step but the first (compilation): what an explicit bound is to fit
        self._steps_done = 0
        self._warned_short = False
        # (fed at, deadline, phase, step): replaced whole, read whole, so the thread never sees a torn update
        self._last: tuple[float, float, str, int] = (time.monotonic(), time.monotonic() + AUTO_WARMUP_S, "", 0)
        self._poll_s = POLL_MAX_S  # a step bound's fraction: a long phase is checked as often as a step
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.wakeups = 0  # how often the thread woke (the bench reports it)

    def start(self, step: int) -> None:
        self.feed("first step", step)
        self._thread = threading.Thread(target=self._watch, name="slurm-jit-watchdog", daemon=True)
        self._thread.start()
        logger.info("slurm_jit: hang watchdog on rank %d: hang_timeout_s=%s", self.rank, self.hang_timeout_s)

    def step_done(self, step_s: float, step: int) -> None:
        """A step ended after ``step_s``: measured for the ``auto`` bound, then fed."""
        self._steps_done += 1
        if self._steps_done > 1:
            self._longest_after_first_s = max(self._longest_after_first_s, step_s)
        if self._steps_done > WARMUP_STEPS:
            self._longest_step_s = max(self._longest_step_s, step_s)
        bound = bound_s(self.hang_timeout_s, self._longest_step_s, self._steps_done)
        if not self._warned_short and self._steps_done > WARMUP_STEPS and 2 * step_s > bound:
            self._warned_short = True
            logger.warning("slurm_jit: a step took %.1f s, over half of hang_timeout_s=%s: a slower step would "
                           "end the job as hung. HINT: JitConfig(hang_timeout_s='auto') derives it from the "
                           "steps measured", step_s, self.hang_timeout_s)
        self.feed("step", step)

    def feed(self, phase: str, step: int) -> None:
        """A boundary: from now on, ``phase`` may last its bound."""
        self._poll_s = min(POLL_MAX_S, max(0.05, self.phase_bound_s("step") / POLL_FRACTION))
        now = time.monotonic()
        self._last = (now, now + self.phase_bound_s(phase), phase, step)

    def phase_bound_s(self, phase: str) -> float:
        """How long ``phase`` may last from its boundary on, as the steps measured so far make it."""
        bound = bound_s(self.hang_timeout_s, self._longest_step_s, self._steps_done)
        return long_bound_s(bound) if phase in LONG_PHASES else bound

    def report_wait_s(self) -> float:
        """How long rank 0 waits for the other ranks' hang reports: their threads, fed at the same boundary, see
        the same deadline up to one poll interval later, then write within :data:`PEER_REPORT_WAIT_S`."""
        return self._poll_s + PEER_REPORT_WAIT_S

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=FIRING_MAX_S)  # a thread firing now writes the record first, then exits

    def _watch(self) -> None:
        while not self._stopped.wait(self._poll_s):
            self.wakeups += 1
            fed_at, deadline, phase, step = self._last
            now = time.monotonic()
            if now > deadline and not self._stopped.is_set():
                self._fire(Hang(rank=self.rank, step=step, phase=phase, since_s=round(now - fed_at, 1),
                                bound_s=round(deadline - fed_at, 1), node=dist_env.node_name(),
                                frame=main_thread_frame()))
                return

    def _hint(self, hang: Hang) -> str:
        """What to do: look at the waiting frame; or, where an explicit bound is shorter than a step this run
        already took (not the first), raise it: the steps themselves are being called hangs."""
        if self.hang_timeout_s != AUTO and hang.phase == "step" and self._longest_after_first_s >= hang.bound_s:
            return (f"hang_timeout_s={self.hang_timeout_s} is shorter than a step this run took "
                    f"({self._longest_after_first_s:.1f} s): set it well above the longest step, or "
                    f"JitConfig(hang_timeout_s='{AUTO}'), which derives it from the steps measured")
        return "the frame that waits is where it hangs; a requeue resumes from the newest complete checkpoint"

    def _fire(self, hang: Hang) -> None:
        sys.stdout.flush()
        print(f"slurm_jit: hang on rank {hang.rank} (node {hang.node}) at step {hang.step}: {hang.since_s:.0f} s "
              f"in phase '{hang.phase}' since the last boundary > {hang.bound_s:.0f} s, waiting in {hang.frame}; "
              f"every thread's stack follows, then exit {HUNG_EXIT_CODE}. HINT: {self._hint(hang)}",
              file=sys.stderr, flush=True)
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            self._on_hang(hang)
        except Exception as exc:  # noqa: BLE001 - the exit below must happen whatever the record did
            print(f"slurm_jit: hang record not written: {exc}", file=sys.stderr, flush=True)
        finally:
            sys.stderr.flush()
            end_children()
            self._exit(HUNG_EXIT_CODE)


def end_children() -> None:
    """SIGKILL this process's multiprocessing children (DataLoader workers) before ``os._exit``: a worker stuck in
    its fetch never runs its own parent check, and ``os._exit`` skips multiprocessing's exit handler that would end
    the others; left behind, they hold the node (and, outside a Slurm cgroup, run forever)."""
    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):  # one already gone, or not ours to end: the exit goes on
            child.kill()
