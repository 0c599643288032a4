"""Issue #23's rows: async periodic saves against synchronous ones, side by side in one run, on the bench's model.

Two trainings of 2 ZeRO-2 ranks, the same model, seed and wall time: ``save_steps=K`` synchronous, and
``save_steps=K/10`` with ``JitConfig(async_periodic_saves=True)`` (what saving in the background should make
affordable). Each runs ``wall_s`` seconds from its first step and is then SIGKILLed (every rank's process group at
once: no JIT save, no final save). While it runs the bench polls every ``runs.POLL_S``: rank 0's step ends
(``--step-times``), the instant each checkpoint became complete (by the protocol's own verdict; the instant is its
manifest's ``created`` time, the commit) and the ranks' summed RSS.

* ``async_blocked_over_sync_save``: the training time blocked per periodic save (the timing log: ``save_blocked``
  of the async run, including any wait for the save before it; ``save`` of the synchronous one; each save's slowest
  rank), the mean over the run's saves, async over sync. Target <= 0.1 (issue #23).
* ``async_step_time_lost_over_sync_save``: what each periodic save costs training in all, the blocked time and
  whatever the background work takes from the steps beside it (on this CPU machine the deferred copies and the
  write share the cores with training): rank 0's step interval that holds a save (from the end of the save's step
  to the end of the next, the copy's wait included) less the median interval of steps with no save near, the mean
  over the run's saves; async over sync. No target (the issue's is the blocked time); it keeps the blocked row
  honest where work moved to a thread still slows training.
* ``steps_lost_async_vs_sync``: the steps a SIGKILL at a random instant loses, the mean over ``KILL_INSTANTS``
  instants drawn uniformly (``random.Random(SEED)``) over the window from the first step's end to the real kill,
  the same offsets in both runs: at instant t, lost = the steps rank 0 had ended by t minus the step of the newest
  checkpoint complete by t (0 before the first: a fresh start). Async over sync; each run's own throughput is in
  it (a run slowed down by its saves ends fewer steps, and loses fewer). The real SIGKILL at the window's end is
  one instant checked against what the resume picks (``protocol.find_resumable``); no target (the issue names none).
* ``async_peak_rss_over_steady``: the async run's largest summed RSS (staging buffers in host memory, allocated at
  its first save and reused) over its largest before its first save, after the warm-up steps. No target.

The rows are measured, never asserted (STYLE.md); the bench's own arithmetic is tested in tests/bench/.
"""

from __future__ import annotations

import bisect
import logging
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_jit import timing
from slurm_jit.bench import runs
from slurm_jit.bench.rows import NO_TARGET, Row, measured
from slurm_jit.bench.save import train_args
from slurm_jit.checkpoint import manifest as manifest_mod
from slurm_jit.checkpoint import protocol

logger = logging.getLogger(__name__)

ASYNC_K_FACTOR = 10  # issue 23: async periodic saves can afford save_steps 10x smaller
BLOCKED_TARGET = "<= 0.1"  # issue 23: training time blocked per periodic save, async over sync
KILL_INSTANTS = 1000  # random SIGKILL instants per run (the mean's standard error is well under a step)
SEED = 23  # the instants' seed: the same offsets in both runs, the same in every bench run
KEEP_CHECKPOINTS = "2"  # --save-total-limit: rotation bounds the disk; the bench records each completion as it comes
KILL_WAIT_S = 10.0  # after the SIGKILL: the processes are gone within this (a hang otherwise)
ROW_NAMES = ("async_blocked_over_sync_save", "async_step_time_lost_over_sync_save", "steps_lost_async_vs_sync",
             "async_peak_rss_over_steady")
CALM_STEPS = 2  # a step interval counts as one with no save near when no save came in this many steps before it


@dataclass(frozen=True, kw_only=True)
class Settings:
    """A profile's sizes for these rows."""

    save_steps: int  # K of the synchronous run; the async one saves every K // ASYNC_K_FACTOR steps
    wall_s: float  # each run's window, from its first step's end to the SIGKILL

    @property
    def async_save_steps(self) -> int:
        return max(1, self.save_steps // ASYNC_K_FACTOR)


@dataclass
class Watched:
    """One run as the bench saw it, in seconds of ``time.monotonic()``."""

    out: Path
    step_ends: list[float] = field(default_factory=list)  # rank 0's step n ended at step_ends[n - 1]
    complete_at: dict[int, float] = field(default_factory=dict)  # step -> its checkpoint complete (the commit)
    killed_at: float = 0.0
    steady_rss_bytes: int = 0  # largest summed RSS after the warm-up steps, before the first checkpoint appeared
    peak_rss_bytes: int = 0  # largest summed RSS after the warm-up steps
    resumable_step: int | None = None  # the step protocol.find_resumable picks after the kill


def steps_lost(step_ends: list[float], complete_at: dict[int, float], instants: list[float]) -> list[int]:
    """For each instant: the steps ended by then less the step of the newest checkpoint complete by then. Pure."""
    commits = sorted((at, step) for step, at in complete_at.items())
    times = [at for at, _ in commits]
    newest, lost = [], []
    best = 0
    for _, step in commits:  # the newest complete step as of each commit (steps complete in order, or not)
        best = max(best, step)
        newest.append(best)
    for t in instants:
        done = bisect.bisect_right(step_ends, t)
        k = bisect.bisect_right(times, t)
        lost.append(done - (newest[k - 1] if k else 0))
    return lost


def kill_offsets(wall_s: float, n: int = KILL_INSTANTS, seed: int = SEED) -> list[float]:
    """The seeded instants, as offsets into a window of ``wall_s`` seconds. Pure."""
    rng = random.Random(seed)
    return [rng.uniform(0.0, wall_s) for _ in range(n)]


def _commit_instant(ckpt: Path, step: int, offset_s: float, seen_at: float) -> float | None:
    """When ``ckpt`` became complete (monotonic), None while it is not: the protocol's verdict, the instant its
    manifest's creation (wall clock, less ``offset_s``), never later than the bench first saw it."""
    if not (ckpt / protocol.MANIFEST_NAME).exists() or (ckpt / protocol.SENTINEL_NAME).exists():
        return None  # the cheap look first: inspect() reads the manifest and sizes the tree
    if protocol.inspect(ckpt, step).status != protocol.Status.COMPLETE:
        return None
    manifest, _ = manifest_mod.read(ckpt)
    created = manifest_mod.created(manifest) if manifest is not None else None
    return min(created - offset_s, seen_at) if created is not None else seen_at


def _poll(ranks: Any, seen: Watched, offset_s: float, warm_steps: int) -> int:
    """One look at a running training; returns the steps rank 0 has ended."""
    now = time.monotonic()
    seen.step_ends = runs.step_times(seen.out)
    ckpts = sorted(seen.out.glob("checkpoint-*")) if seen.out.is_dir() else []
    if len(seen.step_ends) >= warm_steps:
        rss = runs.rss_bytes(ranks)
        seen.peak_rss_bytes = max(seen.peak_rss_bytes, rss)
        if not ckpts:
            seen.steady_rss_bytes = max(seen.steady_rss_bytes, rss)
    for ckpt in ckpts:
        step = int(ckpt.name.rpartition("-")[2]) if ckpt.name.rpartition("-")[2].isdigit() else None
        if step is not None and step not in seen.complete_at:
            try:
                at = _commit_instant(ckpt, step, offset_s, now)
            except OSError:  # rotated away under the look
                at = None
            if at is not None:
                seen.complete_at[step] = at
    return len(seen.step_ends)


def watch(out: Path, args: list[str], wall_s: float) -> Watched:
    """Run 2 ranks for ``wall_s`` from their first step, SIGKILL them, and say what they did."""
    seen = Watched(out=out)
    offset_s = time.time() - time.monotonic()
    ranks = runs.start(out, args)
    deadline = time.monotonic() + runs.START_TIMEOUT_S
    try:
        while True:
            done = _poll(ranks, seen, offset_s, timing.WARMUP_STEPS)
            if any(p.poll() is not None for p in ranks.procs):
                raise RuntimeError(f"a rank of {out} ended before the kill: {[p.poll() for p in ranks.procs]}; log "
                                   f"tail:\n{ranks.log(0)[-1500:]}")
            if done and time.monotonic() >= seen.step_ends[0] + wall_s:
                break
            if not done and time.monotonic() > deadline:
                raise RuntimeError(f"{out}: no step within {runs.START_TIMEOUT_S} s")
            time.sleep(runs.POLL_S)
        for rank in range(len(ranks.procs)):
            ranks.signal(rank, signal.SIGKILL)
        seen.killed_at = time.monotonic()
        ranks.wait(KILL_WAIT_S)
    finally:
        ranks.kill()
    _poll(ranks, seen, offset_s, len(seen.step_ends) + 1)  # the step ends written before the kill
    found = protocol.find_resumable(out).checkpoint
    seen.resumable_step = found.step if found is not None else None
    return seen


def rows(work: Path, model: runs.Model, settings: Settings) -> list[Row]:
    common = ["--save-total-limit", KEEP_CHECKPOINTS]
    sync = watch(work / "sync", train_args(model, 2, "--save-steps", str(settings.save_steps), *common),
                 settings.wall_s)
    background = watch(work / "async", train_args(model, 2, "--save-steps", str(settings.async_save_steps),
                                                  "--async-periodic-saves", *common), settings.wall_s)
    return [blocked_row(sync, background, settings), time_lost_row(sync, background, settings),
            lost_row(sync, background, settings), rss_row(background)]


def _per_save(out: Path, event: str) -> dict[int, float]:
    """Each periodic save's slowest rank, from the timing log: step -> seconds."""
    per: dict[int, float] = {}
    for r in timing.read_records(out):
        if r["event"] == event and r.get("kind") == "periodic" and isinstance(r.get("step"), int):
            per[r["step"]] = max(per.get(r["step"], 0.0), float(r["dur_s"]))
    return per


def blocked_row(sync: Watched, background: Watched, settings: Settings) -> Row:
    sync_s, blocked_s = _per_save(sync.out, "save"), _per_save(background.out, "save_blocked")
    if not sync_s or not blocked_s:
        raise RuntimeError(f"periodic saves recorded: synchronous {len(sync_s)}, async {len(blocked_s)} (an async run "
                           "whose host memory cannot hold the staging buffer saves synchronously: see its log)")
    written = _per_save(background.out, "save_background")
    return measured(
        "async_blocked_over_sync_save", statistics.mean(blocked_s.values()) / statistics.mean(sync_s.values()),
        "ratio", BLOCKED_TARGET,
        f"ZeRO-2: training time blocked per periodic save, mean over the run's saves of each save's slowest rank: "
        f"async (save_blocked, its wait for the save before it included; save_steps {settings.async_save_steps}) "
        f"over synchronous (save; save_steps {settings.save_steps}), two runs side by side",
        async_blocked_mean_s=round(statistics.mean(blocked_s.values()), 4),
        async_blocked_max_s=round(max(blocked_s.values()), 4), async_saves=len(blocked_s),
        sync_save_mean_s=round(statistics.mean(sync_s.values()), 4), sync_saves=len(sync_s),
        async_background_mean_s=round(statistics.mean(written.values()), 4) if written else None)


def step_time_lost(step_ends: list[float], save_steps: list[int],
                   calm_s: float | None = None) -> tuple[float, float]:
    """(the mean over saves of the interval holding each save less the calm step time, the calm step time): the
    interval after step s (s a save step) is step_ends[s] - step_ends[s - 1]; the calm step time is ``calm_s``, else
    the median interval with no save in the CALM_STEPS steps before it. Pure."""
    intervals = {n: step_ends[n] - step_ends[n - 1] for n in range(1, len(step_ends))}  # step n+1's, save of n in it
    saves = set(save_steps)
    calm = [d for n, d in intervals.items() if not saves & set(range(n - CALM_STEPS + 1, n + 1))]
    holding = [intervals[s] for s in sorted(saves) if s in intervals]
    if (calm_s is None and not calm) or not holding:
        raise RuntimeError(f"step intervals: {len(calm)} calm, {len(holding)} holding a save: the run is too short")
    median = statistics.median(calm) if calm_s is None else calm_s
    return statistics.mean(holding) - median, median


def time_lost_row(sync: Watched, background: Watched, settings: Settings) -> Row:
    """Both runs against the synchronous run's calm step time: its saves are K steps apart, so its calm steps have
    nothing in the background (the async run's background write spans the steps between its saves)."""
    sync_lost, calm_s = step_time_lost(sync.step_ends, sorted(_per_save(sync.out, "save")))
    async_lost, _ = step_time_lost(background.step_ends, sorted(_per_save(background.out, "save_blocked")), calm_s)
    between = [background.step_ends[n] - background.step_ends[n - 1] for n in range(1, len(background.step_ends))]
    return measured(
        "async_step_time_lost_over_sync_save", async_lost / sync_lost, "ratio", NO_TARGET,
        "ZeRO-2: training time each periodic save costs in all (rank 0's step interval holding the save, less the "
        f"synchronous run's median interval with no save in the {CALM_STEPS} steps before), mean over the run's "
        f"saves: async (save_steps {settings.async_save_steps}) over synchronous (save_steps {settings.save_steps}); "
        "the background's share of the cores included", async_lost_per_save_s=round(async_lost, 4),
        sync_lost_per_save_s=round(sync_lost, 4), calm_step_s=round(calm_s, 4),
        async_median_step_s=round(statistics.median(between), 4) if between else None)


def lost_row(sync: Watched, background: Watched, settings: Settings) -> Row:
    offsets = kill_offsets(settings.wall_s)
    means, details = {}, {}
    for name, seen in (("sync", sync), ("async", background)):
        lost = steps_lost(seen.step_ends, seen.complete_at, [seen.step_ends[0] + o for o in offsets])
        means[name] = statistics.mean(lost)
        at_kill = steps_lost(seen.step_ends, seen.complete_at, [seen.killed_at])[0]
        done = bisect.bisect_right(seen.step_ends, seen.killed_at)
        instants = [seen.step_ends[0] + o for o in offsets]
        kept = [bisect.bisect_right(seen.step_ends, t) - n for t, n in zip(instants, lost, strict=True)]
        details[name] = {"mean_steps_lost": round(means[name], 2), "max_steps_lost": max(lost),
                         "mean_resume_step": round(statistics.mean(kept), 2),  # the progress a kill keeps
                         "steps_in_window": done, "checkpoints_complete": len(seen.complete_at),
                         "real_kill": {"steps_done": done, "predicted_resume_step": done - at_kill,
                                       "resume_step_found": seen.resumable_step}}
    value = means["async"] / means["sync"] if means["sync"] else float("nan")
    return measured(
        "steps_lost_async_vs_sync", value, "ratio", NO_TARGET,
        f"ZeRO-2, the same {settings.wall_s:g} s of training each: mean steps lost to a SIGKILL at {KILL_INSTANTS} "
        f"random instants (seed {SEED}; steps ended minus the newest complete checkpoint's step), async "
        f"save_steps {settings.async_save_steps} over synchronous save_steps {settings.save_steps}",
        sync_run=details["sync"], async_run=details["async"])


def rss_row(background: Watched) -> Row:
    staged = [r.get("staged_bytes") for r in timing.read_records(background.out) if r["event"] == "save_blocked"]
    staged_bytes = max((b for b in staged if isinstance(b, int)), default=0)
    if not background.steady_rss_bytes:
        raise RuntimeError(f"{background.out}: no RSS sample between the warm-up and the first save")
    return measured(
        "async_peak_rss_over_steady", background.peak_rss_bytes / background.steady_rss_bytes, "ratio", NO_TARGET,
        "ZeRO-2, async periodic saves: the largest summed RSS of both ranks (the staging buffers in host memory "
        "included) over the largest before the first save, after the warm-up steps (sampled every 20 ms)",
        peak_rss_bytes=background.peak_rss_bytes, steady_rss_bytes=background.steady_rss_bytes,
        staged_bytes_per_rank=staged_bytes)
