"""TRL's SFTTrainer with JIT checkpoints on 2 DeepSpeed CPU ranks (ZeRO-2), made each of the three documented ways
(issue 19): the uninterrupted reference run is ``class MySFTTrainer(JitTrainer, SFTTrainer)``, the run stopped by
SIGTERM is ``slurm_jit.with_jit(SFTTrainer)``, and its resume is the drop-in (``transformers.Trainer =
JitTrainer`` before TRL is imported). One training: the stopped and resumed run is bitwise the reference.

One reference and one stopped+resumed pair in all (examples/trl_sft.py: a tiny GPT-2 with dropout from a config,
an in-memory text dataset TRL tokenizes, an evaluation every EVAL_STEPS), checked several ways below.
"""

from __future__ import annotations

import json
import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from jit_helpers import RunResult, assert_jit_stop, assert_same_losses, logged, losses, run_and_signal, run_logged

from slurm_jit.checkpoint import protocol

pytest.importorskip("trl")

pytestmark = pytest.mark.deepspeed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_sft.py"
MAX_STEPS = 30
EVAL_STEPS = 5
ARGS = ["--max-steps", str(MAX_STEPS), "--eval-steps", str(EVAL_STEPS), "--eval-samples", "4", "--dropout", "0.1",
        "--zero-stage", "2", "--kill-wait", "1", "--step-sleep", "0.05"]
# After the first evaluation; the stop lands kill_wait (1 s, ~11 steps idle) later, well before the end.
FIRST_STOP_STEP, LAST_STOP_STEP = 6, 14


@dataclass
class Runs:
    reference: Path
    out: Path
    ckpt: Path
    model_card_at_stop: str | None  # OUT/README.md right after the stop (TRL's _save_checkpoint writes it)
    resumed: RunResult


def _program(jit_as: str) -> list[str]:
    return [str(EXAMPLE), "--jit-as", jit_as]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("trl-sft")
    reference = root / "reference"
    ran = run_logged(reference, ARGS, program=_program("subclass"))
    assert ran.codes == [0, 0], ran.log[-4000:]
    seed = int(os.environ.get("SLURM_JIT_MATRIX_SEED", random.randrange(2**31)))
    stop_after = random.Random(seed).randint(FIRST_STOP_STEP, LAST_STOP_STEP)
    print(f"trl sft: SIGTERM after step {stop_after} (SLURM_JIT_MATRIX_SEED={seed})")
    out = root / "out"
    stopped = run_and_signal(out, ARGS, [(0, 0.0), (1, 0.0)], after_steps=stop_after, signum=signal.SIGTERM,
                             program=_program("with_jit"))
    ckpt = assert_jit_stop(out, stopped)
    card = out / "README.md"
    model_card = card.read_text() if card.is_file() else None
    resumed = run_logged(out, [*ARGS, "--resume"], program=_program("drop-in"))
    assert resumed.codes == [0, 0], resumed.log[-4000:]
    return Runs(reference=reference, out=out, ckpt=ckpt, model_card_at_stop=model_card, resumed=resumed)


def _evals(out: Path) -> list[dict[str, float]]:
    path = out / "evals-rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def test_a_stopped_sft_run_resumes_bitwise_whichever_way_jit_was_added(runs: Runs) -> None:
    """Every training loss, every evaluation and the final weights equal the uninterrupted run's."""
    assert [s for s, _ in losses(runs.reference)] == list(range(1, MAX_STEPS + 1))
    assert f"resuming from {runs.ckpt} " in runs.resumed.log, runs.resumed.log[-4000:]
    assert_same_losses(losses(runs.out), losses(runs.reference))
    evals = _evals(runs.reference)
    assert [e["step"] for e in evals] == list(range(EVAL_STEPS, MAX_STEPS + 1, EVAL_STEPS)), evals  # last: the end
    assert _evals(runs.out) == evals, "evaluations differ from the uninterrupted run's"
    final = json.loads((runs.out / "final-state.json").read_text())
    assert final == json.loads((runs.reference / "final-state.json").read_text())
    assert final["global_step"] == MAX_STEPS


def test_every_value_trl_logs_equals_the_uninterrupted_runs(runs: Runs) -> None:
    """TRL's own logged metrics too (entropy, mean_token_accuracy, num_tokens: SFTTrainer counts the tokens since
    its start in _total_train_tokens, which a resume started again from 0), and the final train_loss over the
    whole chain: the checkpoint keeps TRL's logging window (train/logging_window.py)."""
    expected = logged(runs.reference)
    assert any("num_tokens" in e for e in expected) and "train_loss" in expected[-1], expected[-3:]
    assert logged(runs.out) == expected


def test_the_stop_left_a_complete_slim_jit_checkpoint_between_the_evaluations(runs: Runs) -> None:
    """assert_jit_stop (in the fixture) ran ckpt-check --deep on it; here: where it landed."""
    step = int(runs.ckpt.name.removeprefix("checkpoint-"))
    assert FIRST_STOP_STEP <= step < MAX_STEPS, step
    manifest = json.loads((runs.ckpt / protocol.MANIFEST_NAME).read_text())
    assert manifest["kind"] == "jit" and manifest["zero_stage"] == 2 and manifest["world_size"] == 2, manifest


def test_trls_own_save_checkpoint_addition_runs_inside_the_jit_save(runs: Runs) -> None:
    """TRL's SFTTrainer._save_checkpoint writes the model card (OUT/README.md) and hands on to super(): under
    JitTrainer (first in the MRO) it ran inside the JIT save, which is the only save before the stop."""
    assert runs.model_card_at_stop is not None, "no model card: TRL's _save_checkpoint did not run"
    assert "sft" in runs.model_card_at_stop.lower(), runs.model_card_at_stop[:500]


def test_the_drop_in_resume_warns_once_about_the_hook_trl_replaces(runs: Runs) -> None:
    """Under the drop-in TRL's prediction_step (no super()) sits above JitTrainer's: said in one warning per rank
    at construction, with what it costs; with_jit and the written-out subclass keep both and say nothing."""
    warning = "SFTTrainer.prediction_step() replaces JitTrainer.prediction_step() (no super())"
    assert runs.resumed.log.count(warning) == 2, runs.resumed.log[-4000:]
    logs = runs.out.parent / f"logs-{runs.out.name}"
    before_resume = "".join((logs / f"rank{r}.log").read_text(errors="replace") for r in range(2))
    assert before_resume.count(warning) == 2  # the resume's two only: the with_jit run said nothing
