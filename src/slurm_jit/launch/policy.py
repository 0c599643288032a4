"""The one requeue policy, shared by ``python launch/submit.py`` and the raw sbatch scripts.

Pure: facts in, a decision and a one-line reason out. No Slurm calls, no files, no clock: the helper command
:mod:`slurm_jit.launch.after_step` gathers the facts once per job, after every rank has exited, and acts.

Requeue the same job id only when: the stop record of *this* job id and restart says a JIT checkpoint completed;
``ckpt-check`` finds a resumable checkpoint; the job is still running (never after ``scancel``); the requeue
count is below the maximum; and the run made progress (its global step passed the previous stop's, else it is
a crash loop). After a crash (a failure that was not a JIT stop): no requeue unless ``--retry-on-failure K``,
counted separately (and still bounded by the maximum). A hang (stop record ``hung``) or a lost peer (``failed``
with ``lost_peer``) is requeued from the newest complete checkpoint under a budget of its own, ``--retry-on-hang K``
(default 1), never counted as progress and still bounded by the maximum; with ``--exclude-hung-node`` the requeued
job excludes the stuck rank's node. A node failure (Slurm requeued the job itself: a restart this launcher did not
make) is told from the launcher's history by :func:`slurm_restart` and named in the log; Slurm's restart counts
against the maximum (``SLURM_RESTART_COUNT``).
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_jit.train.stop_summary import StuckRank, hang_words, lost_peer_words

# Slurm states in which the job is still alive and may be requeued (scontrol show job). SIGNALING is shown while
# slurmctld delivers the --signal warning; COMPLETING never reaches us (our batch shell is still running).
ACTIVE_STATES = frozenset({"RUNNING", "SIGNALING", "CONFIGURING"})
CANCELLED_STATES = frozenset({"CANCELLED"})
# sbatch(1) --signal: "may be sent up to 60 seconds earlier than specified"; a JIT stop with at most the lead plus
# this much left of the time limit was the time-limit warning.
SLURM_SIGNAL_EARLY_S = 60

CAUSE_TIME_LIMIT = "time limit"
CAUSE_PREEMPTION = "preemption"
CAUSE_USER_CANCEL = "user cancel"
CAUSE_SIGNAL = "stop signal"  # a JIT stop neither near the time limit nor preempted: scancel --signal, say
CAUSE_CRASH = "crash"
CAUSE_HANG = "hang"  # a rank's hang watchdog ended it (stop record ``hung``): --retry-on-hang
CAUSE_PEER_LOST = "peer lost"  # a rank ended because a peer died (``failed`` with ``lost_peer``): --retry-on-hang
CAUSE_NODE_FAILURE = "node failure"  # Slurm requeued the job itself (a restart after_step did not make)
DEFAULT_RETRY_ON_HANG = 1  # issue 20: one requeue after a hang; a second hang in a row is likely the code's
CAUSE_FINISHED = "finished"
# --exclude-hung-node asked, but the record names no usable node (none, or not a Slurm node name): said, not silent
NODE_UNKNOWN = (", no node excluded: the stop record names no node usable in ExcNodeList for the stuck rank (see "
                "its hang report or lost_peer in the job log)")


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What the helper found after the training processes exited."""

    record_state: str | None  # the stop record's state, None when missing or from another job/restart
    record_step: int | None  # the global step in the stop record
    stale_record: bool = False  # a record exists but belongs to another job id or restart
    resumable: bool  # ckpt-check: a resumable checkpoint exists
    resume_point: str | None = None  # its path, for the log line
    job_state: str  # JobState from scontrol show job (RUNNING, SIGNALING, CANCELLED, ...)
    preempted: bool = False  # scontrol's PreemptTime is set
    time_left_s: float | None = None  # of the time limit; None when unlimited or unknown
    signal_lead_s: int | None = None  # N of --signal=TERM@N
    restart_count: int = 0  # SLURM_RESTART_COUNT (unset on the first run: 0)
    max_requeues: int  # the most requeues this job may have
    failure_retries: int = 0  # requeues already spent on failures (not JIT stops) of this job
    retry_on_failure: int = 0  # the most requeues after failures
    previous_step: int | None = None  # the global step at the previous stop, None on the first
    srun_exit: int | None = None  # srun's exit status
    stuck: StuckRank | None = None  # the hung rank or the lost peer the record names
    hang_retries: int = 0  # requeues already spent on hangs and lost peers of this job
    retry_on_hang: int = DEFAULT_RETRY_ON_HANG  # the most requeues after hangs and lost peers
    exclude_hung_node: bool = False  # the requeued job excludes the stuck rank's node

    def __post_init__(self) -> None:
        if min(self.max_requeues, self.retry_on_failure, self.retry_on_hang) < 0:
            raise ValueError("--max-requeues, --retry-on-failure and --retry-on-hang must be 0 or more. HINT: e.g. "
                             "--max-requeues 5 --retry-on-hang 1")


@dataclass(frozen=True, kw_only=True)
class Decision:
    cause: str  # why training stopped: one of the CAUSE_* words
    requeue: bool
    reason: str  # why the policy decided so, in words
    failure_retry: bool = False  # this requeue spends one of --retry-on-failure
    hang_retry: bool = False  # this requeue spends one of --retry-on-hang
    exclude_node: str | None = None  # the node the requeued job must not run on (--exclude-hung-node)

    def line(self, facts: Facts) -> str:
        """The job log's one line."""
        verdict = "requeue" if self.requeue else "no requeue"
        step = "" if facts.record_step is None else f" at step {facts.record_step}"
        what = "finished" if self.cause == CAUSE_FINISHED else f"stopped by {self.cause}"
        if facts.stuck is not None and self.cause in (CAUSE_HANG, CAUSE_PEER_LOST):
            what, step = "stopped by " + (hang_words if self.cause == CAUSE_HANG else lost_peer_words)(facts.stuck), ""
        return f"slurm-jit: {what}{step} (restart {facts.restart_count}); policy: {verdict}: {self.reason}"


def slurm_restart(restart_count: int, requeued_restarts: frozenset[int]) -> bool:
    """This run's restart was made by Slurm itself, not by after_step: a node failure (or ``scontrol requeue`` by
    hand). ``requeued_restarts`` are the restarts of this job after which after_step requeued it (its history)."""
    return restart_count > 0 and restart_count - 1 not in requeued_restarts


def node_failure_line(restart_count: int) -> str:
    """The job log's line when :func:`slurm_restart` holds."""
    return (f"slurm-jit: restart {restart_count} was made by Slurm itself, not by this launcher: "
            f"{CAUSE_NODE_FAILURE} (or a preemption Slurm requeued first, a requeue by hand, a lost launcher "
            f"record); it resumed from the newest complete checkpoint and counts "
            f"against --max-requeues. HINT: scontrol show job and the slurmctld log say which node failed")


def stop_cause(facts: Facts) -> str:
    """Why the training stopped, from the stop record and the job's Slurm state."""
    if facts.job_state in CANCELLED_STATES:
        return CAUSE_USER_CANCEL
    if facts.record_state == "finished" or _exited_without_trainer(facts):
        return CAUSE_FINISHED
    if facts.record_state == "hung":
        return CAUSE_HANG
    if facts.record_state == "failed" and facts.stuck is not None:
        return CAUSE_PEER_LOST
    if facts.record_state != "jit_stop":
        return CAUSE_CRASH
    if facts.preempted:
        return CAUSE_PREEMPTION
    if (facts.time_left_s is not None and facts.signal_lead_s is not None
            and facts.time_left_s <= facts.signal_lead_s + SLURM_SIGNAL_EARLY_S):
        return CAUSE_TIME_LIMIT
    return CAUSE_SIGNAL


def _exited_without_trainer(facts: Facts) -> bool:
    """Every task exited 0 and none wrote a stop record, ever: a program or function without a JitTrainer (a
    JitTrainer writes one when train() starts) that did its work. A record of another run is not this case."""
    return facts.record_state is None and not facts.stale_record and facts.srun_exit == 0


def decide(facts: Facts) -> Decision:
    """Requeue or not, and why (see the module docstring)."""
    cause = stop_cause(facts)
    if cause == CAUSE_FINISHED and facts.record_state != "finished":
        return Decision(cause=cause, requeue=False, reason="every task exited 0 and wrote no stop record (no "
                                                           "JitTrainer in it): done")
    if cause == CAUSE_FINISHED:
        return Decision(cause=cause, requeue=False, reason="training reached its end")
    if cause == CAUSE_USER_CANCEL:
        return Decision(cause=cause, requeue=False, reason="the job was cancelled: never requeued")
    if facts.job_state not in ACTIVE_STATES:
        return Decision(cause=cause, requeue=False, reason=f"the job is {facts.job_state}, not running")
    if facts.restart_count >= facts.max_requeues:
        return Decision(cause=cause, requeue=False,
                        reason=f"maximum requeues reached ({facts.restart_count} of {facts.max_requeues})")
    if cause in (CAUSE_HANG, CAUSE_PEER_LOST):
        return _after_hang(facts, cause)
    if cause == CAUSE_CRASH:
        return _after_failure(facts, cause)
    if not facts.resumable:
        return Decision(cause=cause, requeue=False, reason="ckpt-check finds no resumable checkpoint")
    if facts.previous_step is not None and (facts.record_step is None or facts.record_step <= facts.previous_step):
        return Decision(cause=cause, requeue=False,
                        reason=f"crash loop: no progress since the last restart (step {facts.previous_step})")
    return Decision(cause=cause, requeue=True,
                    reason=f"JIT checkpoint complete; requeue {facts.restart_count + 1} of {facts.max_requeues}, "
                           f"resume from {facts.resume_point}")


def _after_failure(facts: Facts, cause: str) -> Decision:
    if facts.stale_record:
        what = "the stop record is from an earlier run (killed before train() started?)"
    elif facts.record_state is None:
        what = "no stop record"
    else:
        what = f"stop record says {facts.record_state}"
    what += "" if facts.srun_exit is None else f", srun exit {facts.srun_exit}"
    if facts.failure_retries >= facts.retry_on_failure:
        return Decision(cause=cause, requeue=False,
                        reason=f"{what}; failures are not requeued (--retry-on-failure {facts.retry_on_failure}, "
                               f"{facts.failure_retries} used)")
    return Decision(cause=cause, requeue=True, failure_retry=True,
                    reason=f"{what}; failure retry {facts.failure_retries + 1} of {facts.retry_on_failure}")


def _after_hang(facts: Facts, cause: str) -> Decision:
    """A hang or a lost peer: requeue from the newest complete checkpoint under --retry-on-hang, not as progress."""
    what = f"stop record says {facts.record_state}" + ("" if facts.srun_exit is None else
                                                       f", srun exit {facts.srun_exit}")
    if facts.hang_retries >= facts.retry_on_hang:
        return Decision(cause=cause, requeue=False,
                        reason=f"{what}; hang retries used up (--retry-on-hang {facts.retry_on_hang}, "
                               f"{facts.hang_retries} used)")
    node = facts.stuck.node if facts.exclude_hung_node and facts.stuck is not None else None
    start = f"resume from {facts.resume_point}" if facts.resumable else "no complete checkpoint: starts over"
    excluded = f", excluding node {node}" if node else (NODE_UNKNOWN if facts.exclude_hung_node else "")
    return Decision(cause=cause, requeue=True, hang_retry=True, exclude_node=node,
                    reason=f"{what}; hang retry {facts.hang_retries + 1} of {facts.retry_on_hang}, {start}{excluded}")
