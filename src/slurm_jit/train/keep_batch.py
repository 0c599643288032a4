"""Keep the global batch across a resume: the gradient accumulation that gives this run the checkpoint's samples
per optimizer step.

A requeued job runs the same command on whatever nodes it gets: per-device batch and accumulation stay as they were,
so on another world size the samples per optimizer step would change, and with them the data position (the Trainer
skips global_step x accumulation batches on resume) and the meaning of the LR schedule. So would they on the same
world size after a user changed the per-device batch (halved for an out-of-memory error) or the accumulation.
DeepSpeed's own elasticity keeps the global batch by choosing the accumulation; so does this, before the engine, the
dataloader and max_steps are computed (``JitTrainer.train`` applies it between the resume pick and upstream's
``train``).

The calculator (:func:`decide`) is pure; :func:`apply` sets the TrainingArguments and the DeepSpeed config on
every rank.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from slurm_jit.checkpoint import elastic_plan

MANIFEST_KEY = "kept_global_batch"  # in the manifest of every later save of a run that changed the accumulation
# In the manifest of every save: per-device batch x accumulation x world size of the run that wrote it (a run
# without DeepSpeed has no saved DeepSpeed config to tell it)
SAMPLES_KEY = elastic_plan.SAMPLES_KEY
# In the manifest of every save: the per-device batch of the run that wrote it (what :func:`epoch_warning` rebuilds
# that run's epoch with). A manifest of an older version lacks it: the trainer state's train_batch_size instead
PER_DEVICE_KEY = "per_device_batch"
TIMING_EVENT = "batch"  # the timing-log record of the change (rank 0, once per train())
# The mismatch transformers records at TrainingArguments creation for an explicit DeepSpeed train_batch_size that
# was the global batch on the old world size (HfTrainerDeepSpeedConfig.fill_match's wording)
TRAIN_BATCH_MISMATCH = "- ds train_batch_size={} "
ACCUMULATION_MISMATCH = "- ds gradient_accumulation_steps="  # one set in the DeepSpeed config, not in the args


@dataclass(frozen=True, kw_only=True)
class Kept:
    """A change of gradient accumulation that keeps the checkpoint's samples per optimizer step."""

    from_world_size: int  # the ranks that wrote the checkpoint
    to_world_size: int  # this run's
    accumulation_from: int  # this run's command's (TrainingArguments.gradient_accumulation_steps)
    accumulation_to: int  # what this run trains with
    samples_per_step: int  # the checkpoint's, kept
    per_device_from: int | None = None  # the checkpoint's per-device batch (None: it does not say)
    per_device_to: int = 0  # this run's

    def line(self) -> str:
        if self.from_world_size != self.to_world_size:
            what = f"world size {self.from_world_size} -> {self.to_world_size}"
        elif self.per_device_from not in (None, self.per_device_to):
            what = f"per-device batch {self.per_device_from} -> {self.per_device_to} on {self.to_world_size} ranks"
        else:
            what = f"the command's batch on {self.to_world_size} ranks"
        return (f"{what}: gradient accumulation {self.accumulation_from} -> {self.accumulation_to}, "
                f"{self.samples_per_step} samples per optimizer step kept")

    def record(self) -> dict[str, int]:
        return asdict(self)


def decide(*, written_batch: int, written_by: int, per_device: int, accumulation: int, world_size: int,
           keep: bool, where: str, written_per_device: int | None = None) -> tuple[Kept | None, str | None]:
    """(the change, None), (None, None) when none is needed, or (None, one line with a HINT) when no integer
    accumulation keeps ``written_batch`` samples per optimizer step with ``per_device`` on ``world_size`` ranks,
    or ``keep`` is False (JitConfig.keep_global_batch). On any world size, the checkpoint's own included.
    ``where``: the checkpoint, to name in the refusal; ``written_per_device``: its per-device batch, if known.
    Pure."""
    now = per_device * accumulation * world_size
    if now == written_batch:
        return None, None
    per_step = per_device * world_size
    if keep and written_batch % per_step == 0:
        return Kept(from_world_size=written_by, to_world_size=world_size, accumulation_from=accumulation,
                    accumulation_to=written_batch // per_step, samples_per_step=written_batch,
                    per_device_from=written_per_device, per_device_to=per_device), None
    return None, refusal(where, written_batch, now, world_size, keep)


def epoch_warning(kept: Kept, samples: int | None, drop_last: bool) -> str | None:
    """One line when the epoch's end differs between the checkpoint's run and this one, for a dataset of
    ``samples`` (None: no length, no epochs); None when every optimizer step is a full global batch on both. Pure.
    Accelerate deals a short epoch out per world size and per-device batch: it pads the ranks' last batches (or
    drops them, ``dataloader_drop_last``) and the Trainer ends the epoch on a short accumulation, so the last step
    of each epoch holds other samples; with drop_last the epoch may even have another number of optimizer steps
    (and num_train_epochs another max_steps). The checkpoint's epoch is rebuilt from its own per-device batch:
    where it is unknown (an older manifest and no trainer state saying it), the step counts are not compared."""
    if samples is None or samples % kept.samples_per_step == 0:
        return None
    before_on, after_on = _where(kept)
    written = _written_accumulation(kept)
    shape = (_per_device_to(kept), kept.to_world_size, kept.accumulation_to)
    if (kept.per_device_from, kept.from_world_size, written) == shape:  # the command's accumulation put back
        return None
    before = None if written is None else steps_per_epoch(samples, int(kept.per_device_from or 0),
                                                          kept.from_world_size, written, drop_last)
    after = steps_per_epoch(samples, _per_device_to(kept), kept.to_world_size, kept.accumulation_to, drop_last)
    head = (f"the dataset's {samples} samples are not a multiple of the {kept.samples_per_step} samples per "
            "optimizer step: ")
    if before is not None and before != after:
        what = (f"an epoch is {before} optimizer steps on {before_on} and {after} on {after_on} "
                "(dataloader_drop_last drops another remainder), so from the end of this epoch on the steps hold "
                "other samples than the uninterrupted run's (and num_train_epochs gives another max_steps)")
    else:
        unknown = "" if before is not None else (" (the checkpoint does not say its per-device batch: its epoch's "
                                                 "number of optimizer steps is not compared)")
        what = (f"the last optimizer step of each epoch holds other samples on {after_on} than on {before_on} "
                f"(accelerate pads the ranks' last batches, the accumulation ends short){unknown}, so the losses "
                "differ from the uninterrupted run's from the end of this epoch on")
    return (f"{head}{what}. HINT: a dataset length that is a multiple of {kept.samples_per_step} keeps every "
            "step's samples")


def _per_device_to(kept: Kept) -> int:
    """This run's per-device batch (a record of an older version lacks it: rebuilt from the kept numbers)."""
    return kept.per_device_to or kept.samples_per_step // (kept.accumulation_to * kept.to_world_size)


def _written_accumulation(kept: Kept) -> int | None:
    """The gradient accumulation of the checkpoint's run: its samples per step over its per-device batch x world
    size; None when the per-device batch is unknown or does not divide them (a record that is not consistent)."""
    per_step = (kept.per_device_from or 0) * kept.from_world_size
    if per_step <= 0 or kept.samples_per_step % per_step:
        return None
    return kept.samples_per_step // per_step


def _where(kept: Kept) -> tuple[str, str]:
    """How the warning names the two runs: by their ranks, and by their per-device batches on the same ranks."""
    if kept.from_world_size != kept.to_world_size or kept.per_device_from is None:
        return f"{kept.from_world_size} ranks", f"{kept.to_world_size} ranks"
    return (f"{kept.from_world_size} ranks at per-device batch {kept.per_device_from}",
            f"{kept.to_world_size} ranks at per-device batch {_per_device_to(kept)}")


def steps_per_epoch(samples: int, per_device: int, world_size: int, accumulation: int, drop_last: bool) -> int:
    """Optimizer steps in an epoch as the Trainer counts them (len(dataloader) per rank, even batches)."""
    batches = samples // per_device // world_size if drop_last else math.ceil(math.ceil(samples / per_device) /
                                                                              world_size)
    return max(math.ceil(batches / accumulation), 1)


def refusal(where: str, written_batch: int, now: int, world_size: int, keep: bool = False) -> str:
    """The one line for a resume whose samples per optimizer step would differ from the checkpoint's."""
    head = (f"{where}: {written_batch} samples per optimizer step when written, {now} in this run: the Trainer "
            "skips global_step batches on resume, so the data position (samples consumed) and the learning-rate "
            "schedule would not carry over.")
    if not keep:
        return (f"{head} HINT: keep per_device_train_batch_size x gradient_accumulation_steps x world size at "
                f"{written_batch}")
    hint = _hint(written_batch, world_size)
    return f"{head} No integer gradient accumulation keeps it on {world_size} ranks. HINT: {hint}"


def _hint(written_batch: int, world_size: int) -> str:
    if written_batch % world_size:
        return elastic_plan.no_batch_hint(written_batch, world_size)
    batches = ", ".join(str(n) for n in elastic_plan.divisors(written_batch // world_size))
    return f"per_device_train_batch_size {batches} on {world_size} ranks keeps it"


def apply(args: Any, hf_ds_configs: tuple[Any, ...], kept: Kept) -> None:
    """Every rank, before upstream's train(): ``args.gradient_accumulation_steps`` and each DeepSpeed config
    (transformers' HfTrainerDeepSpeedConfig: its "auto" values were filled when TrainingArguments was made) set
    consistently: gradient_accumulation_steps, and train_batch_size where it is given. An explicit
    train_batch_size equal to the kept global batch no longer counts as a mismatch (it was one on this world size
    with the command's accumulation); other mismatches (an accumulation in the DeepSpeed config that is not the
    TrainingArguments') stay, and transformers refuses them as it would without a resume."""
    args.gradient_accumulation_steps = kept.accumulation_to
    for hf_config in {id(c): c for c in hf_ds_configs if c is not None}.values():
        config = hf_config.config
        config["gradient_accumulation_steps"] = kept.accumulation_to
        if "train_batch_size" in config:
            config["train_batch_size"] = kept.samples_per_step
        stale = TRAIN_BATCH_MISMATCH.format(kept.samples_per_step)
        hf_config.mismatches = [m for m in getattr(hf_config, "mismatches", []) if not m.startswith(stale)]


def per_device_batch(trainer: Any) -> int:
    """The per-device batch this run trains with (auto_find_batch_size's found one)."""
    return int(getattr(trainer, "_train_batch_size", None) or trainer.args.per_device_train_batch_size)


def samples_per_step(trainer: Any) -> int:
    """This run's samples per optimizer step: its per-device batch x gradient accumulation x world size."""
    args = trainer.args
    return per_device_batch(trainer) * int(args.gradient_accumulation_steps) * int(args.world_size)


def refusal_at_construction(trainer: Any) -> str | None:
    """:func:`accumulation_refusal` of a DeepSpeed trainer's config; None without DeepSpeed."""
    if not trainer.is_deepspeed_enabled:
        return None
    return accumulation_refusal(trainer.accelerator.state.deepspeed_plugin.hf_ds_config)


def accumulation_refusal(hf_ds_config: Any) -> str | None:
    """One line when the DeepSpeed config sets a gradient accumulation that TrainingArguments does not (transformers
    records the mismatch when TrainingArguments is made and raises it as a ValueError at the engine's creation,
    after a resume has picked and converted): refused at construction instead. None without such a mismatch."""
    for mismatch in getattr(hf_ds_config, "mismatches", None) or []:
        if mismatch.startswith(ACCUMULATION_MISMATCH):
            return (f"the DeepSpeed config's gradient accumulation differs from TrainingArguments' ({mismatch[2:]}): "
                    "transformers refuses it when the engine is built. HINT: set \"gradient_accumulation_steps\": "
                    "\"auto\" in the DeepSpeed config and the value in TrainingArguments(gradient_accumulation_steps="
                    "...): the JitTrainer changes that one to keep the global batch on another world size")
    return None
