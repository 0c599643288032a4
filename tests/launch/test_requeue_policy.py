"""The requeue policy (pure): replay the cases the launchers meet, each with the decision and its reason."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slurm_jit.launch import policy
from slurm_jit.launch.policy import Facts

# A JIT stop at the time-limit warning of a first run, with a complete checkpoint: the case that requeues.
JIT_AT_LIMIT = Facts(record_state="jit_stop", record_step=120, resumable=True, resume_point="out/checkpoint-120",
                     job_state="RUNNING", time_left_s=40, signal_lead_s=60, restart_count=0, max_requeues=3,
                     previous_step=None, srun_exit=0)


def test_jit_stop_at_the_time_limit_is_requeued() -> None:
    decision = policy.decide(JIT_AT_LIMIT)
    assert decision.requeue and decision.cause == policy.CAUSE_TIME_LIMIT and not decision.failure_retry
    assert decision.line(JIT_AT_LIMIT) == (
        "slurm-jit: stopped by time limit at step 120 (restart 0); policy: requeue: JIT checkpoint complete; "
        "requeue 1 of 3, resume from out/checkpoint-120")


@pytest.mark.parametrize(("change", "cause", "requeue", "reason"), [
    ({"job_state": "SIGNALING"}, policy.CAUSE_TIME_LIMIT, True, "requeue 1 of 3"),
    ({"preempted": True, "time_left_s": 900}, policy.CAUSE_PREEMPTION, True, "requeue 1 of 3"),
    ({"time_left_s": 900}, policy.CAUSE_SIGNAL, True, "requeue 1 of 3"),
    ({"time_left_s": None}, policy.CAUSE_SIGNAL, True, "requeue 1 of 3"),
    ({"job_state": "CANCELLED"}, policy.CAUSE_USER_CANCEL, False, "cancelled: never requeued"),
    ({"job_state": "CANCELLED", "record_state": "failed"}, policy.CAUSE_USER_CANCEL, False, "never requeued"),
    ({"job_state": "COMPLETING"}, policy.CAUSE_TIME_LIMIT, False, "the job is COMPLETING, not running"),
    ({"job_state": "UNKNOWN"}, policy.CAUSE_TIME_LIMIT, False, "not running"),
    ({"record_state": "finished"}, policy.CAUSE_FINISHED, False, "reached its end"),
    ({"restart_count": 3}, policy.CAUSE_TIME_LIMIT, False, "maximum requeues reached (3 of 3)"),
    ({"restart_count": 2}, policy.CAUSE_TIME_LIMIT, True, "requeue 3 of 3"),
    ({"max_requeues": 0}, policy.CAUSE_TIME_LIMIT, False, "maximum requeues reached (0 of 0)"),
    ({"resumable": False}, policy.CAUSE_TIME_LIMIT, False, "no resumable checkpoint"),
    ({"previous_step": 120}, policy.CAUSE_TIME_LIMIT, False, "crash loop: no progress since the last restart"),
    ({"previous_step": 130}, policy.CAUSE_TIME_LIMIT, False, "crash loop"),
    ({"previous_step": 119}, policy.CAUSE_TIME_LIMIT, True, "requeue 1 of 3"),
    ({"record_step": None, "previous_step": 5}, policy.CAUSE_TIME_LIMIT, False, "crash loop"),
    ({"record_state": "failed", "srun_exit": 1}, policy.CAUSE_CRASH, False,
     "stop record says failed, srun exit 1; failures are not requeued (--retry-on-failure 0, 0 used)"),
    ({"record_state": "running"}, policy.CAUSE_CRASH, False, "failures are not requeued"),
    ({"record_state": None, "stale_record": True}, policy.CAUSE_CRASH, False, "from an earlier run"),
    ({"record_state": None, "srun_exit": 1}, policy.CAUSE_CRASH, False, "no stop record, srun exit 1"),
    ({"record_state": None, "srun_exit": None}, policy.CAUSE_CRASH, False, "no stop record"),
    ({"record_state": None, "job_state": "CANCELLED"}, policy.CAUSE_USER_CANCEL, False, "never requeued"),
    ({"record_state": None}, policy.CAUSE_FINISHED, False, "every task exited 0 and wrote no stop record"),
    ({"record_state": "failed", "retry_on_failure": 2}, policy.CAUSE_CRASH, True, "failure retry 1 of 2"),
    ({"record_state": "failed", "retry_on_failure": 2, "failure_retries": 2}, policy.CAUSE_CRASH, False,
     "(--retry-on-failure 2, 2 used)"),
    ({"record_state": "failed", "retry_on_failure": 5, "restart_count": 3}, policy.CAUSE_CRASH, False,
     "maximum requeues reached"),
])
def test_cases(change: dict[str, object], cause: str, requeue: bool, reason: str) -> None:
    facts = replace(JIT_AT_LIMIT, **change)  # type: ignore[arg-type]
    decision = policy.decide(facts)
    assert (decision.cause, decision.requeue) == (cause, requeue), decision
    assert reason in decision.reason
    assert decision.failure_retry == (requeue and cause == policy.CAUSE_CRASH)


def test_finished_reads_as_finished() -> None:
    facts = replace(JIT_AT_LIMIT, record_state="finished", record_step=400)
    assert policy.decide(facts).line(facts) == (
        "slurm-jit: finished at step 400 (restart 0); policy: no requeue: training reached its end")


def test_a_function_without_a_trainer_that_returned_reads_as_finished_not_as_a_crash() -> None:
    """Before, a JitExecutor function job whose tasks all returned logged "stopped by crash ... srun exit 0"."""
    facts = replace(JIT_AT_LIMIT, record_state=None, record_step=None)
    assert policy.decide(facts).line(facts) == (
        "slurm-jit: finished (restart 0); policy: no requeue: every task exited 0 and wrote no stop record (no "
        "JitTrainer in it): done")


def test_the_time_limit_window_is_the_lead_plus_slurms_early_signal() -> None:
    at_edge = replace(JIT_AT_LIMIT, time_left_s=60 + policy.SLURM_SIGNAL_EARLY_S)
    assert policy.stop_cause(at_edge) == policy.CAUSE_TIME_LIMIT
    assert policy.stop_cause(replace(at_edge, time_left_s=at_edge.time_left_s + 1)) == policy.CAUSE_SIGNAL


def test_negative_limits_are_refused_with_a_hint() -> None:
    with pytest.raises(ValueError, match="HINT"):
        replace(JIT_AT_LIMIT, max_requeues=-1)
