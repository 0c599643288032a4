"""After the training step: decide once per job whether to requeue it, say why in one line, and act.

Run by the batch script after ``srun`` returns (every rank has exited)::

    python -m slurm_jit.launch.after_step OUT_DIR --srun-exit $? --max-requeues 5 [--retry-on-failure K]
        [--retry-on-hang K] [--exclude-hung-node [--min-nodes N]]

It reads the stop record of *this* job id and restart, runs the ``ckpt-check`` gate, reads the job's state through
the Slurm gateway, decides with :mod:`slurm_jit.launch.policy`, records the step in
``OUT_DIR/slurm-jit/launch-progress.json``, prints the decision and only then calls ``scontrol requeue`` (which
ends this batch shell). A requeue withdrawn (the job was cancelled meanwhile) or refused by Slurm is recorded as
such, not as a requeue. A record that cannot be written (a full disk, a quota) is one warning line: the decision
stands. A run that Slurm restarted itself (a node failure: no requeue of the run before it in the record) is named
in the log and the record. Exit 0 when requeued or finished, else srun's status (1 when that was 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from slurm_jit import slurm
from slurm_jit.grace.calc import LEAD_ENV_VAR
from slurm_jit.launch import gate, policy, progress
from slurm_jit.train import stop_record, stop_summary

EXIT_ERROR = 2


def _int(value: object, default: int = 0) -> int:
    try:
        return int(str(value))
    except ValueError:
        return default


def _record_facts(out_dir: str, job_id: str, restart_count: int) -> dict[str, Any]:
    record = stop_record.read(out_dir)
    if record is None:
        return {"record_state": None, "record_step": None}
    ours = str(record.get("job_id")) == job_id and _int(record.get("restart_count") or 0) == restart_count
    if not ours:
        return {"record_state": None, "record_step": None, "stale_record": True}
    step = record.get("step")
    return {"record_state": record["state"], "record_step": step if isinstance(step, int) else None,
            "stuck": stop_summary.stuck(record)}


def _job_facts(job_id: str) -> dict[str, Any]:
    try:
        job = slurm.show_job(job_id)
    except slurm.SlurmError as exc:
        print(f"slurm-jit: cannot read the job's state ({exc}); not requeueing. HINT: once slurmctld answers, "
              f"check with: python launch/submit.py status {job_id}", file=sys.stderr)
        return {"job_state": "UNKNOWN"}
    limit_s, run_s = slurm.seconds(job.get("TimeLimit", "")), slurm.seconds(job.get("RunTime", ""))
    return {"job_state": slurm.job_state(job),
            "preempted": job.get("PreemptTime", "None") not in {"None", "", "Unknown"},
            "time_left_s": None if limit_s is None or run_s is None else float(limit_s - run_s)}


def restart_count_of(env: Mapping[str, str]) -> int:
    """SLURM_RESTART_COUNT (unset on the first run: 0); ValueError when it is not a count."""
    value = env.get("SLURM_RESTART_COUNT", "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(f"SLURM_RESTART_COUNT={value!r} is not a count; not requeueing (the requeue limit could "
                         "not hold). HINT: do not set it yourself: Slurm does, from the second run on")
    return int(value)


def gather(args: argparse.Namespace, env: Mapping[str, str]) -> policy.Facts:
    job_id = env["SLURM_JOB_ID"]
    restart_count = restart_count_of(env)
    try:
        checked = gate.check(args.out_dir, quarantine=args.quarantine)
        resumable, point = checked.resume_point is not None, checked.resume_point
    except OSError:
        resumable, point = False, None
    lead = env.get(LEAD_ENV_VAR, "")
    saved = progress.read(args.out_dir)
    return policy.Facts(
        **_record_facts(args.out_dir, job_id, restart_count), **_job_facts(job_id),
        resumable=resumable, resume_point=point, signal_lead_s=_int(lead) if lead.isdigit() else None,
        restart_count=restart_count, max_requeues=args.max_requeues,
        failure_retries=progress.failure_retries(saved, job_id), retry_on_failure=args.retry_on_failure,
        previous_step=progress.previous_step(saved, job_id), srun_exit=args.srun_exit,
        hang_retries=progress.hang_retries(saved, job_id), retry_on_hang=args.retry_on_hang,
        exclude_hung_node=args.exclude_hung_node,
    )


def _saved(out_dir: str) -> dict[str, Any]:
    """The progress record so far; an unusable one is kept aside (nothing saved is lost) and a new one started."""
    trouble = progress.problem(out_dir)
    if trouble:
        try:
            kept = f"kept as {progress.keep_copy(out_dir)}"
        except OSError as exc:
            kept = f"could not keep a copy ({exc.strerror or exc})"
        print(f"slurm-jit: warning: {trouble}; {kept}, starting a new one. HINT: the crash-loop check had no "
              "previous step this time; --max-requeues still holds", file=sys.stderr, flush=True)
        return {}
    return progress.read(out_dir)


def _remember(out_dir: str, job_id: str, saved: dict[str, Any], facts: policy.Facts, decision: policy.Decision,
              outcome: str) -> None:
    """Record this stop on top of ``saved``; ``outcome`` is what happened: "requeued", "not requeued", or why a
    requeue the policy asked for did not happen. Writing again with another outcome replaces the entry."""
    requeued = outcome == OUTCOME_REQUEUED
    retries = {key: _counted(saved, key, job_id, spent and requeued)
               for key, spent in (("failure_retries", decision.failure_retry), ("hang_retries", decision.hang_retry))}
    last_step = facts.record_step if facts.record_state == "jit_stop" else progress.previous_step(saved, job_id)
    history: list[object] = [*progress.history(saved), *_slurm_restart_entry(saved, job_id, facts.restart_count),
                             {"job_id": job_id, "restart": facts.restart_count, "cause": decision.cause,
                              "step": facts.record_step, "requeue": requeued, "reason": decision.reason,
                              "outcome": outcome}]
    try:
        progress.write(out_dir, {"job_id": job_id, "last_step": last_step, **retries, "history": history[-50:]})
    except OSError as exc:  # EDQUOT, ENOSPC, EIO: the decision matters more than its record
        print(f"slurm-jit: warning: cannot write {progress.path(out_dir)} ({exc.strerror or exc}); the decision "
              "stands. HINT: free space or quota there; without it the next restart has no previous step for the "
              "crash-loop check (--max-requeues still holds)", file=sys.stderr, flush=True)


OUTCOME_REQUEUED, OUTCOME_NOT_REQUEUED = "requeued", "not requeued"
OUTCOME_BY_SLURM = "requeued by Slurm"  # a node failure: the run before this one ended without after_step


def _counted(saved: dict[str, Any], key: str, job_id: str, spend: bool) -> dict[str, int]:
    """The per-job retry counts under ``key``, one more for this job when this requeue spends one."""
    stored = saved.get(key)
    counts: dict[str, int] = dict(stored) if isinstance(stored, dict) else {}
    return {**counts, job_id: progress.failure_retries(saved, job_id, key=key) + 1} if spend else counts


def _slurm_restart_entry(saved: dict[str, Any], job_id: str, restart_count: int) -> list[dict[str, Any]]:
    """The history entry of the run before this one when Slurm restarted the job itself (a node failure)."""
    if not policy.slurm_restart(restart_count, progress.requeued_restarts(saved, job_id)):
        return []
    return [{"job_id": job_id, "restart": restart_count - 1, "cause": policy.CAUSE_NODE_FAILURE, "step": None,
             "requeue": False, "reason": "Slurm restarted the job itself (no requeue by this launcher recorded)",
             "outcome": OUTCOME_BY_SLURM}]


def _on_term(signum: int, frame: object) -> None:
    global _job_ending
    _job_ending = True


_job_ending = False  # set by SIGTERM: --signal (no B:) never reaches the batch shell; scancel or the end does


def _withdrawn(job_id: str) -> str | None:
    """Why a requeue the policy asked for must not happen now (None: go on): the job was cancelled (or is
    ending) since the policy read its state. Slurm accepts a requeue of a cancelled job: a scancel must win."""
    state = "UNKNOWN"
    if not _job_ending:
        try:
            state = slurm.job_state(slurm.show_job(job_id))
        except slurm.SlurmError as exc:
            state = f"unknown ({exc})"
    if _job_ending or state not in policy.ACTIVE_STATES:
        why = "this helper got SIGTERM (scancel or the job's end)" if _job_ending else f"the job is now {state}"
        return f"requeue withdrawn: {why}"
    return None


def _requeue(job_id: str, exclude_node: str | None, min_nodes: int | None = None) -> str | None:
    """``scontrol requeue`` (which ends this batch shell), excluding ``exclude_node`` when given (a job of a node
    range needs ``min_nodes``, not the count it runs on); None when Slurm took it, else why not."""
    try:
        if exclude_node is None:
            slurm.requeue(job_id)
            return None
        print(f"slurm-jit: requeue excluding node {exclude_node} (--exclude-hung-node)", flush=True)
        warning = slurm.requeue_excluding(job_id, exclude_node, min_nodes=min_nodes)
    except slurm.SlurmError as exc:
        return f"requeue failed: {exc}"
    if warning is not None:
        print(f"slurm-jit: warning: {warning}", flush=True)
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slurm_jit.launch.after_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--srun-exit", type=int, default=None, help="srun's exit status ($?)")
    p.add_argument("--max-requeues", type=int, default=5, help="the most requeues of this job (default 5)")
    p.add_argument("--retry-on-failure", type=int, default=0, help="requeues after failures (default 0)")
    p.add_argument("--retry-on-hang", type=int, default=policy.DEFAULT_RETRY_ON_HANG,
                   help=f"requeues after hangs and lost peers (default {policy.DEFAULT_RETRY_ON_HANG})")
    p.add_argument("--exclude-hung-node", action="store_true",
                   help="the requeued job excludes the hung rank's (or lost peer's) node")
    p.add_argument("--min-nodes", type=int, default=None, metavar="N",
                   help="a job of a node range (--nodes N-MAX): the fewest nodes it may be requeued on, so that "
                        "--exclude-hung-node excludes a node where N are left (default: the nodes it runs on)")
    p.add_argument("--quarantine", action="store_true", help="the gate quarantines non-resumable checkpoints")
    return p


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    global _job_ending
    args = _parser().parse_args(argv)
    _job_ending = False
    if threading.current_thread() is not threading.main_thread():
        return _decide_and_act(args, os.environ if env is None else env)
    previous = signal.signal(signal.SIGTERM, _on_term)
    try:
        return _decide_and_act(args, os.environ if env is None else env)
    finally:
        signal.signal(signal.SIGTERM, previous)


# The causes where Slurm signalled the step (its --signal warning, a preemption, scancel --signal): slurmstepd
# then writes "*** STEP <job>.0 ON <node> CANCELLED AT <time> ***" into the job log, which reads like a cancel.
STEP_SIGNALLED = (policy.CAUSE_TIME_LIMIT, policy.CAUSE_PREEMPTION, policy.CAUSE_SIGNAL)


def _decide_and_act(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    if not env.get("SLURM_JOB_ID"):
        print("slurm-jit after_step: SLURM_JOB_ID is not set. HINT: run it inside the batch script, after srun",
              file=sys.stderr)
        return EXIT_ERROR
    try:
        facts = gather(args, env)
    except ValueError as exc:
        print(f"slurm-jit after_step: {exc}", file=sys.stderr)
        return EXIT_ERROR
    decision = policy.decide(facts)
    job_id, saved = env["SLURM_JOB_ID"], _saved(args.out_dir)
    if policy.slurm_restart(facts.restart_count, progress.requeued_restarts(saved, job_id)):
        print(policy.node_failure_line(facts.restart_count), flush=True)
    withdrawn = _withdrawn(job_id) if decision.requeue else None
    outcome = withdrawn or (OUTCOME_REQUEUED if decision.requeue else OUTCOME_NOT_REQUEUED)
    _remember(args.out_dir, job_id, saved, facts, decision, outcome)  # before the requeue ends this shell
    print(decision.line(facts), flush=True)
    if decision.cause in STEP_SIGNALLED:
        print(f"slurm-jit: the 'slurmstepd: ... *** STEP {job_id}.0 ... CANCELLED AT ... ***' line above (if any) is "
              "how Slurm logs its signal reaching the step, not a cancel: the ranks answered it with this JIT stop",
              flush=True)
    if decision.requeue:
        return _act(args.out_dir, job_id, saved, facts, decision, withdrawn, args.min_nodes)
    if decision.cause == policy.CAUSE_FINISHED:
        return 0
    return args.srun_exit or 1


def _act(out_dir: str, job_id: str, saved: dict[str, Any], facts: policy.Facts, decision: policy.Decision,
         withdrawn: str | None, min_nodes: int | None = None) -> int:
    """Requeue, unless withdrawn (checked again: a scancel may have come while the record was written); what did
    not happen replaces the record's "requeued"."""
    if withdrawn is None:
        withdrawn = _withdrawn(job_id)
        if withdrawn is not None:
            _remember(out_dir, job_id, saved, facts, decision, withdrawn)
    if withdrawn is not None:
        print(f"slurm-jit: {withdrawn}; never requeued after a cancel. HINT: to go on, resubmit (the checkpoint "
              "is kept)", flush=True)
        return 1
    failed = _requeue(job_id, decision.exclude_node, min_nodes)
    if failed is None:
        return 0
    _remember(out_dir, job_id, saved, facts, decision, failed)
    print(f"slurm-jit: {failed}. HINT: requeue it by hand (scontrol requeue {job_id}) or resubmit; the "
          "checkpoint is kept", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
