"""The trainer's runtime grace check (train/runtime_grace.py): its assessment, counting latency steps and the
teardown.
"""

from __future__ import annotations

from pathlib import Path

import pytest

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


def test_after_an_elastic_resume_the_check_sizes_from_this_world_sizes_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real timing log: 2 ranks with 1 s steps, then the resume on 1 rank with 3 s steps (the global batch
    kept). The need is sized from the 1-rank steps, and the warning says the other world size's are not counted."""
    from slurm_jit import timing

    for world, step_s in ((2, 1.0), (1, 3.0)):
        log = timing.TimingLog(tmp_path, rank=0, world_size=world, run_id=f"w{world}")
        for step in range(1, 12):
            log.step(step, step_s)
        log.save(11, "jit", 10.0, 1000)
        log.close()
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv(grace.LEAD_ENV_VAR, "13")  # 1 rank needs 3 + 10 + 1 = 14 s, 2 ranks 1 + 10 + 1 = 12 s
    monkeypatch.setattr(runtime_grace, "_cluster_facts", lambda: None)  # the Slurm boundary: no cluster here
    warnings = runtime_grace.check_and_warn(str(tmp_path), 1.0, "start", world_size=1)
    assert len(warnings) == 1 and "longest step 3.0 s" in warnings[0], warnings
    assert "world size [2] steps, from before the elastic resume, are not this run's" in warnings[0]
    assert runtime_grace.check_and_warn(str(tmp_path), 1.0, "start", world_size=2) == []
