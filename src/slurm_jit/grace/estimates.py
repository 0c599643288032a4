"""Terms measured or estimated rather than given: step, save, evaluation and teardown times from a timing log
summary (:func:`measured_terms`), the bytes a checkpoint writes per node and the save time they take, and an
elastic resume's conversion, paid at the start of the next job. Pure: the timing log is read by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from slurm_jit import timing
from slurm_jit.grace.rules import (
    DTYPE_BYTES,
    LATENCY_STEPS,
    MASTER_COPY_BYTES,
    MIN_STEP_SAMPLES,
    OPTIMIZER_STATE_BYTES,
    SLURM_SIGNAL_EARLY_S,
    GraceError,
    agreement_mode,
    latency_reason,
)


def select_world_size(records: list[dict[str, Any]], world_size: int | None) -> list[dict[str, Any]]:
    """The records of one world size; GraceError when the log was written by another one (or mixes them)."""
    sizes = sorted({r["world_size"] for r in records if isinstance(r.get("world_size"), int)})
    if world_size is None:
        if len(sizes) > 1:
            raise GraceError(
                f"the timing log mixes world sizes {sizes}; step and save times differ between them. HINT: "
                "pass --world-size N for the job you are sizing"
            )
        return records
    if world_size not in sizes:
        raise GraceError(
            f"the timing log was written with world size {sizes}, not {world_size}. HINT: measure a run at "
            f"world size {world_size}, or give --step-time and --save-time"
        )
    return [r for r in records if r.get("world_size") == world_size]


@dataclass(frozen=True, kw_only=True)
class Measured:
    """Terms read from a timing log, with how many samples each rests on."""

    step_s: float | None
    step_source: str
    latency_steps: int | None  # 1 or 2: steps from the signal to the stop, as the runs read their rounds
    latency_source: str
    save_s: float | None
    save_source: str
    eval_s: float | None
    eval_source: str
    kill_wait_s: float | None  # as the trainer recorded it
    teardown_s: float | None
    teardown_source: str
    warnings: tuple[str, ...]
    async_save_s: float = 0.0  # a JIT stop's wait for an async periodic save in flight (0: the log has none)
    async_save_source: str = "no async periodic saves in the timing log"


def _worst_stop_window(summary: timing.TimingSummary, step_stat: str) -> tuple[float, int, str, int] | None:
    """(step, latency steps, mode, samples) of the mode whose latency x step is longest; None without steps."""
    windows = []
    for mode, stats in summary.steps_by_mode.items():
        step_s = stats.max_s if step_stat == "max" else stats.p99_s
        steps = LATENCY_STEPS.get(mode) or LATENCY_STEPS[agreement_mode(step_s)]
        windows.append((steps * step_s, step_s, steps, mode, stats.n))
    if not windows:
        return None
    _, step_s, steps, mode, n = max(windows)
    return step_s, steps, mode, n


def _teardown(summary: timing.TimingSummary) -> tuple[float | None, str]:
    """From the JIT save's end to the process's end: the longest save end -> train() returning of any stop, plus
    the longest train() returning -> process gone (``exit`` records, train/exit_watch.py) where recorded."""
    if summary.teardown_max_s is None:
        return None, "no JIT stop in the timing log yet: not counted (the margin covers it)"
    source = f"longest of {summary.n_stops} JIT stops (all ranks) in the timing log: save end to train() returning"
    if summary.exit_max_s is None:
        return summary.teardown_max_s, f"{source} (the process's exit after it not recorded: the margin covers it)"
    return (summary.teardown_max_s + summary.exit_max_s,
            f"{source} {summary.teardown_max_s:.1f} s + its process's exit {summary.exit_max_s:.1f} s (longest of "
            f"{summary.n_exits})")


def measured_terms(summary: timing.TimingSummary, *, step_stat: str = "max") -> Measured:
    """Step (max or p99) and the latency the runs' agreement mode gives it, longest save of any kind, longest
    evaluation, the recorded kill_wait and the longest teardown, from a timing summary."""
    runs = f"{summary.n_runs} run{'s' if summary.n_runs != 1 else ''}"
    worst = _worst_stop_window(summary, step_stat)
    step_s: float | None = None
    step_source, latency_source, steps = f"no steps over {runs} in the timing log", "", None
    if worst is not None:
        step_s, steps, mode, n = worst
        mixed = f" ({mode} runs)" if len(summary.steps_by_mode) > 1 else ""
        step_source = f"{step_stat} of {n} steps over {runs} in the timing log{mixed}"
        latency_source = latency_reason(steps, recorded=mode in LATENCY_STEPS)
    warnings = []
    if summary.n_steps < MIN_STEP_SAMPLES:
        warnings.append(f"only {summary.n_steps} step samples (warm-up left out); the {step_stat} is rough. "
                        "HINT: let the run go longer before sizing from it")
    save_s, save_source = None, "not measured"
    if summary.saves:
        kind, stats = max(summary.saves.items(), key=lambda kv: kv[1].max_dur_s)
        total = sum(s.count for s in summary.saves.values())
        save_s, save_source = stats.max_dur_s, f"longest of {total} saves ({kind}) in the timing log"
    teardown_s, teardown_source = _teardown(summary)
    async_save_s, async_save_source, async_warning = async_save_term(summary.async_saves)
    warnings += [async_warning] if async_warning else []
    return Measured(
        step_s=step_s,
        step_source=step_source,
        latency_steps=steps,
        latency_source=latency_source,
        save_s=save_s,
        save_source=save_source,
        eval_s=summary.eval_max_s,
        eval_source=f"longest of {summary.n_evals} evaluations in the timing log",
        kill_wait_s=summary.kill_wait_s,
        teardown_s=teardown_s,
        teardown_source=teardown_source,
        warnings=tuple(warnings),
        async_save_s=async_save_s,
        async_save_source=async_save_source,
    )


def async_save_term(stats: timing.AsyncSaveStats | None) -> tuple[float, str, str | None]:
    """(seconds, source, warning) of the ``async_save`` term: what a JIT stop can wait for an async periodic save.

    The JIT save is synchronous and sized from synchronous saves only (the ``save`` term); but before it starts it
    waits until the async save in flight is committed (train/async_save/periodic.py ``before_save``). The worst
    instant for a signal is just before an async save's step ends: training is blocked for its staging (the longest
    ``save_blocked``, which includes a wait for the save before it), then its whole background write and commit
    (the longest ``save_background``) can still be left when the stop reaches the JIT save. Their sum bounds the
    wait whatever the step and kill_wait terms already cover (they may overlap it: an upper bound)."""
    if stats is None:
        return 0.0, "no async periodic saves in the timing log", None
    n = f"{stats.count} async periodic save{'s' if stats.count != 1 else ''} in the timing log"
    aside = stats.set_aside_max_s
    if aside is not None and aside > (stats.background_max_s or 0.0):  # a write slower than any seen to end
        warning = (f"a JIT stop set aside an async save still being written after {aside:.3g} s (its whole write "
                   "took longer: counted as at least that). HINT: give --save-time with room for the disk's slowest "
                   "write, or save synchronously before a short lead")
        return (stats.blocked_max_s + aside, f"longest training block {stats.blocked_max_s:.3g} s + a background "
                f"write set aside after {aside:.3g} s, at least (of {n})", warning)
    if stats.background_max_s is None:
        warning = (f"none of the {n} was seen written to its end (a killed run): the wait for one in flight is "
                   "not counted. HINT: size again from a run that saved in the background and went on, or give "
                   "--save-time with room for it")
        return (stats.blocked_max_s, f"longest training block {stats.blocked_max_s:.3g} s of {n}; no background "
                "write seen to end", warning)
    return (stats.blocked_max_s + stats.background_max_s,
            f"longest training block {stats.blocked_max_s:.3g} s + longest background write and commit "
            f"{stats.background_max_s:.3g} s (of {n}): a JIT stop waits for the async save in flight, worst when "
            "the signal comes just before one", None)


def async_note(figures: dict[str, Any]) -> str:
    """One line for grace-calc's notes: the async saves' figures (``asdict`` of timing.AsyncSaveStats)."""
    background = ("none seen to end" if figures["background_max_s"] is None else
                  f"median {figures['background_median_s']:.3g} s, longest {figures['background_max_s']:.3g} s "
                  f"(of {figures['n_background']})")
    if figures.get("set_aside_max_s") is not None:
        background += f", and one set aside by a JIT stop after {figures['set_aside_max_s']:.3g} s (at least)"
    return (f"async periodic saves: {figures['count']} in the timing log; training blocked per save median "
            f"{figures['blocked_median_s']:.3g} s, longest {figures['blocked_max_s']:.3g} s; background write and "
            f"commit {background}; staging buffer up to {format_bytes(figures['staged_max_bytes'])} per rank (host "
            "memory). They are not the save term: the JIT save is synchronous, sized from synchronous saves")


def staging_line(stats: timing.AsyncSaveStats | None, ranks_per_node: int) -> str | None:
    """The launcher's plan: the host memory async periodic saves take for their staging buffers (the timing log's
    largest one, the one extra copy of a rank's checkpoint share); None when the log has no async save."""
    if stats is None or not stats.staged_max_bytes:
        return None
    per_rank = stats.staged_max_bytes
    node = f", {format_bytes(per_rank * ranks_per_node)} on a node of {ranks_per_node}" if ranks_per_node > 1 else ""
    return (f"async periodic saves stage up to {format_bytes(per_rank)} per rank in host memory{node} (the timing "
            f"log's largest of {stats.count}); where it does not fit, the saves stay synchronous (one line)")


def shrunk_terms(measured: Measured, from_world_size: int, world_size: int) -> Measured:
    """The terms of a job on ``world_size`` ranks estimated from a run on more (``from_world_size``), the global
    batch kept (train/keep_batch.py): each rank runs from/to times the micro-batches of a step, and under ZeRO
    writes up to from/to times the optimizer shard, so step and save are scaled by from/to (compute and write
    bound: an upper estimate; communication, which shrinks with fewer ranks, is not subtracted)."""
    scale = from_world_size / world_size
    why = (f"x {scale:g}: world size {world_size} is not {from_world_size}; each rank runs {scale:g}x the "
           "micro-batches of a step, the global batch kept")
    warning = (f"the timing log has no step at world size {world_size}: the step and save times of world size "
               f"{from_world_size} are scaled by {scale:g}, an estimate. HINT: size again from this job's timing log "
               f"once it has run on {world_size} ranks")
    return replace(
        measured,
        step_s=measured.step_s * scale if measured.step_s is not None else None,
        step_source=f"{measured.step_source}, {why}",
        save_s=measured.save_s * scale if measured.save_s is not None else None,
        save_source=f"{measured.save_source}, {why}",
        async_save_s=measured.async_save_s * scale,  # each rank stages and writes from/to times its share too
        warnings=(*measured.warnings, warning),
    )


def checkpoint_bytes_per_node(
    *, params: int, dtype: str = "bf16", optimizer: str = "adamw", zero_stage: int = 0,
    world_size: int = 1, nodes: int = 1,
) -> int:
    """Bytes the busiest node (the one with rank 0) writes for one checkpoint; nodes write in parallel.

    Weights are written by rank 0 unless ZeRO-3 shards them; the optimizer state (fp32 master copy and
    moments) is sharded over all ranks from ZeRO-1 on.
    """
    if dtype not in DTYPE_BYTES or optimizer not in OPTIMIZER_STATE_BYTES or zero_stage not in range(4):
        raise GraceError(f"unknown dtype {dtype!r}, optimizer {optimizer!r} or ZeRO stage {zero_stage}. "
                         f"HINT: dtype {sorted(DTYPE_BYTES)}, optimizer {sorted(OPTIMIZER_STATE_BYTES)}, "
                         "stage 0..3")
    if world_size < 1 or nodes < 1 or nodes > world_size:
        raise GraceError(f"world size {world_size} over {nodes} nodes. HINT: 1 <= --nodes <= --world-size")
    weights = DTYPE_BYTES[dtype]
    master = MASTER_COPY_BYTES if weights < MASTER_COPY_BYTES and optimizer != "none" else 0
    optim = master + OPTIMIZER_STATE_BYTES[optimizer]
    ranks_on_node0 = math.ceil(world_size / nodes)
    per_param: float = weights + optim  # ZeRO-0: rank 0 writes everything
    if zero_stage in (1, 2):
        per_param = weights + optim * ranks_on_node0 / world_size
    elif zero_stage == 3:
        per_param = (weights + optim) * ranks_on_node0 / world_size
    return math.ceil(params * per_param)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError("unreachable")


def estimate_save_s(nbytes: int, bandwidth_bps: float) -> float:
    if not (math.isfinite(bandwidth_bps) and bandwidth_bps > 0):
        raise GraceError(f"write bandwidth {bandwidth_bps!r} B/s. HINT: measure it with --probe DIR")
    return nbytes / bandwidth_bps


# --- an elastic resume's conversion, paid at the start of the next job -----------------------------------


@dataclass(frozen=True, kw_only=True)
class Conversion:
    """The next start converts its checkpoint to DeepSpeed's universal format (another world size) before its
    first step: not part of the grace period (the end of a job), but of the next job's time limit."""

    written_by: int  # the ranks that wrote the checkpoint
    world_size: int  # the ranks of the job being sized
    checkpoint: str
    seconds: float | None  # estimated; None: no conversion in the timing log to estimate from
    source: str  # where the estimate came from, in words


def conversion_estimate(converts: list[tuple[float, int]], ckpt_bytes: int | None) -> tuple[float | None, str]:
    """(seconds, source) of converting a checkpoint of ``ckpt_bytes``, from earlier conversions ((dur_s, bytes
    written) in the timing log): the slowest seconds per byte seen, times the bytes (the converter reads the
    shards and writes as many bytes again); the longest one where bytes are unknown; (None, ...) without any."""
    if not converts:
        return None, "no conversion in the timing log yet: not estimated (seconds for small models, minutes for " \
                     "billions of parameters)"
    rates = [dur_s / nbytes for dur_s, nbytes in converts if nbytes > 0]
    n = f"{len(converts)} conversion{'s' if len(converts) != 1 else ''} in the timing log"
    if rates and ckpt_bytes:
        return max(rates) * ckpt_bytes, f"the slowest seconds per byte of {n} x {format_bytes(ckpt_bytes)}"
    return max(dur_s for dur_s, _ in converts), f"longest of {n}"


def conversion_note(conversion: Conversion) -> str:
    """One line for grace-calc's notes (and the launcher's plan)."""
    took = f"~{conversion.seconds:.0f} s" if conversion.seconds is not None else "time unknown"
    return (f"the next start on {conversion.world_size} ranks converts {conversion.checkpoint} (written by "
            f"{conversion.written_by} ranks) to DeepSpeed's universal format before its first step: {took} "
            f"({conversion.source}); it comes out of that job's --time, not out of the --signal lead")


def conversion_finding(conversion: Conversion, time_limit_s: int | None, lead_s: int,
                       step_s: float) -> str | None:
    """A warning when the job's --time cannot fit the conversion and one step before the signal can come (lead +
    Slurm's early minute; the save after it is inside the lead): that job would end without saving progress (the
    converted copy is kept, so the start after it does not convert again). None when it fits or is unknown."""
    if time_limit_s is None or conversion.seconds is None:
        return None
    needed_s = conversion.seconds + step_s
    available_s = time_limit_s - lead_s - SLURM_SIGNAL_EARLY_S
    if needed_s <= available_s:
        return None
    return (f"--time {time_limit_s} s leaves {max(available_s, 0)} s before the signal (lead {lead_s} s + "
            f"{SLURM_SIGNAL_EARLY_S} s early), but the next start converts first: ~{conversion.seconds:.0f} s + one "
            f"step {step_s:.3g} s = {needed_s:.0f} s: that job would end without saving any progress. HINT: ask for "
            f"a longer --time, or resume on {conversion.written_by} ranks")
