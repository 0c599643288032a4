"""W&B across requeues (issue 12), the parts a DeepSpeed run cannot show cheaply: a job resumed from an older
checkpoint (after a crash) redoes steps, whose points must not be logged twice; an unusable record; a run the
user chose. transformers' own WandbCallback writes a real offline run (WANDB_MODE=offline: no network, no
account); only the trainer around it is a stand-in. The real path (DeepSpeed ranks, SIGTERM, resume) is the GRPO
row of tests/train/test_compat_matrix.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("wandb")

from jit_helpers import read_wandb_offline, train_one_process  # noqa: E402
from transformers.integrations.integration_utils import WandbCallback  # noqa: E402

from slurm_jit.train import trackers  # noqa: E402


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """wandb offline into this test's directory; wandb's process-wide state (it reads the environment once) is
    torn down afterwards, so that the next test's environment counts."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv(trackers.RUN_ID_ENV, raising=False)
    wandb.teardown()
    yield tmp_path / "wandb"
    wandb.teardown()


def _trainer(out: Path, callback: WandbCallback) -> SimpleNamespace:
    return SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[callback]),
                           args=SimpleNamespace(output_dir=str(out), run_name=None), is_world_process_zero=lambda: True,
                           hp_search_backend=None)


def _job(out: Path, resume_from: str | None, steps: range, offset: float) -> None:
    """One job of rank 0: the callback as the Trainer makes it, inside JitTrainer.train()'s W&B context."""
    callback = WandbCallback()
    args = SimpleNamespace(to_dict=dict, run_name=None, output_dir=str(out))
    with trackers.continue_wandb_run(_trainer(out, callback), resume_from):
        for step in steps:
            state = SimpleNamespace(is_world_process_zero=True, global_step=step, trial_name=None, logging_steps=1)
            callback.on_log(args, state, None, model=None, logs={"loss": step + offset})
    callback._wandb.finish()


def test_a_resumed_job_continues_the_run_and_redone_steps_are_not_logged_twice(tmp_path: Path,
                                                                             offline: Path) -> None:
    out = tmp_path / "out"
    _job(out, None, range(1, 9), offset=0.0)  # crashed after step 8; the newest checkpoint is 5
    _job(out, str(out / "checkpoint-5"), range(6, 11), offset=0.5)
    jobs = read_wandb_offline(offline)
    assert len(jobs) == 2 and len({job.run_id for job in jobs}) == 1, [job.run_id for job in jobs]
    points = [(row["train/global_step"], row["train/loss"]) for job in jobs for row in job.history]
    assert points == [(s, float(s)) for s in range(1, 9)] + [(s, s + 0.5) for s in range(9, 11)], points


def test_a_fresh_start_begins_a_new_run(tmp_path: Path, offline: Path) -> None:
    out = tmp_path / "out"
    _job(out, None, range(1, 3), offset=0.0)
    _job(out, None, range(1, 3), offset=0.0)  # not resumed: the same OUT_DIR trains anew
    assert len({job.run_id for job in read_wandb_offline(offline)}) == 2  # (by WANDB_RUN_ID: 1, wandb reads it once)


def test_a_run_the_user_chose_is_left_alone(tmp_path: Path, offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(trackers.RUN_ID_ENV, "mine")
    _job(tmp_path / "out", None, range(1, 2), offset=0.0)
    assert [job.run_id for job in read_wandb_offline(offline)] == ["mine"]
    assert not (tmp_path / "out" / "slurm-jit" / trackers.WANDB_RECORD).exists()


@pytest.mark.parametrize("content", [b"{not json", b"[1]", b'{"run_id": 7}', b'{"run_id": "a/../b"}', b"\xff",
                                     b'{"run_id": "abc", "logged": {"loss": "x"}}',
                                     b"{" + b" " * trackers.WANDB_RECORD_MAX_BYTES + b"}",
                                     b"[" * 60_000 + b"]" * 60_000],  # before: RecursionError out of train()
                         ids=["corrupt", "not-a-dict", "not-a-string", "not-an-id", "not-utf8", "bad-steps", "huge",
                              "nested"])
def test_an_unusable_record_starts_a_new_run_with_one_warning_line(tmp_path: Path, content: bytes, offline: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    record = out / "slurm-jit" / trackers.WANDB_RECORD
    record.parent.mkdir(parents=True)
    record.write_bytes(content)
    callback = WandbCallback()
    with caplog.at_level("WARNING", logger=trackers.__name__), \
            trackers.continue_wandb_run(_trainer(out, callback), str(out / "checkpoint-5")):
        run_id = callback._wandb.run.id
    callback._wandb.finish()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "HINT:" in warnings[0] and "\n" not in warnings[0], warnings
    assert trackers.RUN_ID_PATTERN.fullmatch(run_id)
    assert trackers._read_record(record) == {"run_id": run_id, "logged": {}}  # the new run is recorded


def test_logs_at_the_same_step_of_one_job_are_all_kept(tmp_path: Path, offline: Path) -> None:
    """The Trainer logs several times at one step (train loss, then the evaluation, then train()'s end), each with
    ``epoch``; a callback may log a key twice. Only steps an earlier job logged are redone points, not these."""
    out = tmp_path / "out"
    callback = WandbCallback()
    args = SimpleNamespace(to_dict=dict, run_name=None, output_dir=str(out))
    state = SimpleNamespace(is_world_process_zero=True, global_step=2, trial_name=None, logging_steps=1)
    logs = [{"loss": 1.0, "epoch": 0.5}, {"eval_loss": 2.0, "epoch": 0.5}, {"mine": 1.0}, {"mine": 2.0}]
    with trackers.continue_wandb_run(_trainer(out, callback), None):
        for log in logs:
            callback.on_log(args, state, None, model=None, logs=log)
    callback._wandb.finish()
    [job] = read_wandb_offline(offline)
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in job.history]
    assert rows == [{"train/loss": 1.0, "train/epoch": 0.5, "train/global_step": 2},
                    {"eval/loss": 2.0, "train/epoch": 0.5, "train/global_step": 2},
                    {"train/mine": 1.0, "train/global_step": 2}, {"train/mine": 2.0, "train/global_step": 2}], rows


@pytest.mark.parametrize("env", ["WANDB_FORK_FROM", "WANDB_RESUME_FROM"])
def test_a_run_wandb_cannot_continue_leaves_the_run_to_upstream_with_one_warning_line(
        env: str, tmp_path: Path, offline: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The user forks a run (W&B's rewind): wandb refuses that with resume=, and transformers' own init (no id)
    takes it. Before: a multi-line pydantic ValidationError, and the training that upstream runs did not start."""
    monkeypatch.setenv(env, "abcd1234?_step=10")
    with caplog.at_level("WARNING", logger=trackers.__name__):
        _job(tmp_path / "out", str(tmp_path / "out" / "checkpoint-5"), range(1, 3), offset=0.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "HINT:" in warnings[0] and "\n" not in warnings[0], warnings
    [job] = read_wandb_offline(offline)
    assert [row["train/loss"] for row in job.history] == [1.0, 2.0]


def test_a_run_logging_many_keys_is_still_continued(tmp_path: Path, offline: Path) -> None:
    """Per-parameter metrics (a grad norm per LoRA matrix of an 80-layer model: 1120 keys): the record of their
    steps is ~100 KB. Before: the next job called its own record "not one we wrote" and started a new run."""
    out = tmp_path / "out"
    callback = WandbCallback()
    args = SimpleNamespace(to_dict=dict, run_name=None, output_dir=str(out))
    state = SimpleNamespace(is_world_process_zero=True, global_step=1, trial_name=None, logging_steps=1)
    parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
    logs = {f"grad_norm/base_model.model.model.layers.{layer}.{part}.lora_{ab}.default.weight": 1.0
            for layer in range(80) for ab in "AB" for part in parts}
    with trackers.continue_wandb_run(_trainer(out, callback), None):
        callback.on_log(args, state, None, model=None, logs=logs)
    callback._wandb.finish()
    _job(out, str(out / "checkpoint-1"), range(2, 3), offset=0.0)
    assert len({job.run_id for job in read_wandb_offline(offline)}) == 1


def test_an_unwritable_record_is_one_warning_line_and_the_run_goes_on(tmp_path: Path, offline: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    (out / "slurm-jit" / "wandb.tmp").mkdir(parents=True)  # every write of the record fails (as a full disk)
    with caplog.at_level("WARNING", logger=trackers.__name__):
        _job(out, None, range(1, 4), offset=0.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "HINT:" in warnings[0] and "\n" not in warnings[0], warnings
    [job] = read_wandb_offline(offline)
    assert [row["train/loss"] for row in job.history] == [1.0, 2.0, 3.0]


def test_a_poisoned_record_on_a_real_resume_is_one_warning_and_a_new_run(tmp_path: Path, offline: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """One process, a real JitTrainer, no DeepSpeed (~15 s): a record of 60,000 nested brackets (under the size
    cap) killed rank 0 with RecursionError at the resume. The promise: one warning, a new run, the training goes
    on from its checkpoint."""
    import wandb

    out = tmp_path / "out"

    def train(max_steps: int, resume: bool) -> Any:
        trainer = train_one_process(out, "wandb", max_steps, resume)
        wandb.finish()  # the job's end: the process exits (upstream's callback leaves the run open until then)
        return trainer

    train(2, resume=False)
    record = out / "slurm-jit" / trackers.WANDB_RECORD
    record.write_bytes(b"[" * 60_000 + b"]" * 60_000)
    with caplog.at_level("WARNING", logger=trackers.__name__):
        trainer = train(4, resume=True)
    assert trainer.state.global_step == 4
    warnings = [r.getMessage() for r in caplog.records if r.name == trackers.__name__ and r.levelname == "WARNING"]
    assert len(warnings) == 1 and "HINT:" in warnings[0] and "\n" not in warnings[0], warnings
    first, second = read_wandb_offline(offline)
    assert first.run_id != second.run_id and trackers._read_record(record)["run_id"] == second.run_id
    assert [row["train/global_step"] for row in second.history if "train/loss" in row] == [3, 4]
