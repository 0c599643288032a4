"""The ranks' stop agreement (train/agreement.py) in one process: pipelined one round, its mode fixed after the
warm-up from the agreed step.
"""

from __future__ import annotations

from slurm_jit.grace import calc as grace
from slurm_jit.train.agreement import StopAgreement


def test_agreement_single_process_is_pipelined_one_round() -> None:
    agreement = StopAgreement()
    assert not agreement.distributed
    assert agreement.poll(True, 2.0).stop is False  # the answer comes one round later
    decision = agreement.poll(False)
    assert decision.stop is True and 1.5 < decision.wait_s <= 2.0  # the kill_wait left, minus time since sent
    assert agreement.poll(False).stop is False
    assert agreement.poll(False).wait_s == 0.0  # no signal anywhere: nothing to wait for
    late = agreement.agree_now(True, -1.0)
    assert late.stop is True and late.wait_s == 0.0  # kill_wait already over
    assert agreement.broadcast({"x": 1}) == {"x": 1}
    assert agreement.gather(3) == [3]


def test_agreement_mode_is_fixed_after_warm_up_from_the_agreed_step() -> None:
    long = StopAgreement()
    assert long.mode == grace.AGREE_BLOCKING and long.latency_steps == 1
    assert long.at_boundary(True, 1.0, step_s=0.1, choose_mode=False).stop is True  # blocking: read at once
    long.at_boundary(False, None, step_s=2.0, choose_mode=True)
    assert long.choice is not None and long.choice.step_s == 2.0 and long.mode == grace.AGREE_BLOCKING
    assert long.at_boundary(True, 0.5, step_s=0.1, choose_mode=True).stop is True  # chosen once, never again
    assert long.mode == grace.AGREE_BLOCKING
    short = StopAgreement()
    short.at_boundary(False, None, step_s=0.1, choose_mode=True)
    assert short.mode == grace.AGREE_OVERLAPPED and short.latency_steps == 2
    assert short.at_boundary(True, 0.5, step_s=0.1, choose_mode=False).stop is False  # read one boundary later
    assert short.at_boundary(False, None, step_s=0.1, choose_mode=False).stop is True
