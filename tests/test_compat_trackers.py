"""TensorBoard across requeues (issue 12), the part a DeepSpeed run cannot show cheaply: a job resumed from an
older checkpoint (after a crash) redoes steps; their old points must be dropped, not shown twice. transformers'
own TensorBoardCallback writes real event files; only the trainer around it is a stand-in (the real path, with
DeepSpeed ranks, a SIGTERM and a resume, is the GRPO row of tests/test_compat_matrix.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from transformers.integrations.integration_utils import TensorBoardCallback  # noqa: E402

from slurm_jit.train import compat  # noqa: E402


def _job(out: Path, resume_from: str | None, steps: range, offset: float) -> str:
    """One job of rank 0: the callback as the Trainer makes it, continued by JitTrainer, writing ``steps``."""
    callback = TensorBoardCallback()
    args = SimpleNamespace(output_dir=str(out), to_json_string=lambda: "{}")
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[callback]), args=args,
                              is_world_process_zero=lambda: True)
    compat.continue_tensorboard_run(trainer, resume_from)  # JitTrainer.train(), before the Trainer's loop
    callback.on_train_begin(args, SimpleNamespace(is_world_process_zero=True, is_hyper_param_search=False), None)
    for step in steps:
        callback.tb_writer.add_scalar("train/loss", step + offset, step)
    callback.tb_writer.close()
    return str(callback.logging_dir)


def test_a_resumed_job_continues_the_run_and_redone_steps_replace_their_points(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = _job(out, None, range(1, 9), offset=0.0)  # crashed after step 8; the newest checkpoint is 5
    second = _job(out, str(out / "checkpoint-5"), range(6, 11), offset=0.5)
    assert second == first
    assert [p.name for p in (out / "runs").iterdir()] == [Path(first).name]
    events = EventAccumulator(first)
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert points == [(s, float(s)) for s in range(1, 6)] + [(s, s + 0.5) for s in range(6, 11)], points

