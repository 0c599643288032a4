"""demo_train's --step-sleep-requeued: the Slurm time-limit tests slow only the first run (so that it cannot finish
before the warning) and let the requeued run (SLURM_RESTART_COUNT > 0) finish at full speed. Pure: no training."""

from __future__ import annotations

import pytest

from slurm_jit import demo_train

ARGS = ["--output-dir", "unused", "--step-sleep", "0.4"]


@pytest.mark.parametrize(("restart_count", "expected_s"), [(None, 0.4), ("", 0.4), ("0", 0.4), ("1", 0.0),
                                                           ("2", 0.0)])
def test_a_requeued_run_sleeps_its_own_step_sleep(monkeypatch: pytest.MonkeyPatch, restart_count: str | None,
                                                 expected_s: float) -> None:
    if restart_count is None:
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("SLURM_RESTART_COUNT", restart_count)
    assert demo_train._step_sleep_s(demo_train.parse_args([*ARGS, "--step-sleep-requeued", "0"])) == expected_s


def test_without_the_option_a_requeued_run_sleeps_as_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert demo_train._step_sleep_s(demo_train.parse_args(ARGS)) == 0.4
