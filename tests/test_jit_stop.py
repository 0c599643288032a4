"""JitTrainer on real DeepSpeed ranks (2 CPU ranks over gloo, tiny GPT-2/Llama from a config), real SIGTERMs.

Each stopped run is resumed and its per-step losses compared with an uninterrupted run of the same config:
bitwise under ZeRO-2, within 1e-6 relative under ZeRO-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jit_helpers import (
    assert_jit_stop,
    assert_same_losses,
    losses,
    run_and_signal,
    run_to_end,
)

pytestmark = pytest.mark.deepspeed

ZERO2 = ["--zero-stage", "2", "--max-steps", "80", "--step-sleep", "0.03", "--kill-wait", "1"]
# ZeRO-3 with a Llama, gradient accumulation, dataloader workers and evaluations, as in the issue.
ZERO3 = ["--zero-stage", "3", "--model", "llama", "--grad-accum", "2", "--workers", "2", "--eval-steps", "15",
         "--max-steps", "60", "--step-sleep", "0.03", "--kill-wait", "1"]
ZERO3_TOL = 1e-6


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[int, float]]]:
    """Uninterrupted runs of each configuration."""
    refs = {}
    for name, args in (("zero2", ZERO2), ("zero3", ZERO3)):
        out = tmp_path_factory.mktemp(f"ref-{name}") / "out"
        assert run_to_end(out, args) == [0, 0]
        refs[name] = losses(out)
    return refs


def _stop_resume_compare(out: Path, args: list[str], plan: list[tuple[int, float]],
                         reference: list[tuple[int, float]], rel_tol: float) -> int:
    result = run_and_signal(out, args, plan)
    ckpt = assert_jit_stop(out, result)
    step = int(ckpt.name.split("-")[1])
    assert 3 <= step < len(reference), step
    assert run_to_end(out, [*args, "--resume"]) == [0, 0]
    assert_same_losses(losses(out), reference, rel_tol)
    return step


@pytest.mark.parametrize("stagger_s", [0.0, 0.1, 0.5, 2.0])
def test_zero2_staggered_sigterm_stops_resumes_bitwise(tmp_path: Path, reference: dict, stagger_s: float) -> None:
    _stop_resume_compare(tmp_path / "out", ZERO2, [(0, 0.0), (1, stagger_s)], reference["zero2"], 0.0)


@pytest.mark.parametrize("stagger_s", [0.0, 0.1, 0.5, 2.0])
def test_zero3_accum_workers_staggered_sigterm_resumes_exactly(tmp_path: Path, reference: dict,
                                                               stagger_s: float) -> None:
    _stop_resume_compare(tmp_path / "out", ZERO3, [(1, 0.0), (0, stagger_s)], reference["zero3"], ZERO3_TOL)


@pytest.mark.parametrize("rank", [0, 1])
def test_signal_to_one_rank_only_stops_both(tmp_path: Path, reference: dict, rank: int) -> None:
    _stop_resume_compare(tmp_path / "out", ZERO2, [(rank, 0.0)], reference["zero2"], 0.0)
