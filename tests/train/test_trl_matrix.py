"""The TRL/PEFT matrix (issue 19, docs/stacks.md "Tested matrix"): each row a TRL trainer with JIT
(``slurm_jit.with_jit``) on 2 DeepSpeed CPU ranks (ZeRO-2, gloo, a tiny GPT-2 from a config, tiny in-memory
datasets), stopped by SIGTERM at a seeded random step (printed; replay with SLURM_JIT_MATRIX_SEED), resumed and
finished: every loss, every evaluation, the final weights (the trainable state: the adapters under LoRA), the best
checkpoint and metric, and the checkpoints rotation keeps are those of the uninterrupted run.

Rows: SFT with PEFT LoRA (SFT without it: tests/train/test_trl_sft_resume.py), DPO with an explicit reference
model, DPO with PEFT (the implicit reference: the adapters disabled), GRPO without vLLM (generation by sampling on
CPU, a tiny reward function). One reference run and one stopped+resumed pair per row (a module fixture).
"""

from __future__ import annotations

import pytest
from jit_helpers import assert_same_losses
from trl_rows import EXAMPLES, Row, RowRuns, checkpoints, evals, final_state, losses, run_row

from slurm_jit.checkpoint import protocol

pytest.importorskip("trl")
pytest.importorskip("peft")

pytestmark = pytest.mark.deepspeed

MAX_STEPS = 12
SAVE_STEPS = 5  # periodic saves and evaluations at 5 and 10: the stop falls between them (a stop at a periodic
# save's step is that save, not a JIT one); rotation and the best checkpoint cross it
COMMON = ["--max-steps", str(MAX_STEPS), "--zero-stage", "2", "--kill-wait", "0", "--step-sleep", "0.1",
          "--samples", "64", "--save-steps", str(SAVE_STEPS), "--save-total-limit", "2"]
EVALUATED = ["--eval-steps", str(SAVE_STEPS), "--eval-samples", "4", "--metric-for-best", "loss"]
STOP_AFTER = (6, 7)  # kill_wait 0: the stop lands at the next step boundary or so, before step 10
LORA = ["--lora", "--lora-rank", "4"]
# TRL's DPO disables dropout by default: a step then draws no random number and the RNG restore goes untested
DPO_DROPOUT = ["--keep-dropout"]

ROWS = {
    "sft-lora": Row(name="sft-lora", program=[str(EXAMPLES / "trl_sft.py"), "--jit-as", "with_jit"],
                    args=[*COMMON, *EVALUATED, "--dropout", "0.1", *LORA], max_steps=MAX_STEPS,
                    stop_after=STOP_AFTER, weights=protocol.WEIGHTS_FROZEN_EXCLUDED_MASTER_ONLY),
    "dpo-ref": Row(name="dpo-ref", program=[str(EXAMPLES / "trl_matrix.py"), "--row", "dpo", *DPO_DROPOUT],
                   args=[*COMMON, *EVALUATED], max_steps=MAX_STEPS, stop_after=STOP_AFTER),
    "dpo-peft": Row(name="dpo-peft", program=[str(EXAMPLES / "trl_matrix.py"), "--row", "dpo-peft", *DPO_DROPOUT],
                    args=[*COMMON, *EVALUATED, *LORA], max_steps=MAX_STEPS, stop_after=STOP_AFTER,
                    weights=protocol.WEIGHTS_FROZEN_EXCLUDED_MASTER_ONLY),
    # GRPO evaluates by generating: no evaluation here; its sampling draws from the RNG the resume restores
    "grpo": Row(name="grpo", program=[str(EXAMPLES / "trl_matrix.py"), "--row", "grpo"], args=COMMON,
                max_steps=MAX_STEPS, stop_after=STOP_AFTER),
}


@pytest.fixture(scope="module", params=list(ROWS))
def row_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> RowRuns:
    return run_row(ROWS[request.param], tmp_path_factory.mktemp(f"trl-{request.param}"))


def test_a_stopped_trl_run_resumes_bitwise(row_runs: RowRuns) -> None:
    """Every training loss, every evaluation, the final weights, best metric and best checkpoint equal the
    uninterrupted run's."""
    reference = losses(row_runs.reference)
    assert [s for s, _ in reference] == list(range(1, MAX_STEPS + 1))
    assert f"resuming from {row_runs.ckpt} " in row_runs.resumed.log, row_runs.resumed.log[-4000:]
    assert_same_losses(losses(row_runs.out), reference)
    assert evals(row_runs.out) == evals(row_runs.reference), "evaluations differ from the uninterrupted run's"
    final = final_state(row_runs.out)
    assert final == final_state(row_runs.reference)
    assert final["global_step"] == MAX_STEPS


def test_the_stop_lands_before_the_end_and_rotation_keeps_what_the_uninterrupted_run_kept(
        row_runs: RowRuns) -> None:
    """The JIT checkpoint is a step inside the run, and the checkpoints left at the end (save_total_limit 2, the
    best kept where an evaluation picks one) are the uninterrupted run's."""
    step = int(row_runs.ckpt.name.removeprefix("checkpoint-"))
    assert row_runs.stop_after <= step < MAX_STEPS, (row_runs.stop_after, step)
    assert checkpoints(row_runs.out) == checkpoints(row_runs.reference)
    assert len(checkpoints(row_runs.reference)) == 2, checkpoints(row_runs.reference)
