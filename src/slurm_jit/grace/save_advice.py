"""The launcher's ``saves:`` line: the ``save_steps`` Young's interval advises a JitTrainer job (issue #36 item 4).

From the timing log (the output directory's, or ``--from``'s) and the job: a save's blocked time (an async
snapshot's staging where the run saved in the background), the step at the job's world size (the log's records of
that size where it has them, else its newest run's, said so), ``--step-time`` / ``--save-time`` where given, the
job's GPUs and Llama 3's failure rate per GPU. Young's interval sqrt(2 x blocked save x MTBF) needs no restart cost
(docs/goodput.md#the-save-interval-young). The line says what to do: no periodic save where the JIT stop at each
allocation's end is the answer (Young's interval longer than the job's ``--time``, or an unwarned failure in under
one allocation of a hundred), else the ``save_steps``; the arithmetic is :attr:`Advice.why` (``--explain``). Advice
only, never an error: ``None`` (no line) wherever it cannot be given (no log, no step or save, a figure the model
refuses).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from typing import Any

from slurm_jit import timing
from slurm_jit.grace import goodput as gp
from slurm_jit.grace import human
from slurm_jit.grace.goodput_cli import log_costs
from slurm_jit.grace.parsing import parse_duration
from slurm_jit.grace.rules import GraceError

MAX_GPUS = 10**8  # past any cluster: a count above it is a typo, and no advice is given
# Judgement: with fewer unwarned failures per allocation than this, an allocation without periodic saves loses on
# average under half of it (the work since its start) in a hundred: under 0.5 % of the job's time, less than a
# save's cost on most runs; the JIT stop saves each allocation's end anyway.
FEW_FAILURES_PER_ALLOCATION = 0.01


@dataclass(frozen=True, kw_only=True)
class Advice:
    """The plan's ``saves:`` line and the arithmetic behind it."""

    line: str  # what to do, in one short line (without its ``saves:`` label)
    why: str  # Young's interval, the failure rate, the times it was computed from, the HINT (for --explain)


def for_job(log_dir: str | None, *, gpus_per_node: object, nodes: int, ranks_per_node: int, time_limit_s: float,
            step_time: object = None, save_time: object = None) -> Advice | None:
    """The launcher's line for a job at its largest (``nodes`` x ``ranks_per_node`` ranks), from its options as
    given (``--gpus-per-node``, ``--step-time``, ``--save-time``: read by the grace calculator before, so a bad
    value was refused there)."""
    world_size = nodes * ranks_per_node
    try:
        step_s = None if step_time is None else parse_duration(str(step_time), what="--step-time")
        save_s = None if save_time is None else parse_duration(str(save_time), what="--save-time")
    except GraceError:
        return None
    gpus, counted = job_gpus(gpus_per_node, nodes, world_size)
    return note(log_dir, world_size=world_size, gpus=gpus, gpus_counted=counted, time_limit_s=time_limit_s,
                step_s=step_s, save_s=save_s)


def job_gpus(gpus_per_node: object, nodes: int, ranks: int) -> tuple[int | None, str]:
    """The job's GPUs (sbatch's ``[type:]count[,...]`` per node x nodes), or its ranks where it asks for none
    (counted as GPUs by the failure model); None where the count is past reading (sbatch refuses it)."""
    counts = [part.rpartition(":")[2] for part in str(gpus_per_node or "0").split(",") if part]
    if any(len(c) > 9 or not c.isdigit() for c in counts):
        return None, "GPUs"
    per_node = sum(int(c) for c in counts)
    if per_node:
        return per_node * nodes, "GPUs" if per_node * nodes > 1 else "GPU"
    return ranks, "ranks (counted as GPUs)" if ranks > 1 else "rank (counted as a GPU)"


def note(log_dir: str | None, *, world_size: int, gpus: int | None, gpus_counted: str, time_limit_s: float,
         step_s: float | None = None, save_s: float | None = None) -> Advice | None:
    """The advice, or None. ``gpus``: the job's at its largest (None: unknown); ``step_s`` / ``save_s``:
    ``--step-time`` / ``--save-time`` (a synchronous save), which beat the log's."""
    if gpus is None or not 1 <= gpus <= MAX_GPUS:
        return None
    records, measured_at = _records_for(log_dir, world_size) if log_dir else ([], None)
    got, src = log_costs(records) if records else ({}, {})
    step = step_s if step_s is not None else got.get("step")
    staging = got.get("staging")  # an async snapshot's block: what a periodic save costs such a run
    sync = save_s if save_s is not None else got.get("save")
    blocked = staging if staging is not None else sync
    if step is None or blocked is None or not (step > 0 and blocked > 0):
        return None
    try:  # figures the model refuses (a save longer than the job; a step of 1e-310 s): no advice, the plan goes on
        costs = gp.system_costs(step_s=step, save_s=sync or blocked, restart_s=0.0, time_limit_s=time_limit_s,
                                save_steps=1, async_blocked_s=staging,
                                async_save_s=got.get("async_save") if staging is not None else None)
        c = costs[gp.JIT_TRAINER.key]
        failures = gp.Failures(gpus=gpus)
        advised = gp.advised_save_steps(c, gp.JIT_TRAINER, failures)
        young_s = math.sqrt(2 * c.save_blocked_s / failures.unwarned_per_s)
        per_allocation = time_limit_s * failures.unwarned_per_s
    except (GraceError, ArithmeticError, ValueError):
        return None
    if advised is None:
        return None
    who, interval_s = f"{gpus:,} {gpus_counted}", advised * step
    every = human.number(1 / failures.unwarned_per_s / gp.HOUR_S)
    floor = "" if young_s >= c.background_s else (
        f", shorter than the background write's {human.seconds(c.background_s)} (a save waits for the one before it)")
    arithmetic = (f"Young's interval sqrt(2 x {human.seconds(c.save_blocked_s)} blocked per save x {every} h between "
                  f"unwarned failures of {who} at Llama 3's rate per GPU) = {human.duration(young_s)}{floor}: "
                  f"save_steps {advised} ({human.duration(interval_s)}); "
                  f"{_step_text(step, step_s, measured_at, world_size)} and {_blocked_text(c, staging, save_s, src)}"
                  f"{_seen(records)}; {_chance(per_allocation, time_limit_s)}")
    named = "Young's interval" if young_s >= c.background_s else "the background write"
    line, why = _what_to_do(advised, interval_s, time_limit_s, per_allocation, named=named, who=who, every=every)
    return Advice(line=line, why=f"{arithmetic}{why} HINT: {_hint(log_dir, gpus, time_limit_s, step_s, save_s, got)}")


def _what_to_do(advised: int, interval_s: float, time_limit_s: float, per_allocation: float, *, named: str,
                who: str, every: str) -> tuple[str, str]:
    """The line, and why (after the arithmetic): no periodic save where the JIT stop at each allocation's end is
    the answer, else the save_steps."""
    covered = "no periodic save needed: the JIT stop covers each allocation's end"
    if interval_s > time_limit_s:
        return (f"{covered} ({named}, {human.duration(interval_s)}, is longer than --time "
                f"{human.duration(time_limit_s)})", ": a periodic save would only ever cover an unwarned failure.")
    if per_allocation < FEW_FAILURES_PER_ALLOCATION:
        return (f"{covered} (an unwarned failure ends {human.one_in(per_allocation)} allocations of {who})",
                f": under {FEW_FAILURES_PER_ALLOCATION:g} per allocation, an allocation without periodic saves loses "
                f"under {FEW_FAILURES_PER_ALLOCATION / 2:.1%} of its time to them on average.")
    return (f"save_steps {advised} (every {human.duration(interval_s)}: {named} for {who}, one unwarned failure every "
            f"{every} h)", ".")


def _chance(per_allocation: float, time_limit_s: float) -> str:
    """The unwarned failures expected in one allocation, as a chance where they are few."""
    if per_allocation < 0.1:
        return f"an unwarned failure ends {human.one_in(per_allocation)} allocations of {human.duration(time_limit_s)}"
    return f"{human.number(per_allocation)} unwarned failures expected per allocation of {human.duration(time_limit_s)}"


def _records_for(log_dir: str, world_size: int) -> tuple[list[dict[str, Any]], int | None]:
    """The log's records of the job's world size where it has some, else those of its newest run's; and that size."""
    try:
        records = timing.read_records(log_dir)
    except timing.TimingLogError:
        return [], None
    sizes = [r["world_size"] for r in records if isinstance(r.get("world_size"), int)]
    if not sizes:
        return [], None
    size = world_size if world_size in sizes else sizes[-1]
    return [r for r in records if r.get("world_size") == size], size


def _step_text(step: float, given: float | None, measured_at: int | None, world_size: int) -> str:
    if given is not None:
        return f"steps take {human.seconds(step)} (--step-time)"
    where = "" if measured_at == world_size else (
        f" at world size {measured_at} (not this job's {world_size}: a step's time changes with it; --step-time "
        "to give this job's)")
    return f"the timing log's steps{where} take {human.seconds(step)}"


def _blocked_text(c: gp.Costs, staging: float | None, given: float | None, src: dict[str, str]) -> str:
    if staging is not None:
        return (f"an async snapshot blocks training {human.seconds(c.save_blocked_s)} (complete after "
                f"{human.seconds(c.save_s)})")
    if given is not None:
        return f"a save blocks training {human.seconds(c.save_blocked_s)} (--save-time)"
    kind = "a periodic save" if "periodic" in src.get("save", "") else "a save (the log has JIT or final ones only)"
    return f"{kind} blocks training {human.seconds(c.save_blocked_s)}"


def _seen(records: list[dict[str, Any]]) -> str:
    """The interval the log's newest run saved at, when it saved at least twice at one interval."""
    saves = [r for r in records if r.get("event") in ("save", "save_blocked") and r.get("kind") == "periodic"
             and isinstance(r.get("step"), int)]
    if not saves:
        return ""
    newest = saves[-1].get("run_id")
    steps = sorted({r["step"] for r in saves if r.get("run_id") == newest})
    gaps = {b - a for a, b in zip(steps, steps[1:], strict=False)}
    return f"; the log's run saved every {gaps.pop()} steps" if len(gaps) == 1 else ""


def _hint(log_dir: str | None, gpus: int, time_limit_s: float, step_s: float | None, save_s: float | None,
          got: dict[str, float]) -> str:
    given = [*([f"--step-time {step_s:g}"] if step_s is not None else []),
             *([f"--save-time {save_s:g}"] if save_s is not None else
               [] if "save" in got else ["--save-time S (a synchronous save's seconds: the log has none)"])]
    source = [f"--from {shlex.quote(log_dir)}"] if log_dir and got else []
    return (f"grace-calc goodput {' '.join([*source, *given])} --gpus {gpus} --time-limit {time_limit_s:.0f} "
            "--restart R (a requeue's cost here) for your cluster's failure rates and each choice's goodput")
