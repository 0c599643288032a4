"""A complete checkpoint that a later save of the same step replaces is set aside as
``checkpoint-<step>.superseded-<seq>`` (not ``.incomplete``: it was complete); ckpt-check names it so, and neither
the resume pick nor rotation takes it. One real single-process JitTrainer run pair (~20 s) and crafted directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ckpt_factory

from slurm_jit.checkpoint import protocol


def _train(out: Path, max_steps: int, resume: str | None, save_total_limit: int | None = None) -> None:
    import transformers

    from slurm_jit import demo_train
    from slurm_jit.train.trainer import JitConfig, JitTrainer

    targs = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=max_steps,
                                           save_steps=2, per_device_train_batch_size=2, disable_tqdm=True,
                                           save_total_limit=save_total_limit)
    trainer = JitTrainer(model=demo_train.build_model("gpt2", 16, 1), args=targs,
                         train_dataset=demo_train._Tokens(8, seed=1), jit_config=JitConfig(kill_wait_s=0))
    trainer.train(resume_from_checkpoint=resume)


def test_a_resaved_step_sets_the_complete_one_aside_as_superseded_and_rotation_and_resume_skip_it(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    _train(out, max_steps=4, resume=None)  # checkpoint-2, checkpoint-4
    first = json.loads((out / "checkpoint-4" / protocol.MANIFEST_NAME).read_text())
    # A rollback: resume from step 2 and save step 4 again; rotation keeps one checkpoint
    _train(out, max_steps=4, resume=str(out / "checkpoint-2"), save_total_limit=1)
    aside = out / "checkpoint-4.superseded-1"
    assert aside.is_dir(), sorted(p.name for p in out.iterdir())
    assert not list(out.glob("checkpoint-4.incomplete*"))
    assert json.loads((aside / protocol.MANIFEST_NAME).read_text()) == first  # moved whole, not touched
    assert protocol.inspect(aside, 4, deep=True).status is protocol.Status.COMPLETE
    resolution = protocol.find_resumable(out)
    assert resolution.checkpoint is not None and resolution.checkpoint.path == out / "checkpoint-4"
    assert [c.path.name for c in resolution.checkpoints] == ["checkpoint-4"]  # rotation deleted checkpoint-2 only
    check = ckpt_factory.run_ckpt_check(out)
    assert check.code == 0 and check.last_line == str(out / "checkpoint-4").encode(), check
    assert "set aside checkpoint-4.superseded-1: a complete checkpoint replaced by a later save of step 4" \
        in check.stderr, check.stderr
    assert "ignored" not in check.stderr, check.stderr


def test_ckpt_check_reports_superseded_and_quarantined_directories_and_never_picks_them(tmp_path: Path) -> None:
    ckpt_factory.checkpoint(tmp_path, 2, created=1000.0)
    newer = ckpt_factory.checkpoint(tmp_path, 4, created=2000.0)
    superseded = protocol.set_aside_replaced(newer)
    assert superseded.name == "checkpoint-4.superseded-1"
    again = protocol.set_aside_replaced(ckpt_factory.checkpoint(tmp_path, 4, created=3000.0))
    assert again.name == "checkpoint-4.superseded-2"
    broken = ckpt_factory.checkpoint(tmp_path, 6, created=4000.0)
    (broken / protocol.SENTINEL_NAME).write_text("killed\n")
    assert protocol.set_aside_replaced(broken).name == "checkpoint-6.incomplete"
    check = ckpt_factory.run_ckpt_check(tmp_path, "--json")
    report = json.loads(check.stdout)
    assert report["resume_from"] == str(tmp_path / "checkpoint-2") and report["ignored"] == [], report
    assert [(a["name"], a["kind"]) for a in report["set_aside"]] == [
        ("checkpoint-4.superseded-1", "superseded"), ("checkpoint-4.superseded-2", "superseded"),
        ("checkpoint-6.incomplete", "incomplete")]
    assert protocol.rotation_victims(protocol.scan(tmp_path)[0], 1) == []  # one checkpoint-<step> only: kept


def test_a_step_set_aside_again_after_one_copy_was_deleted_takes_the_next_number_not_the_freed_one(
        tmp_path: Path) -> None:
    for created in (1000.0, 2000.0, 3000.0):
        protocol.set_aside_replaced(ckpt_factory.checkpoint(tmp_path, 4, created=created))
    shutil.rmtree(tmp_path / "checkpoint-4.superseded-1")  # a user freeing space by hand
    newest = protocol.set_aside_replaced(ckpt_factory.checkpoint(tmp_path, 4, created=4000.0))
    assert newest.name == "checkpoint-4.superseded-4"  # -1 would read as the oldest copy
    assert not (tmp_path / "checkpoint-4").exists()


def test_ckpt_check_lists_many_copies_of_one_step_in_the_order_they_were_set_aside(tmp_path: Path) -> None:
    for created in range(12):
        protocol.set_aside_replaced(ckpt_factory.checkpoint(tmp_path, 4, created=1000.0 + created))
    for _ in range(11):  # quarantined: .incomplete, .incomplete.1, ... .incomplete.10
        broken = ckpt_factory.checkpoint(tmp_path, 4)
        (broken / protocol.SENTINEL_NAME).write_text("killed\n")
        protocol.set_aside_replaced(broken)
    names = [a.name for a in protocol.set_aside(tmp_path)]
    assert names == ([f"checkpoint-4.superseded-{seq}" for seq in range(1, 13)]
                     + ["checkpoint-4.incomplete"] + [f"checkpoint-4.incomplete.{n}" for n in range(1, 11)]), names
    report = json.loads(ckpt_factory.run_ckpt_check(tmp_path, "--json").stdout)
    assert [a["name"] for a in report["set_aside"]] == names and report["resume_from"] is None, report
