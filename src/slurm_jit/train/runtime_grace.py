"""The runtime grace check: does the signal lead this job was given cover what it measurably needs?

Run by the JitTrainer on global rank 0 under Slurm, after warm-up (once the agreement mode is recorded) and after
the first save. The need is what :func:`slurm_jit.grace.calc.compute_grace` counts from the timing log, without
the margin: kill_wait + latency steps x the longest step + the longest save + the teardown (+ the wait for an
async periodic save in flight, where the run saves in the background); what the job has
is ``SLURM_JIT_SIGNAL_LEAD_S`` (exported by this project's launchers and sbatch scripts: the N of
``--signal=TERM@N``), and, at preemption, the partition's GraceTime. Warnings only, never an error.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from slurm_jit import slurm, timing
from slurm_jit.grace import calc as grace

logger = logging.getLogger(__name__)


def assess(*, step_s: float, save_s: float | None, kill_wait_s: float, lead_s: float | None,
           facts: grace.ClusterFacts | None, latency_steps: int | None = None,
           teardown_s: float = 0.0, async_save_s: float = 0.0) -> list[str]:
    """Warnings (with a HINT each) when the grace this job has is shorter than what it needs; a need no
    ``--signal`` lead can cover (the calculator's GraceError) is one warning too, never an error. Pure."""
    try:
        inputs = grace.GraceInputs(step_s=step_s, save_s=save_s if save_s else 1e-9, kill_wait_s=kill_wait_s,
                                   latency_steps=latency_steps, teardown_s=teardown_s, margin=grace.Margin(),
                                   async_save_s=async_save_s)
        result = grace.compute_grace(inputs)
    except grace.GraceError as exc:
        return [str(exc)]
    steps = inputs.steps_to_stop
    needed_s = steps * step_s + (save_s or 0.0) + kill_wait_s + teardown_s + async_save_s
    what = (f"{steps} x longest step {step_s:.1f} s + save {save_s or 0:.1f} s + kill_wait {kill_wait_s:.0f} s"
            f" + teardown {teardown_s:.1f} s" + (f" + async save in flight {async_save_s:.1f} s" if async_save_s
                                                 else ""))
    warnings = []
    if lead_s is None:
        warnings.append(f"{grace.LEAD_ENV_VAR} is not set, so the signal lead cannot be checked (needed: {what}"
                        f" = {needed_s:.0f} s). HINT: submit with launch/submit.py or export it beside "
                        f"#SBATCH --signal")
    elif lead_s < needed_s:
        warnings.append(f"signal lead {lead_s:.0f} s < needed {needed_s:.0f} s ({what}): the JIT checkpoint "
                        f"will be killed half-written. HINT: #SBATCH {result.option}")
    # preempt_send_user_signal changes which signal comes at preemption, not the GraceTime budget after it.
    if facts is not None and facts.preemptable and facts.grace_time_s is not None and facts.grace_time_s < needed_s:
        warnings.append(f"partition {facts.partition} preempts with GraceTime {facts.grace_time_s} s < needed "
                        f"{needed_s:.0f} s: a preemption will kill the checkpoint. HINT: ask for GraceTime >= "
                        f"{result.lead_s} s, or a partition that is not preempted")
    return warnings


def this_world_size(records: list[dict[str, Any]], world_size: int | None) -> list[dict[str, Any]]:
    """The records of ``world_size`` (all when None). Pure."""
    return records if world_size is None else [r for r in records if r.get("world_size") == world_size]


def _cluster_facts() -> grace.ClusterFacts | None:
    try:
        return grace.read_cluster_facts(
            os.environ.get("SLURM_JOB_PARTITION"), show_config=slurm.show_config,
            show_partition=slurm.show_partition, default_partition=slurm.default_partition, seconds=slurm.seconds,
        )
    except (slurm.SlurmError, OSError) as exc:
        logger.info("slurm_jit: grace check without cluster facts: %s", exc)
        return None


def check_and_warn(output_dir: str, kill_wait_s: float, when: str, world_size: int | None = None) -> list[str]:
    """Log the warnings of :func:`assess` from the timing log (its records of ``world_size`` when given: after an
    elastic resume the other world sizes' steps are not this run's); does nothing outside a Slurm job."""
    if "SLURM_JOB_ID" not in os.environ:
        return []
    try:
        records = list(timing.read_records(output_dir))
        summary = timing.summarize(this_world_size(records, world_size))
    except timing.TimingLogError as exc:
        logger.info("slurm_jit: grace check skipped: %s", exc)
        return []
    measured = grace.measured_terms(summary)
    if measured.step_s is None:
        return []
    lead = os.environ.get(grace.LEAD_ENV_VAR)
    try:
        lead_s = float(lead) if lead else None
    except ValueError:
        lead_s = None
    warnings = assess(step_s=measured.step_s, save_s=measured.save_s, kill_wait_s=kill_wait_s, lead_s=lead_s,
                      facts=_cluster_facts(), latency_steps=measured.latency_steps,
                      teardown_s=measured.teardown_s or 0.0, async_save_s=measured.async_save_s)
    sizes = {r.get("world_size") for r in records if isinstance(r.get("world_size"), int)}  # [5] is no key
    others = sorted(s for s in sizes if s != world_size) if world_size else []
    if others:  # the step time of this world size is not the others': say which one the need was sized from
        warnings = [f"{w} (sized from world size {world_size}'s steps; world size {others} steps, from before "
                    "the elastic resume, are not this run's)" for w in warnings]
    for warning in warnings:
        logger.warning("slurm_jit grace check (%s): %s", when, warning)
    return warnings
