"""TensorBoard across requeues (issue 12), the part a DeepSpeed run cannot show cheaply: a job resumed from an
older checkpoint (after a crash) redoes steps; their old points must be dropped, not shown twice. transformers'
own TensorBoardCallback writes real event files; only the trainer around it is a stand-in (the real path, with
DeepSpeed ranks, a SIGTERM and a resume, is the GRPO row of tests/train/test_compat_matrix.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("tensorboard")

from jit_helpers import LOCK_BUSY, train_one_process  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from transformers.integrations.integration_utils import TensorBoardCallback  # noqa: E402

from slurm_jit.train import compat, output_lock, trackers  # noqa: E402


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



def _record(out: Path) -> Path:
    return out / "slurm-jit" / compat.TENSORBOARD_RECORD


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"log_dir": 7}', b"\xff\xfe", b'{"log_dir": ""}',
                                     b'{"log_dir": "TMP/elsewhere"}',
                                     b'{"log_dir": "runs/../../elsewhere"}',
                                     b"{" + b" " * 2**20 + b"}",  # 1 MiB
                                     b"[" * 60_000,  # under the cap; before: RecursionError out of train()
                                     b'{"log_dir": "runs/a\\u0000b"}',  # before: ValueError in SummaryWriter
                                     b'{"log_dir": "runs/a\\nb"}', b'{"log_dir": "."}',
                                     b'{"log_dir": "checkpoint-5/tb"}', b'{"log_dir": "slurm-jit"}',
                                     b'{"log_dir": "runs/' + b"x" * 300 + b'"}',  # before: ENAMETOOLONG
                                     # before: written into, then deleted whole by the next checkpoint rotation
                                     b'{"log_dir": ".slurm-jit-deleting-runs"}',
                                     b'{"log_dir": "run-1/checkpoint-5/tb"}',  # a search trial's checkpoint
                                     # before: a directory where the final save writes its file
                                     b'{"log_dir": "model.safetensors"}', b'{"log_dir": "runs/checkpoint-5"}'],
                         ids=["corrupt", "not-a-dict", "not-a-string", "not-utf8", "empty", "outside", "escapes",
                              "huge", "nested", "nul", "newline", "out-dir-itself", "into-a-checkpoint",
                              "into-slurm-jit", "name-too-long", "into-a-deletion", "into-a-trial-checkpoint",
                              "in-the-final-saves-way", "a-checkpoint-name-in-runs"])
def test_an_unusable_record_starts_a_new_run_with_one_warning_line(tmp_path: Path, content: bytes,
                                                                    caplog: pytest.LogCaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # a relative path taken as it is lands in tmp_path, not in the repo
    _record(out).parent.mkdir(parents=True)
    _record(out).write_bytes(content.replace(b"TMP", str(tmp_path).encode()))
    with caplog.at_level("WARNING", logger=compat.__name__):
        log_dir = _job(out, str(out / "checkpoint-5"), range(6, 8), offset=0.0)
    assert Path(log_dir).parent == out / "runs", log_dir  # a new run inside OUT_DIR, never /etc or ../elsewhere
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "HINT:" in warnings[0] and "\n" not in warnings[0], warnings
    assert _job(out, str(out / "checkpoint-7"), range(8, 9), offset=0.0) == log_dir  # the new record is good
    assert not (tmp_path / "elsewhere").exists()


def test_a_record_that_is_a_directory_or_a_dangling_link_is_not_a_traceback(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _record(out).mkdir(parents=True)  # os.replace cannot put the new record there: a warning, TensorBoard goes on
    assert Path(_job(out, str(out / "checkpoint-5"), range(6, 7), offset=0.0)).parent == out / "runs"
    _record(out).rmdir()
    _record(out).symlink_to(tmp_path / "gone.json")
    assert Path(_job(out, str(out / "checkpoint-6"), range(7, 8), offset=0.0)).parent == out / "runs"
    assert _record(out).is_file() and not _record(out).is_symlink()


@pytest.mark.timeout(30)  # before: a FIFO was waited on forever
@pytest.mark.parametrize("kind", ["record-fifo", "temporary-fifo", "temporary-link"])
def test_a_record_or_its_temporary_file_that_is_not_a_file_is_not_waited_on_nor_written_through(
        tmp_path: Path, kind: str) -> None:
    out = tmp_path / "out"
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    _record(out).parent.mkdir(parents=True)
    if kind == "record-fifo":
        os.mkfifo(_record(out))
    elif kind == "temporary-fifo":
        os.mkfifo(_record(out).with_suffix(".tmp"))
    else:
        _record(out).with_suffix(".tmp").symlink_to(precious)
    log_dir = _job(out, str(out / "checkpoint-5"), range(6, 7), offset=0.0)
    assert Path(log_dir).parent == out / "runs", log_dir
    assert _record(out).is_file() and precious.read_text() == "keep me"
    assert _job(out, str(out / "checkpoint-6"), range(7, 8), offset=0.0) == log_dir


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_record_linked_to_the_output_lock_keeps_the_lock_held(tmp_path: Path, link: str) -> None:
    # Before: reading the record opened and closed the lock file, and closing any descriptor of it drops this
    # process's POSIX lock: a second training could take the output_dir while this one trains.
    out = tmp_path / "out"
    lock, why = output_lock.acquire(out)
    assert lock is not None and lock.locked, why
    try:
        path = output_lock.lock_path(out)
        for record in (_record(out), path.parent / trackers.WANDB_RECORD):
            if link == "symbolic":
                record.symlink_to(path.name)
            else:
                os.link(path, record)
        assert Path(_job(out, str(out / "checkpoint-5"), range(6, 7), offset=0.0)).parent == out / "runs"
        assert trackers._read_record(path.parent / trackers.WANDB_RECORD) is None
        probe = subprocess.run([sys.executable, "-c", LOCK_BUSY, str(path)], capture_output=True, text=True,
                               timeout=60, check=True)
        assert probe.stdout.strip() == "busy", "a tracker record read dropped the output lock"
        assert json.loads(path.read_text())["pid"] == os.getpid()  # the lock's record is untouched
    finally:
        output_lock.release(lock)


def test_a_moved_output_dir_continues_its_own_run(tmp_path: Path) -> None:
    """The record names the run inside OUT_DIR, not by an absolute path: a copied or moved OUT_DIR (scratch to
    project space, another mount point on the next node) continues its run where it is now."""
    first = _job(tmp_path / "old", None, range(1, 6), offset=0.0)
    (tmp_path / "old").rename(tmp_path / "new")
    second = _job(tmp_path / "new", str(tmp_path / "new" / "checkpoint-5"), range(6, 8), offset=0.0)
    assert Path(second) == tmp_path / "new" / "runs" / Path(first).name
    assert not (tmp_path / "old").exists()


def test_a_fresh_train_after_a_resumed_one_in_the_same_process_purges_nothing(tmp_path: Path) -> None:
    callback = TensorBoardCallback()
    original = callback._SummaryWriter
    args = SimpleNamespace(output_dir=str(tmp_path / "out"), to_json_string=lambda: "{}")
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[callback]), args=args,
                              is_world_process_zero=lambda: True)
    compat.continue_tensorboard_run(trainer, None)
    compat.continue_tensorboard_run(trainer, str(tmp_path / "out" / "checkpoint-5"))
    compat.continue_tensorboard_run(trainer, None)  # a second training in the same process
    assert callback._SummaryWriter is original


# ---------------------------------------------------------------- how a job ended, in TensorBoard (issue 12)

def _texts(log_dir: str) -> list[tuple[int, str]]:
    events = EventAccumulator(log_dir)
    events.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode())
            for e in events.Tensors(f"{trackers.STOP_KEY}/text_summary")]


def test_tensorboard_says_a_jit_stop_is_a_stop_and_the_end_is_the_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    log_dir = _job(out, None, range(1, 5), offset=0.0)
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[_callback_at(log_dir)]),
                              is_world_process_zero=lambda: True)
    trackers.log_stop_to_trackers(trainer, "jit_stop", 4, "SIGTERM")
    assert _job(out, str(out / "checkpoint-4"), range(5, 7), offset=0.0) == log_dir
    trackers.log_stop_to_trackers(trainer, "finished", 6, None)
    texts = _texts(log_dir)
    assert texts == [(4, trackers.stop_text("jit_stop", 4, "SIGTERM")), (6, "finished at step 6")], texts
    assert "SIGTERM" in texts[0][1] and "not a crash" in texts[0][1]


def _callback_at(log_dir: str) -> TensorBoardCallback:
    callback = TensorBoardCallback()
    callback.logging_dir = log_dir
    return callback


def test_a_tracker_that_cannot_log_the_stop_is_one_warning_not_a_crash(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a-file").write_text("")
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[_callback_at(str(tmp_path / "a-file/x"))]),
                              is_world_process_zero=lambda: True)
    with caplog.at_level("WARNING", logger=trackers.__name__):
        trackers.log_stop_to_trackers(trainer, "jit_stop", 4, "SIGTERM")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "HINT:" in warnings[0] and "\n" not in warnings[0], warnings


def test_a_failure_after_the_stop_checkpoint_still_logs_the_jit_stop(tmp_path: Path) -> None:
    """One process, no DeepSpeed (~10 s): a SIGTERM, the JIT checkpoint complete, then a callback's on_train_end
    fails (a push, an upload). The stop record says jit_stop (error_after_stop: the requeue resumes); the trackers
    must say the same, not leave the job looking like a crash of the run."""
    import os
    import signal

    import transformers

    from slurm_jit import demo_train
    from slurm_jit.train import stop_record
    from slurm_jit.train.trainer import JitConfig, JitTrainer

    class TermAtStep2FailAtEnd(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            raise RuntimeError("upload failed")

    out = tmp_path / "out"
    targs = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=["tensorboard"],
                                           max_steps=6, save_steps=100, per_device_train_batch_size=2,
                                           disable_tqdm=True, logging_steps=1)
    trainer = JitTrainer(model=demo_train.build_model("gpt2", 16, 1), args=targs,
                         train_dataset=demo_train._Tokens(8, seed=1), callbacks=[TermAtStep2FailAtEnd()],
                         jit_config=JitConfig(kill_wait_s=0))
    with pytest.raises(RuntimeError, match="upload failed"):
        trainer.train()
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and "upload failed" in record["error_after_stop"]
    [run_dir] = (out / "runs").iterdir()
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    texts = [e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{trackers.STOP_KEY}/text_summary")]
    assert len(texts) == 1 and texts[0].startswith(f"stopped for a JIT checkpoint at step {record['step']} "), texts
    assert texts[0].endswith("after the checkpoint: RuntimeError: upload failed"), texts


def test_a_poisoned_record_on_a_real_resume_is_one_warning_and_a_new_run(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """One process, a real JitTrainer, no DeepSpeed (~15 s): a record of 60,000 nested brackets (under the size
    cap) killed rank 0 with RecursionError at the resume. The promise: one warning, a new run, the training goes
    on from its checkpoint."""
    out = tmp_path / "out"

    def train(max_steps: int, resume: bool) -> Any:
        return train_one_process(out, "tensorboard", max_steps, resume)

    train(2, resume=False)
    [first] = (out / "runs").iterdir()
    _record(out).write_bytes(b"[" * 60_000)
    # upstream names a new run runs/<%b%d_%H-%M-%S>_<host>: one started within the same second shares its directory
    time.sleep(1.1)
    with caplog.at_level("WARNING", logger=compat.__name__):
        trainer = train(4, resume=True)
    assert trainer.state.global_step == 4
    warnings = [r.getMessage() for r in caplog.records if r.name == compat.__name__ and r.levelname == "WARNING"]
    assert len(warnings) == 1 and "HINT:" in warnings[0] and "\n" not in warnings[0], warnings
    [second] = [run for run in (out / "runs").iterdir() if run != first]
    events = EventAccumulator(str(second))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [3, 4]
