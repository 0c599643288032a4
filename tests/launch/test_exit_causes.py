"""Each exit cause of docs/hangs.md's table, as the requeue policy reads it: the cause named and what is done."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slurm_jit.launch import policy
from slurm_jit.launch.policy import Facts

# A JIT stop far from the time limit, a complete checkpoint, a first run: every row changes what makes its cause.
BASE = Facts(record_state="jit_stop", record_step=30, resumable=True, resume_point="out/checkpoint-30",
             job_state="RUNNING", time_left_s=3000, signal_lead_s=120, restart_count=0, max_requeues=3,
             previous_step=None, srun_exit=0)


@pytest.mark.parametrize(("change", "cause", "requeue", "says"), [
    ({"time_left_s": 100}, policy.CAUSE_TIME_LIMIT, True, "stopped by time limit at step 30"),
    ({"preempted": True}, policy.CAUSE_PREEMPTION, True, "stopped by preemption"),
    ({"job_state": "CANCELLED"}, policy.CAUSE_USER_CANCEL, False, "never requeued"),
    ({}, policy.CAUSE_SIGNAL, True, "stopped by stop signal"),
    ({"record_state": "hung", "srun_exit": 87}, policy.CAUSE_HANG, False,
     "stopped by hang at step 30 (restart 0); policy: no requeue: stop record says hung, srun exit 87; failures"),
    ({"record_state": "hung", "srun_exit": 87, "retry_on_failure": 1}, policy.CAUSE_HANG, True,
     "stop record says hung, srun exit 87; failure retry 1 of 1"),
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
