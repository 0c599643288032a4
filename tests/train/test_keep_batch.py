"""The batch on a resume (train/keep_batch.py): the pure calculator (the global batch kept for the checkpoint's
command, the user's own batch where they changed it), what it sets in a real TrainingArguments and transformers'
DeepSpeed config (no engine: cheap), what the resume pick gives it, and a per-device batch changed on the same 2
real DeepSpeed ranks (refused under keep_global_batch=False, else trained with). One-process runs of the user's
batch, with the samples each step held: test_user_batch.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jit_helpers
import pytest

from slurm_jit import timing
from slurm_jit.checkpoint import elastic_plan
from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.train import data_position, keep_batch, resume_path
from slurm_jit.train.jit_config import JitConfig
from slurm_jit.train.keep_batch import Kept


def _decide(written: int, written_by: int, per_device: int, accumulation: int, world: int,
            keep: bool = True, **known: Any) -> keep_batch.Decision:
    return keep_batch.decide(written_batch=written, written_by=written_by, per_device=per_device,
                             accumulation=accumulation, world_size=world, keep=keep, where="ckpt-33", **known)


def test_shrink_doubles_and_grow_halves_the_accumulation() -> None:
    kept, refusal = _decide(8, 2, per_device=2, accumulation=2, world=1)
    assert refusal is None and kept is not None and kept.accumulation_to == 4
    assert kept.line() == "world size 2 -> 1: gradient accumulation 2 -> 4, 8 samples per optimizer step kept"
    kept, refusal = _decide(8, 1, per_device=2, accumulation=4, world=2)
    assert refusal is None and kept is not None and kept.accumulation_to == 2
    assert kept.record() == {"from_world_size": 1, "to_world_size": 2, "accumulation_from": 4,
                             "accumulation_to": 2, "samples_per_step": 8, "per_device_from": None,
                             "per_device_to": 2}


def test_the_same_samples_per_step_need_no_change() -> None:
    assert _decide(8, 2, per_device=4, accumulation=2, world=1) == (None, None)
    assert _decide(8, 2, per_device=2, accumulation=2, world=2) == (None, None)


def test_a_world_size_that_divides_nothing_is_refused_naming_what_works() -> None:
    kept, refusal = _decide(8, 2, per_device=2, accumulation=2, world=3)
    assert kept is None and refusal is not None and "\n" not in refusal
    assert "8 samples per optimizer step when written, 12 in this run" in refusal
    assert "HINT: no per-device batch does on 3 ranks: resume on a number of ranks that divides 8 (1, 2, 4, 8)" \
        in refusal, refusal


def test_a_per_device_batch_that_divides_nothing_is_refused_naming_the_batches_that_work() -> None:
    kept, refusal = _decide(12, 2, per_device=4, accumulation=1, world=2)  # 12 = 4 x a x 2 has no integer a
    assert kept is None and refusal is not None
    assert refusal.endswith("HINT: per_device_train_batch_size x gradient_accumulation_steps 1 x 6, 2 x 3, 3 x 2, "
                            "6 x 1 on 2 ranks keeps it"), refusal
    kept, refusal = _decide(8, 2, per_device=4, accumulation=2, world=4)  # 4 x 4 = 16 > 8: no accumulation
    assert kept is None and refusal is not None
    assert "per_device_train_batch_size x gradient_accumulation_steps 1 x 2, 2 x 1 on 4 ranks" in refusal


def test_keep_global_batch_false_keeps_todays_refusal() -> None:
    kept, refusal = _decide(8, 2, per_device=2, accumulation=2, world=1, keep=False)
    assert kept is None and refusal is not None
    assert refusal.endswith("HINT: keep per_device_train_batch_size x gradient_accumulation_steps x world size at 8")


@pytest.mark.parametrize("explicit", [False, True])
def test_apply_sets_the_args_and_a_real_deepspeed_config_consistently(explicit: bool) -> None:
    """An "auto" DeepSpeed config (filled when TrainingArguments was made) and an explicit one written for the
    old world size: both end consistent, and transformers' own mismatch check passes."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": 8 if explicit else "auto", "zero_optimization": {"stage": 2}}
    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             report_to=[], use_cpu=True)
    hf_config = HfTrainerDeepSpeedConfig(config)
    hf_config.trainer_config_process(args)  # what TrainingArguments(deepspeed=...) does, on 1 rank
    assert bool(hf_config.mismatches) is explicit  # the explicit 8 was the old world size's
    kept, _ = _decide(8, 2, per_device=2, accumulation=2, world=1)
    assert kept is not None
    keep_batch.apply(args, (hf_config, hf_config, None), kept)
    assert args.gradient_accumulation_steps == 4
    assert hf_config.config["gradient_accumulation_steps"] == 4 and hf_config.config["train_batch_size"] == 8
    assert hf_config.mismatches == []
    again = HfTrainerDeepSpeedConfig(hf_config.config)  # transformers re-checks it (auto_find_batch_size)
    again.trainer_config_process(args)
    assert again.mismatches == []


def test_an_accumulation_set_in_the_deepspeed_config_only_is_refused_in_one_line() -> None:
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=2, report_to=[], use_cpu=True)
    hf_config = HfTrainerDeepSpeedConfig({"gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 2})
    hf_config.trainer_config_process(args)
    before = list(hf_config.mismatches)
    assert before and "gradient_accumulation_steps=2" in before[0]  # refused by transformers, resume or not
    kept, _ = _decide(4, 2, per_device=2, accumulation=1, world=1)
    assert kept is not None
    keep_batch.apply(args, (hf_config,), kept)
    assert hf_config.mismatches == before
    refusal = keep_batch.accumulation_refusal(hf_config)  # the JitTrainer says so at construction, in one line
    assert refusal is not None and "\n" not in refusal, refusal
    assert "ds gradient_accumulation_steps=2 vs hf gradient_accumulation_steps=1" in refusal, refusal
    assert 'HINT: set "gradient_accumulation_steps": "auto"' in refusal, refusal
    consistent = HfTrainerDeepSpeedConfig({"gradient_accumulation_steps": "auto"})
    consistent.trainer_config_process(args)
    assert keep_batch.accumulation_refusal(consistent) is None


SHRINK = Kept(from_world_size=2, to_world_size=1, accumulation_from=1, accumulation_to=2, samples_per_step=4,
              per_device_from=2, per_device_to=2)


def test_an_epoch_that_ends_on_a_full_global_batch_needs_no_warning() -> None:
    assert keep_batch.epoch_warning(SHRINK, 24, drop_last=False) is None
    assert keep_batch.epoch_warning(SHRINK, 24, drop_last=True) is None
    assert keep_batch.epoch_warning(SHRINK, None, drop_last=True) is None  # an IterableDataset: no epoch end


def test_a_short_epoch_end_is_one_warning_and_drop_last_names_the_other_epoch_length() -> None:
    """Measured on real ranks (22 samples, per-device batch 2, ZeRO-2, num_train_epochs=2, 2 ranks stopped at step
    5, resumed on 1): step 6, the epoch's last, was 3.7% off the uninterrupted run's loss (2 ranks pad it with the
    epoch's first samples, 1 rank ends on a short accumulation); with dataloader_drop_last the uninterrupted run
    had 5 steps per epoch (10 in all), the resumed one 6 (12 in all)."""
    padded = keep_batch.epoch_warning(SHRINK, 22, drop_last=False)
    assert padded is not None and "\n" not in padded
    assert "the last optimizer step of each epoch holds other samples on 1 ranks than on 2" in padded, padded
    assert padded.endswith("HINT: a dataset length that is a multiple of 4 keeps every step's samples"), padded
    dropped = keep_batch.epoch_warning(SHRINK, 22, drop_last=True)
    assert dropped is not None and "an epoch is 5 optimizer steps on 2 ranks and 6 on 1" in dropped, dropped
    grow = Kept(from_world_size=1, to_world_size=2, accumulation_from=2, accumulation_to=1, samples_per_step=4,
                per_device_from=2, per_device_to=2)
    assert "an epoch is 6 optimizer steps on 1 ranks and 5 on 2" in (keep_batch.epoch_warning(grow, 22, True) or "")


@pytest.mark.deepspeed
def test_a_manifest_without_the_samples_per_step_falls_back_to_the_saved_deepspeed_config(
        jit_zero2_run: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint of an older version (no samples_per_step in its manifest) still tells them under DeepSpeed,
    from the config the engine saved; without DeepSpeed it cannot, and says so in one warning."""
    from slurm_jit.checkpoint import manifest as manifest_file
    from slurm_jit.train import elastic

    ckpt = jit_zero2_run / "checkpoint-6"
    manifest, _ = manifest_file.read(ckpt)
    assert manifest is not None and manifest[keep_batch.SAMPLES_KEY] == 4  # 2 ranks x 2 samples x 1
    older = {key: value for key, value in manifest.items() if key != keep_batch.SAMPLES_KEY}
    assert elastic.written_global_batch(ckpt, older, 2) == 4
    assert elastic.written_global_batch(ckpt, {**older, "deepspeed_tag": None}, 2) is None  # as DDP's
    assert "says its samples per optimizer step: not checked" in caplog.text


def test_a_per_device_batch_changed_with_the_world_size_never_divides_by_zero() -> None:
    """Written on 4 ranks at per-device batch 1, resumed on 1 rank at 2, the checkpoint's per-device batch unknown
    (an older manifest): decide() keeps the 4 samples with accumulation 2. The epoch warning rebuilt the old run's
    accumulation from this run's per-device batch, 4 // (2 x 4) = 0, and divided by it (rank 0 only, in train()'s
    start, while the other ranks waited)."""
    kept, refusal = keep_batch.decide(written_batch=4, written_by=4, per_device=2, accumulation=1, world_size=1,
                                      keep=True, where="ckpt-9")
    assert refusal is None and isinstance(kept, Kept) and kept.accumulation_to == 2
    unknown = keep_batch.epoch_warning(kept, 22, drop_last=True)  # a checkpoint that does not say its batch
    assert unknown is not None and "\n" not in unknown, unknown
    assert "does not say its per-device batch: its epoch's number of optimizer steps is not compared" in unknown
    # A record that says both batches (one of an older version, which kept a changed per-device batch)
    both = Kept(from_world_size=4, to_world_size=1, accumulation_from=1, accumulation_to=2, samples_per_step=4,
                per_device_from=1, per_device_to=2)
    # 4 ranks x 1 (drop_last): 22 // 4 = 5 batches each, 5 steps; 1 rank x 2 x 2: 11 batches, 6 steps. The old
    # count from this run's batch (2 per device on 4 ranks) would have been 22 // 2 // 4 = 2 batches.
    dropped = keep_batch.epoch_warning(both, 22, drop_last=True)
    assert dropped is not None and "an epoch is 5 optimizer steps on 4 ranks and 6 on 1" in dropped, dropped


def test_the_users_batch_on_the_same_ranks_is_trained_with_and_said_in_one_line() -> None:
    """The checkpoint's command was per-device batch 2 x accumulation 1 on 2 ranks, 24 samples into epoch 0 at
    step 6. A halved per-device batch, or another accumulation, is the user's: trained with, the position kept
    (before: the accumulation was set to give the checkpoint's 4 samples per step again)."""
    known: dict[str, Any] = {"written_per_device": 2, "position": (6, 0, 24)}
    halved, refusal = _decide(4, 2, per_device=1, accumulation=1, world=2, **known)
    assert refusal is None and isinstance(halved, keep_batch.UserBatch), refusal
    assert (halved.samples_to, halved.accumulation_to, halved.step, halved.epoch_samples) == (2, 1, 6, 24)
    assert halved.line() == ("per-device batch 2 -> 1: your batch, 4 -> 2 samples per optimizer step; the data "
                             "position kept (24 samples into epoch 0), the schedule at step 6")
    more, refusal = _decide(4, 2, per_device=2, accumulation=3, world=2, **known)
    assert refusal is None and isinstance(more, keep_batch.UserBatch) and more.samples_to == 12
    assert more.line().startswith("gradient accumulation 1 -> 3: your batch, 4 -> 12 samples per optimizer step;")
    assert more.record()["accumulation_from"] == 1 and "\n" not in more.line()
    # the same batch in other factors needs nothing: 1 x 2 x 2 = 4
    assert _decide(4, 2, per_device=1, accumulation=2, world=2, **known) == (None, None)


def test_the_same_command_after_a_kept_change_is_kept_and_another_one_is_the_users() -> None:
    """2 -> 1 kept 4 samples with accumulation 2 (the command's 1); on 1 rank again the command's accumulation 1
    is the chain's, kept (its manifest's command_accumulation, else its kept record's accumulation_from), while 3
    is the user's."""
    chain: dict[str, Any] = {"written_per_device": 2, "command_accumulation": 1, "position": (6, 0, 24)}
    kept, refusal = _decide(4, 1, per_device=2, accumulation=1, world=1, **chain)
    assert refusal is None and isinstance(kept, Kept) and kept.accumulation_to == 2
    assert kept.line() == ("the command's batch on 1 ranks: gradient accumulation 1 -> 2, 4 samples per optimizer "
                           "step kept")
    theirs, refusal = _decide(4, 1, per_device=2, accumulation=3, world=1, **chain)
    assert refusal is None and isinstance(theirs, keep_batch.UserBatch) and theirs.accumulation_from == 1


def test_the_users_batch_that_cannot_start_at_the_position_is_refused_naming_what_can() -> None:
    """24 samples consumed at 4 per step; 16 per step (4 x 2 x 2) cannot start there: refused in one line, the HINT
    naming the per-device batch x accumulation products whose steps do (a divisor of 24 on 2 ranks)."""
    known: dict[str, Any] = {"written_per_device": 2, "position": (6, 0, 24)}
    kept, refusal = _decide(4, 2, per_device=4, accumulation=2, world=2, **known)
    assert kept is None and refusal is not None and "\n" not in refusal
    assert "24 samples into epoch 0 when written, not a whole number of this run's 16 samples per optimizer " \
        "step (per-device batch 4 x accumulation 2 x 2 ranks)" in refusal, refusal
    assert ("HINT: per_device_train_batch_size x gradient_accumulation_steps 1, 2, 3, 4, 6, 12 on 2 ranks, or "
            "resume with the checkpoint's per_device_train_batch_size 2 and gradient_accumulation_steps 1 until a "
            "checkpoint at an epoch's start") in refusal, refusal
    odd, refusal = _decide(4, 2, per_device=1, accumulation=1, world=5, written_per_device=2, position=(1, 0, 4))
    assert odd is None and refusal is not None
    assert "HINT: no batch on 5 ranks divides 4 samples: resume on a number of ranks that divides 4" in refusal
    unknown, refusal = _decide(4, 2, per_device=1, accumulation=1, world=2, written_per_device=2)
    assert unknown is None and refusal is not None and "does not say where in the data it is" in refusal
    assert refusal.endswith("HINT: resume with per_device_train_batch_size 2 and gradient_accumulation_steps 1")
    strict, refusal = _decide(4, 2, per_device=1, accumulation=1, world=2, keep=False, **known)
    assert strict is None and refusal is not None and "JitConfig(keep_global_batch=False) refuses" in refusal


def _picker(tmp_path: Path, per_device: int, keep: bool, state_batch: int | None = None,
            **args_more: Any) -> SimpleNamespace:
    """What resume_path.batch_to_keep reads of a JitTrainer (2 ranks, accumulation 1), with a checkpoint
    directory holding a trainer state whose train_batch_size is ``state_batch`` (none when None); ``args_more``:
    other TrainingArguments values."""
    if state_batch is not None:
        (tmp_path / "trainer_state.json").write_text(json.dumps({"train_batch_size": state_batch}))
    args = SimpleNamespace(**{"world_size": 2, "per_device_train_batch_size": per_device,
                              "gradient_accumulation_steps": 1, "auto_find_batch_size": False,
                              "dataloader_drop_last": False, "ignore_data_skip": False,
                              "train_sampling_strategy": "random", **args_more})
    return SimpleNamespace(args=args, jit_config=JitConfig(keep_global_batch=keep), train_dataset=list(range(64)))


def test_the_same_ranks_with_another_per_device_batch_are_refused_or_the_users(tmp_path: Path) -> None:
    """The resume pick on the same number of ranks: keep_global_batch=False refuses another batch; True trains with
    the user's, at the position the manifest records (an older one without it: counted as upstream counts its
    steps). The checkpoint's per-device batch comes from its manifest, else (an older one) from its trainer state;
    where neither says it, the user's change cannot be told from the chain's: the global batch is kept. An older
    manifest without samples_per_step is not checked on the same ranks, as before."""
    same = elastic_plan.Plan(action=elastic_plan.SAME, written_by=2, world_size=2, zero_stage=2, reason="")
    manifest = {"world_size": 2, "step": 6, keep_batch.SAMPLES_KEY: 4, keep_batch.PER_DEVICE_KEY: 2,
                keep_batch.COMMAND_KEY: 1, data_position.POSITION_KEY: {"epoch": 0, "samples": 24}}
    batch, refusal = resume_path.batch_to_keep(_picker(tmp_path, 1, keep=False), str(tmp_path), manifest, same)
    assert batch is None and refusal is not None and "\n" not in refusal
    assert "4 samples per optimizer step when written, 2 in this run" in refusal, refusal
    assert refusal.endswith("HINT: keep per_device_train_batch_size x gradient_accumulation_steps x world size at 4")
    batch, refusal = resume_path.batch_to_keep(_picker(tmp_path, 1, keep=True), str(tmp_path), manifest, same)
    assert refusal is None and isinstance(batch, keep_batch.UserBatch), refusal
    assert (batch.per_device_from, batch.samples_to, batch.epoch_samples) == (2, 2, 24)
    older = {"world_size": 2, "step": 6, keep_batch.SAMPLES_KEY: 4}  # no per_device_batch: the trainer state's
    batch, _ = resume_path.batch_to_keep(_picker(tmp_path, 1, keep=True, state_batch=2), str(tmp_path), older, same)
    assert isinstance(batch, keep_batch.UserBatch) and batch.per_device_from == 2 and batch.epoch_samples == 24
    (tmp_path / "trainer_state.json").unlink()
    batch, _ = resume_path.batch_to_keep(_picker(tmp_path, 1, keep=True), str(tmp_path), older, same)
    assert isinstance(batch, Kept) and batch.per_device_from is None and batch.accumulation_to == 2
    oldest = {"world_size": 2}
    assert resume_path.batch_to_keep(_picker(tmp_path, 1, keep=False), str(tmp_path), oldest, same) == (None, None)
    assert resume_path.batch_to_keep(_picker(tmp_path, 2, keep=False), str(tmp_path), manifest, same) == (None, None)


def test_under_ignore_data_skip_the_users_batch_is_never_refused_for_the_position_nor_said_to_keep_it() -> None:
    """ignore_data_skip: nothing is skipped (upstream starts the epoch it counts from its first sample), so a
    position that is not a whole number of the new steps, or one not known, is no reason to refuse, and the line
    does not say the position is kept. Before: refused (24 samples, 16 a step), or said "the data position kept"."""
    known: dict[str, Any] = {"written_per_device": 2, "position": (6, 0, 24), "ignore_data_skip": True}
    theirs, refusal = _decide(4, 2, per_device=4, accumulation=2, world=2, **known)
    assert refusal is None and isinstance(theirs, keep_batch.UserBatch), refusal
    assert theirs.line() == ("per-device batch 2 -> 4, gradient accumulation 1 -> 2: your batch, 4 -> 16 samples per "
                             "optimizer step; ignore_data_skip: the data position is not kept (the epoch upstream "
                             "counts for the checkpoint's step at this batch starts from its first sample), the "
                             "schedule at step 6")
    unknown, refusal = _decide(4, 2, per_device=1, accumulation=1, world=2, written_per_device=2,
                               ignore_data_skip=True)
    assert refusal is None and isinstance(unknown, keep_batch.UserBatch) and unknown.position() is None
    assert unknown.line().endswith("starts from its first sample)")
    assert keep_batch.UserBatch(**unknown.record()) == unknown


def test_a_sampler_that_orders_by_the_batch_refuses_another_batch_inside_the_epoch(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The resume pick under group_by_length: the user's halved per-device batch 24 samples into epoch 0 reads
    LengthGroupedSampler's order of 1 x 1 per rank, not the checkpoint's 2 x 1: refused in one line (before: trained,
    samples twice and others never). ignore_data_skip skips nothing: trained with. A subclass's own
    _get_train_sampler cannot be told: one warning, trained with."""
    same = elastic_plan.Plan(action=elastic_plan.SAME, written_by=2, world_size=2, zero_stage=2, reason="")
    manifest = {"world_size": 2, "step": 6, keep_batch.SAMPLES_KEY: 4, keep_batch.PER_DEVICE_KEY: 2,
                keep_batch.COMMAND_KEY: 1, data_position.POSITION_KEY: {"epoch": 0, "samples": 24}}
    grouped = _picker(tmp_path, 1, keep=True, train_sampling_strategy="group_by_length")
    batch, refusal = resume_path.batch_to_keep(grouped, str(tmp_path), manifest, same)
    assert batch is None and refusal is not None and "\n" not in refusal
    assert "train_sampling_strategy='group_by_length' orders each epoch by the batch" in refusal, refusal
    assert "HINT: resume with per_device_train_batch_size x gradient_accumulation_steps 2 as when written" in refusal
    skipping_nothing = _picker(tmp_path, 1, keep=True, train_sampling_strategy="group_by_length",
                               ignore_data_skip=True)
    batch, refusal = resume_path.batch_to_keep(skipping_nothing, str(tmp_path), manifest, same)
    assert refusal is None and isinstance(batch, keep_batch.UserBatch) and batch.ignore_data_skip

    class OwnSampler(SimpleNamespace):
        def _get_train_sampler(self, dataset: Any = None) -> Any:
            return None

    own = OwnSampler(**vars(grouped))
    with caplog.at_level("WARNING"):
        batch, refusal = resume_path.batch_to_keep(own, str(tmp_path), manifest, same)
    assert refusal is None and isinstance(batch, keep_batch.UserBatch)
    said = [r.getMessage() for r in caplog.records if "_get_train_sampler" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("slurm_jit: OwnSampler._get_train_sampler is not transformers'")


def test_an_older_checkpoint_that_does_not_record_its_batch_says_what_the_resume_skips(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A manifest without samples_per_step (an older version's) on the same ranks is not checked, as that version
    did not: one warning says the skip counts global_step steps of this run's batch (before: silent)."""
    same = elastic_plan.Plan(action=elastic_plan.SAME, written_by=2, world_size=2, zero_stage=2, reason="")
    with caplog.at_level("WARNING"):
        decided = resume_path.batch_to_keep(_picker(tmp_path, 1, keep=True), "ckpt-6", {"world_size": 2}, same)
    assert decided == (None, None)
    said = [r.getMessage() for r in caplog.records if r.name == resume_path.__name__]
    assert said == ["slurm_jit: ckpt-6: its manifest does not record its batch (an older version's), so the resume "
                    "skips its global_step optimizer steps at this run's 2 samples each, as upstream's Trainer does: "
                    "after a change of the batch that is another data position. HINT: resume with the checkpoint's "
                    "per_device_train_batch_size and gradient_accumulation_steps"], said


@pytest.mark.deepspeed
def test_a_halved_per_device_batch_on_the_same_two_ranks_is_refused_or_trained_with(jit_zero2_run: Path,
                                                                                       copy_run) -> None:
    """A requeue on the same 2 ranks after the user halved per_device_train_batch_size (an out-of-memory error):
    keep_global_batch=False refuses it on both ranks in one line before any step; the default trains with it (2
    samples per step, not the checkpoint's 4 put back by the accumulation), says so in one line, and every later
    manifest records the new batch and the data position in samples (24 at step 6, then 2 per step)."""
    manifest, _ = manifest_file.read(jit_zero2_run / "checkpoint-6")
    assert manifest is not None and manifest[keep_batch.PER_DEVICE_KEY] == 2, manifest
    assert manifest[data_position.POSITION_KEY] == {"epoch": 0, "samples": 24}, manifest
    out = copy_run(jit_zero2_run)
    refused = jit_helpers.run_logged(out, ["--max-steps", "8", "--resume", "--batch-size", "1",
                                           "--refuse-batch-change"])
    assert refused.codes == [2, 2], (refused.codes, refused.log[-4000:])
    assert ("4 samples per optimizer step when written, 2 in this run" in refused.log
            and "HINT: keep per_device_train_batch_size x gradient_accumulation_steps x world size at 4"
            in refused.log), refused.log[-4000:]
    assert "Traceback" not in refused.log and not (out / "checkpoint-8").exists()
    theirs = jit_helpers.run_logged(out, ["--max-steps", "8", "--save-steps", "8", "--resume", "--batch-size", "1"])
    assert theirs.codes == [0, 0], (theirs.codes, theirs.log[-4000:])
    assert theirs.log.count("slurm_jit: per-device batch 2 -> 1: your batch, 4 -> 2 samples per optimizer step; "
                            "the data position kept (24 samples into epoch 0), the schedule at step 6") == 1, \
        theirs.log[-4000:]
    manifest, _ = manifest_file.read(out / "checkpoint-8")
    assert manifest is not None and manifest[keep_batch.SAMPLES_KEY] == 2, manifest
    assert manifest[keep_batch.PER_DEVICE_KEY] == 1 and keep_batch.MANIFEST_KEY not in manifest
    assert manifest[keep_batch.COMMAND_KEY] == 1
    assert manifest[data_position.POSITION_KEY] == {"epoch": 0, "samples": 28}, manifest
    assert not [r for r in timing.read_records(out) if r["event"] == keep_batch.TIMING_EVENT]


def test_one_process_driving_two_gpus_resumes_its_own_batch_unchanged(tmp_path: Path) -> None:
    """One process over 2 GPUs (DataParallel, no launcher): transformers' train batch is per-device x n_gpu, and
    that is what the manifest records; the resume on the same setup compares like with like (it was refused under
    keep_global_batch=False, or given half the accumulation's worth of samples again, under True)."""
    same = elastic_plan.Plan(action=elastic_plan.SAME, written_by=1, world_size=1, zero_stage=0, reason="")
    manifest = {"world_size": 1, keep_batch.SAMPLES_KEY: 4, keep_batch.PER_DEVICE_KEY: 4}
    for keep in (False, True):
        trainer = _picker(tmp_path, 2, keep=keep)
        trainer.args.world_size, trainer._train_batch_size = 1, 4  # 2 per GPU x 2 GPUs
        assert resume_path.batch_to_keep(trainer, str(tmp_path), manifest, same) == (None, None)
