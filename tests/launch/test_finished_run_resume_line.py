"""A run whose training finished (its stop record says ``finished``) is said to be finished where the launcher names
its resume point (issue #41 item 6): the plan of a resubmission, and ``status`` of the COMPLETED job; a run stopped
for a requeue keeps its plain resume line. Crafted checkpoints and records, real dry runs, the real status report."""

from __future__ import annotations

from pathlib import Path

import ckpt_factory
import plan_text
import pytest

from slurm_jit.launch import status, submit
from slurm_jit.train import stop_record

STEP = 2000


def _plan_resume(out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        submit.main(["--dry-run", "--output-dir", str(out), "--time", "30", "--signal-lead", "60", "--", "python",
                     "train.py"])
    err = capsys.readouterr().err
    assert exited.value.code == 0, err
    return plan_text.value(err, "resume:")


def _status_resume(out: Path) -> str:
    (line,) = [line for line in status.report(str(out), None) if line.startswith("resume:   ")]
    return line.removeprefix("resume:   ")


def test_a_finished_training_is_said_finished_by_the_plan_and_status(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    ckpt = ckpt_factory.checkpoint(out, STEP)
    stop_record.write(out, "finished", step=STEP, checkpoint=None)
    said = (f"training finished at step {STEP}: a new run resumes from {ckpt} and trains only if its command asks "
            "for more steps")
    assert _plan_resume(out, capsys) == said
    assert _status_resume(out) == said


def test_a_finished_training_whose_last_checkpoint_is_older_says_the_steps_run_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    ckpt = ckpt_factory.checkpoint(out, 1500)
    stop_record.write(out, "finished", step=STEP, checkpoint=None)
    assert _plan_resume(out, capsys) == (f"training finished at step {STEP}, past the newest resumable checkpoint: "
                                         f"a new run resumes from {ckpt} and trains steps 1501-{STEP} again")


def test_a_run_stopped_for_a_requeue_keeps_its_resume_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    ckpt = ckpt_factory.checkpoint(out, STEP)
    stop_record.write(out, "jit_stop", step=STEP, checkpoint=str(ckpt))
    assert _plan_resume(out, capsys) == f"resume from {ckpt}"
    assert _status_resume(out) == f"resume from {ckpt}"
