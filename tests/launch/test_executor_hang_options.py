"""JitExecutor's hang options: ``retry_on_hang`` and ``exclude_hung_node`` reach after_step's line in the batch
script (left out at their defaults, so older scripts are unchanged), and a bad budget is refused in one line."""

from __future__ import annotations

from pathlib import Path

import executor_helpers
import pytest

from slurm_jit.launch import JitExecutor
from slurm_jit.launch.executor import JitExecutorError


def _after_step_line(tmp_path: Path, **options: object) -> str:
    executor = JitExecutor(folder=tmp_path / "logs" / "%j", output_dir=tmp_path / "out", step_time_s=2,
                           save_time_s=5, **options)  # type: ignore[arg-type]
    executor.update_parameters(timeout_min=10, nodes=2, tasks_per_node=1, cpus_per_task=1)
    text = executor.submission_text(executor_helpers.add)
    return next(line for line in text.splitlines() if "-m slurm_jit.launch.after_step" in line)


def test_hang_options_reach_after_step_and_defaults_leave_the_line_alone(tmp_path: Path) -> None:
    line = _after_step_line(tmp_path, retry_on_hang=3, exclude_hung_node=True)
    assert line.endswith("--retry-on-failure 0 --retry-on-hang 3 --exclude-hung-node")
    assert _after_step_line(tmp_path).endswith("--retry-on-failure 0")  # after_step's default: 1 hang retry


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_a_bad_hang_budget_is_refused_in_one_line(tmp_path: Path, value: object) -> None:
    with pytest.raises(JitExecutorError, match=r"retry_on_hang=.*HINT: e.g. retry_on_hang=4"):
        _after_step_line(tmp_path, retry_on_hang=value)


@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_exclude_hung_node_other_than_true_or_false_is_refused_in_one_line(tmp_path: Path, value: object) -> None:
    with pytest.raises(JitExecutorError, match=r"exclude_hung_node=.*: True or False\. HINT: "):
        _after_step_line(tmp_path, exclude_hung_node=value)
