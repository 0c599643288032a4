"""The trainer's runtime grace check (train/runtime_grace.py): its assessment, counting latency steps and the
teardown.
"""

from __future__ import annotations

from slurm_jit.grace import calc as grace
from slurm_jit.train import runtime_grace


def test_runtime_grace_assess() -> None:
    facts = grace.ClusterFacts(kill_wait_s=30, partition="debug", grace_time_s=20, preemptable=True)
    ok = runtime_grace.assess(step_s=1, save_s=2, kill_wait_s=3, lead_s=60, facts=facts)
    assert ok == []
    short = runtime_grace.assess(step_s=30, save_s=40, kill_wait_s=3, lead_s=60, facts=facts)
    assert len(short) == 2
    assert "signal lead 60 s < needed 73 s" in short[0] and "HINT: #SBATCH --signal=TERM@" in short[0]
    assert "GraceTime 20 s" in short[1]
    unset = runtime_grace.assess(step_s=1, save_s=None, kill_wait_s=3, lead_s=None, facts=None)
    assert len(unset) == 1 and grace.LEAD_ENV_VAR in unset[0]


def test_runtime_grace_counts_latency_steps_and_teardown() -> None:
    # a run that read its rounds overlapped: 2 x 2 s + save 49 + kill_wait 3 + teardown 5 = 61 s > a 60 s lead
    late = runtime_grace.assess(step_s=2, save_s=49, kill_wait_s=3, lead_s=60, facts=None, teardown_s=5,
                                latency_steps=2)
    assert len(late) == 1 and "needed 61 s (2 x longest step 2.0 s" in late[0] and "teardown 5.0 s" in late[0]
    # blocking (recorded, or by the rule for 2 s steps): 59 s fits
    assert runtime_grace.assess(step_s=2, save_s=49, kill_wait_s=3, lead_s=60, facts=None, teardown_s=5) == []
