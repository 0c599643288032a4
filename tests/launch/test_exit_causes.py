"""Each exit cause of docs/hangs.md's table, as the requeue policy reads it: the cause named and what is done."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slurm_jit.launch import policy
from slurm_jit.launch.policy import Facts
from slurm_jit.train import stop_summary

HUNG = stop_summary.StuckRank(rank=1, node="n2", step=29)
LOST = stop_summary.StuckRank(rank=1, node="n2", step=28)
# A JIT stop far from the time limit, a complete checkpoint, a first run: every row changes what makes its cause.
BASE = Facts(record_state="jit_stop", record_step=30, resumable=True, resume_point="out/checkpoint-30",
             job_state="RUNNING", time_left_s=3000, signal_lead_s=120, restart_count=0, max_requeues=3,
             previous_step=None, srun_exit=0)


@pytest.mark.parametrize(("change", "cause", "requeue", "says"), [
    ({"time_left_s": 100}, policy.CAUSE_TIME_LIMIT, True, "stopped by time limit at step 30"),
    ({"preempted": True}, policy.CAUSE_PREEMPTION, True, "stopped by preemption"),
    ({"job_state": "CANCELLED"}, policy.CAUSE_USER_CANCEL, False, "never requeued"),
    ({}, policy.CAUSE_SIGNAL, True, "stopped by stop signal"),
    ({"record_state": "hung", "srun_exit": 87}, policy.CAUSE_HANG, True,
     "stopped by hang at step 30 (restart 0); policy: requeue: stop record says hung, srun exit 87; hang retry 1 "
     "of 1, resume from out/checkpoint-30"),
    ({"record_state": "hung", "srun_exit": 87, "stuck": HUNG}, policy.CAUSE_HANG, True,
     "stopped by hang at step 29 on rank 1 (node n2), stack in the log (restart 0); policy: requeue"),
    ({"record_state": "hung", "srun_exit": 87, "hang_retries": 1}, policy.CAUSE_HANG, False,
     "hang retries used up (--retry-on-hang 1, 1 used)"),
    ({"record_state": "hung", "srun_exit": 87, "retry_on_hang": 0, "retry_on_failure": 5}, policy.CAUSE_HANG, False,
     "--retry-on-hang 0"),
    ({"record_state": "hung", "srun_exit": 87, "restart_count": 3}, policy.CAUSE_HANG, False,
     "maximum requeues reached (3 of 3)"),
    ({"record_state": "hung", "srun_exit": 87, "resumable": False, "resume_point": None}, policy.CAUSE_HANG, True,
     "no complete checkpoint: starts over"),
    ({"record_state": "failed", "srun_exit": 1, "stuck": LOST}, policy.CAUSE_PEER_LOST, True,
     "stopped by peer rank 1 lost at step 28 (node n2) (restart 0); policy: requeue: stop record says failed, srun "
     "exit 1; hang retry 1 of 1"),
    ({"record_state": "failed", "srun_exit": 1, "stuck": LOST, "hang_retries": 2, "retry_on_hang": 2},
     policy.CAUSE_PEER_LOST, False, "hang retries used up (--retry-on-hang 2, 2 used)"),
    ({"record_state": "failed", "srun_exit": 1}, policy.CAUSE_CRASH, False, "stopped by crash"),
    ({"record_state": "running", "srun_exit": 137}, policy.CAUSE_CRASH, False, "stop record says running"),
    ({"record_state": "finished"}, policy.CAUSE_FINISHED, False, "finished at step 30"),
])
def test_each_exit_cause_is_named_and_handled(change: dict[str, object], cause: str, requeue: bool,
                                              says: str) -> None:
    facts = replace(BASE, **change)
    decision = policy.decide(facts)
    assert (decision.cause, decision.requeue) == (cause, requeue), decision
    assert says in decision.line(facts), decision.line(facts)


def test_a_hang_retry_is_not_a_failure_retry_and_not_progress() -> None:
    hung = replace(BASE, record_state="hung", srun_exit=87, previous_step=30, failure_retries=0)
    decision = policy.decide(hung)  # step 30 again after a stop at 30: a JIT stop would be a crash loop
    assert decision.requeue and decision.hang_retry and not decision.failure_retry, decision


def test_exclude_hung_node_names_the_stuck_node_only_when_asked() -> None:
    hung = replace(BASE, record_state="hung", stuck=HUNG)
    assert policy.decide(hung).exclude_node is None
    decision = policy.decide(replace(hung, exclude_hung_node=True))
    assert decision.exclude_node == "n2" and "excluding node n2" in decision.reason
    lost = replace(BASE, record_state="failed", stuck=LOST, exclude_hung_node=True)
    assert policy.decide(lost).exclude_node == "n2"
    unknown = replace(hung, stuck=stop_summary.StuckRank(rank=1, node=None, step=29), exclude_hung_node=True)
    assert policy.decide(unknown).exclude_node is None


@pytest.mark.parametrize(("restart", "ours", "slurm_made_it"), [
    (0, frozenset(), False),  # the first run: nobody restarted it
    (1, frozenset({0}), False),  # after_step requeued restart 0
    (1, frozenset(), True),  # restart 1 without a requeue by after_step: Slurm (a node failure)
    (3, frozenset({0, 1}), True),  # after_step requeued 0 and 1; restart 2 ended without it
])
def test_node_failure_is_a_restart_the_launcher_did_not_make(restart: int, ours: frozenset[int],
                                                            slurm_made_it: bool) -> None:
    assert policy.slurm_restart(restart, ours) is slurm_made_it
    assert "made by Slurm itself, not by this launcher: node failure" in policy.node_failure_line(restart)


def test_negative_hang_budget_is_refused_with_a_hint() -> None:
    with pytest.raises(ValueError, match="--retry-on-hang must be 0 or more. HINT"):
        replace(BASE, retry_on_hang=-1)
