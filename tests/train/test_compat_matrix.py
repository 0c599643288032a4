"""JitTrainer with users' subclasses and the Trainer's own features: a compatibility matrix (issue 12).

Every row, on real DeepSpeed ranks (ZeRO-2, 2 CPU ranks, tiny GPT-2 from a config): an uninterrupted run, then
the same run stopped by SIGTERM (to each rank's process group, as Slurm sends it) after a random step, resumed,
finished. Checked per row: both ranks exit 0; the stop wrote a JIT checkpoint that ckpt-check calls complete; no
step is lost or repeated; every step's loss (and every evaluation's) equals the uninterrupted run's, bitwise; so do
the best checkpoint and metric and the weights train() ends with (after load_best_model_at_end, the ones it
loaded); the finished run leaves a resumable checkpoint. Rows combine features so that the matrix costs 3 runs per row.

Every row here is deterministic, which is why all of them compare bitwise: the data order comes from seeded
samplers replayed by the resume, dropout and NEFTune noise from the RNG states the checkpoint restores,
DataLoader workers are seeded per rank and worker, and evaluation leaves the RNGs untouched. A row that is not
(a feature with unrestored randomness) must say so in its ``deterministic`` field and compare steps only.

The stop step is random: set SLURM_JIT_MATRIX_SEED to replay one (the chosen step is printed).
"""

from __future__ import annotations

import json
import os
import random
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from jit_helpers import (
    assert_same_losses,
    assert_stop_checkpoint,
    ckpt_check,
    losses,
    read_wandb_offline,
    run_and_signal,
    run_logged,
)

from slurm_jit import timing
from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record, trackers

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MAX_STEPS = 12
# First and last step after which the SIGTERM may be sent: the stop lands up to 2 steps later (the agreement
# round, and a step or two more where the test sees the loss line late on a loaded host), and a signal at the last
# step is not a stop (the run just finishes).
FIRST_STOP_STEP, LAST_STOP_STEP = 2, MAX_STEPS - 5
# Steps of ~0.1 s more: the test sees a step's loss line before the next few steps are done, even when loaded.
COMMON = ["--max-steps", str(MAX_STEPS), "--kill-wait", "0", "--step-sleep", "0.1"]


@dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    program: list[str] | None  # None: demo_train; else the example script and its own flags
    args: list[str]  # demo_train flags: the features this row switches on
    deterministic: str  # why the resumed losses equal the uninterrupted run's
    resume_by_path: bool = False  # train(resume_from_checkpoint=PATH) instead of True
    features: list[str] = field(default_factory=list)  # what the row covers, for the reader


ROWS = [
    Row(name="dpo_subclass+eval_on_start+best+neftune",
        program=[str(EXAMPLES / "dpo_style.py")],
        args=["--eval-steps", "3", "--metric-for-best", "loss", "--save-total-limit", "2",
              "--targ", "eval_on_start=true", "--targ", 'save_strategy="best"',
              "--targ", "load_best_model_at_end=true", "--targ", "neftune_noise_alpha=5"],
        deterministic="frozen reference in eval mode; policy dropout and NEFTune noise from the restored RNGs",
        features=["compute_loss() override + frozen reference model", "eval_on_start", 'save_strategy="best"',
                  "metric_for_best_model", "load_best_model_at_end", "save_total_limit", "neftune_noise_alpha",
                  "resume_from_checkpoint=True"]),
    Row(name="grpo_subclass+workers+save_only_model+resume_path",
        program=[str(EXAMPLES / "grpo_style.py"), "--steps-per-generation", "3"],
        args=["--workers", "2", "--targ", "dataloader_persistent_workers=true",
              "--targ", "dataloader_prefetch_factor=2", "--save-steps", "4", "--save-only-model",
              "--targ", 'logging_strategy="steps"', "--targ", 'report_to=["tensorboard", "wandb"]'],
        deterministic="the repeat sampler is seeded per epoch; the slice comes from the restored global_step",
        resume_by_path=True,
        features=["get_train_dataloader() override, batch x steps_per_generation", "dataloader_num_workers",
                  "dataloader_persistent_workers", "dataloader_prefetch_factor", "save_only_model",
                  "logging_strategy", "report_to=tensorboard+wandb (offline)", "resume_from_checkpoint=PATH"]),
    Row(name="loss_func+metrics+group_by_length",
        program=None,
        args=["--loss-func", "--metrics", "--eval-steps", "4", "--targ", "eval_accumulation_steps=2",
              "--targ", 'train_sampling_strategy="group_by_length"', "--save-steps", "3",
              "--save-total-limit", "1"],
        deterministic="LengthGroupedSampler draws from the seeded generator the resume replays",
        features=["compute_loss_func", "eval_accumulation_steps", "preprocess_logits_for_metrics",
                  "compute_metrics", 'train_sampling_strategy="group_by_length"', "save_total_limit=1"]),
    Row(name="async_periodic_saves+best+load_best",
        program=None,
        args=["--async-periodic-saves", "--eval-steps", "2", "--metric-for-best", "loss", "--save-total-limit", "2",
              "--targ", 'save_strategy="best"', "--targ", "load_best_model_at_end=true"],
        deterministic="plain training; the best checkpoints are written in the background",
        features=["JitConfig(async_periodic_saves=True)", 'save_strategy="best" (async)',
                  "load_best_model_at_end after an async save", "save_total_limit (rotation in the background)"]),
    Row(name="batch_rebalance",
        program=None,
        args=["--targ", 'train_sampling_strategy="batch_rebalance"', "--eval-steps", "5"],
        deterministic="BatchRebalanceSampler is seeded; its batches are replayed by the resume",
        features=['train_sampling_strategy="batch_rebalance"']),
]


def _evals(out: Path) -> list[dict[str, float]]:
    path = out / "evals-rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def _tensorboard_losses(out: Path) -> list[tuple[int, float]]:
    """The train/loss points of the run's one TensorBoard run directory (a requeue must not start another)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dirs = sorted(p for p in (out / "runs").iterdir() if p.is_dir())
    assert len(run_dirs) == 1, f"TensorBoard runs: {[p.name for p in run_dirs]}"
    events = EventAccumulator(str(run_dirs[0]))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


def _tensorboard_stop_texts(out: Path) -> list[tuple[int, str]]:
    """What the jobs wrote into TensorBoard about how each ended (step, text)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(p for p in (out / "runs").iterdir() if p.is_dir())))
    events.Reload()
    tag = f"{trackers.STOP_KEY}/text_summary"
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)]


def _wandb_env(out: Path) -> dict[str, str]:
    """W&B offline (no network, no account), each output directory its own WANDB_DIR."""
    wandb_dir = out.parent / f"wandb-{out.name}"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}


def _wandb_points(out: Path) -> tuple[set[str], list[tuple[int, float]]]:
    """The run ids and the (train/global_step, train/loss) points of every job that wrote into the run."""
    jobs = read_wandb_offline(out.parent / f"wandb-{out.name}" / "wandb")
    points = [(int(row["train/global_step"]), float(row["train/loss"]))  # type: ignore[arg-type]
              for job in jobs for row in job.history if "train/loss" in row]
    return {job.run_id for job in jobs}, points


def _assert_wandb_continued(out: Path, reference_out: Path, stop_step: int) -> None:
    """One run id (the one recorded), each step once in order with the uninterrupted run's values, and each job
    ending as what it was: the first preempted at the stop step (not crashed), the second finished."""
    ids, points = _wandb_points(out)
    assert ids == {json.loads((out / "slurm-jit" / trackers.WANDB_RECORD).read_text())["run_id"]}, ids
    assert points == _wandb_points(reference_out)[1], points
    stopped, finished = read_wandb_offline(out.parent / f"wandb-{out.name}" / "wandb")
    assert stopped.preempting and stopped.exit_code == 0, stopped
    assert (stopped.summary[trackers.STOP_KEY], stopped.summary[f"{trackers.STOP_KEY}_step"]) == ("jit_stop",
                                                                                                  stop_step)
    assert stopped.summary[f"{trackers.STOP_KEY}_signal"] == "SIGTERM"
    assert not finished.preempting and finished.summary[trackers.STOP_KEY] == "finished", finished.summary


def _whole_checkpoints(out: Path) -> set[str]:
    return {c.path.name for c in protocol.scan(out)[0] if c.status in protocol.WHOLE_STATUSES}


def _assert_best_kept_across_the_stop(out: Path, ckpt: Path) -> set[str]:
    """save_strategy="best" (and save_total_limit): the stopped job's rotation and end of training left the JIT
    checkpoint the next job resumes from, and the best checkpoint its trainer_state names, both whole."""
    best = json.loads((ckpt / "trainer_state.json").read_text())["best_model_checkpoint"]
    kept = _whole_checkpoints(out)
    assert ckpt.name in kept and (best is None or Path(best).name in kept), (kept, best)
    return kept


def _save_steps(args: list[str]) -> int | None:
    """The steps a periodic save can land on: --save-steps, or under save_strategy="best" the evaluation steps (a
    stop signalled during such a save takes it as the stop's checkpoint, train/stop_path.py)."""
    if "--save-steps" in args:
        return int(args[args.index("--save-steps") + 1])
    if 'save_strategy="best"' in args and "--eval-steps" in args:
        return int(args[args.index("--eval-steps") + 1])
    return None


def _final_state(out: Path) -> dict[str, object]:
    """What train() ended with (demo_train writes it): step, best checkpoint and metric, and a digest of the
    weights (after load_best_model_at_end: the ones it loaded)."""
    return dict(json.loads((out / "final-state.json").read_text()))


@pytest.mark.deepspeed
@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_stop_resume_matches_the_uninterrupted_run(row: Row, tmp_path: Path) -> None:
    args = [*COMMON, *row.args]
    reference_out = tmp_path / "reference"
    wandb = any("wandb" in arg for arg in row.args)
    reference = run_logged(reference_out, args, program=row.program, env=_wandb_env(reference_out) if wandb else None)
    assert reference.codes == [0, 0], reference.log[-4000:]
    assert [s for s, _ in losses(reference_out)] == list(range(1, MAX_STEPS + 1)), reference.log[-4000:]
    if "--async-periodic-saves" in row.args:  # its periodic saves went to the background (none fell back)
        events = [r["event"] for r in timing.read_records(reference_out)]
        assert "save_blocked" in events and "save_background" in events, events

    seed = int(os.environ.get("SLURM_JIT_MATRIX_SEED", random.randrange(2**31)))
    stop_after = random.Random(seed).randint(FIRST_STOP_STEP, LAST_STOP_STEP)
    print(f"{row.name}: SIGTERM after step {stop_after} (SLURM_JIT_MATRIX_SEED={seed})")
    out = tmp_path / "out"
    env = _wandb_env(out) if wandb else None
    stopped = run_and_signal(out, args, [(0, 0.0), (1, 0.0)], after_steps=stop_after, signum=signal.SIGTERM,
                             program=row.program, env=env)
    ckpt = assert_stop_checkpoint(out, stopped, save_steps=_save_steps(args))

    best = any('save_strategy="best"' in arg for arg in row.args)
    if best:
        _assert_best_kept_across_the_stop(out, ckpt)
    resume = ["--resume-from", str(ckpt)] if row.resume_by_path else ["--resume"]
    resumed = run_logged(out, [*args, *resume], program=row.program, env=env)
    assert resumed.codes == [0, 0], resumed.log[-4000:]
    assert f"resuming from {ckpt} " in resumed.log or row.resume_by_path, resumed.log[-4000:]
    assert_same_losses(losses(out), losses(reference_out))
    assert _evals(out) == _evals(reference_out), "evaluations differ from the uninterrupted run's"
    assert _final_state(out) == _final_state(reference_out)
    if best:  # the best checkpoint survived the restart: named by the resumed run and still whole
        assert _final_state(out)["best_model_checkpoint"] in _whole_checkpoints(out), _whole_checkpoints(out)
    if any("tensorboard" in arg for arg in row.args):  # one run, each step once, the uninterrupted run's values
        assert _tensorboard_losses(out) == _tensorboard_losses(reference_out)
        stop_step = int(ckpt.name.removeprefix("checkpoint-"))
        assert _tensorboard_stop_texts(out) == [(stop_step, trackers.stop_text("jit_stop", stop_step, "SIGTERM")),
                                                (MAX_STEPS, trackers.stop_text("finished", MAX_STEPS, None))]
    if wandb:
        _assert_wandb_continued(out, reference_out, int(ckpt.name.removeprefix("checkpoint-")))
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished", record
    check = ckpt_check(out)
    assert check.returncode == 0, check.stdout + check.stderr
