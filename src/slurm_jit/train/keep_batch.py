"""The batch on a resume: the gradient accumulation that keeps the checkpoint's samples per optimizer step where
the world size changed under the same command, and the user's own batch where they changed it.

A requeued job runs the same command on whatever nodes it gets: per-device batch and accumulation stay as they were,
so on another world size the samples per optimizer step would change, and with them the data position (the Trainer
skips global_step x accumulation batches on resume) and the meaning of the LR schedule. DeepSpeed's own elasticity
keeps the global batch by choosing the accumulation; so does this, before the engine, the dataloader and max_steps
are computed (``JitTrainer.train`` applies it between the resume pick and upstream's ``train``).

A per-device batch or accumulation that is not the checkpoint's command's is the user's change (halved for an
out-of-memory error, a batch ramped on purpose): trained with, as transformers does, with the data position kept in
samples consumed and the LR schedule at the checkpoint's step (:mod:`.data_position`). Refused only where it cannot
be exact: where the samples consumed in the epoch are not a whole number of the new optimizer steps (under
``ignore_data_skip`` nothing is skipped: never), or where the sampler orders the epoch by the batch
(:mod:`.batch_order`, asked by the resume pick).

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
# In the manifest of every save: the gradient accumulation of the command of the run that wrote it (before a kept
# change): a resume with another one is the user's change, not the requeue chain's. A manifest of an older version
# lacks it: its kept record's accumulation_from, else its samples per step over per-device batch x world size
COMMAND_KEY = "command_accumulation"
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
        else:  # a requeue of the same command after a kept change (2 -> 1 -> 1)
            what = f"the command's batch on {self.to_world_size} ranks"
        return (f"{what}: gradient accumulation {self.accumulation_from} -> {self.accumulation_to}, "
                f"{self.samples_per_step} samples per optimizer step kept")

    def record(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class UserBatch:
    """The user's change of the per-device batch or the accumulation: trained with, the data position kept."""

    per_device_from: int  # the checkpoint's
    per_device_to: int  # this run's
    accumulation_from: int  # the checkpoint's command's
    accumulation_to: int  # this run's
    from_world_size: int
    to_world_size: int
    samples_from: int  # samples per optimizer step: the checkpoint's
    samples_to: int  # this run's
    step: int | None  # the checkpoint's global step: where the LR schedule goes on (None: unknown)
    epoch: int | None  # the data position: epochs completed (None: unknown, only under ignore_data_skip)
    epoch_samples: int | None  # and samples consumed in the current one
    ignore_data_skip: bool = False  # TrainingArguments': nothing skipped, the position not kept (upstream's)

    def line(self) -> str:
        changed = ", ".join(f"{name} {a} -> {b}" for name, a, b in (
            ("per-device batch", self.per_device_from, self.per_device_to),
            ("gradient accumulation", self.accumulation_from, self.accumulation_to),
            ("world size", self.from_world_size, self.to_world_size)) if a != b)
        head = f"{changed}: your batch, {self.samples_from} -> {self.samples_to} samples per optimizer step; "
        schedule = "" if self.step is None else f", the schedule at step {self.step}"
        if self.ignore_data_skip:  # upstream's _init_training_state: epoch global_step // its steps, not skipped in
            return (f"{head}ignore_data_skip: the data position is not kept (the epoch upstream counts for the "
                    f"checkpoint's step at this batch starts from its first sample){schedule}")
        return f"{head}the data position kept ({self.epoch_samples} samples into epoch {self.epoch}){schedule}"

    def position(self) -> tuple[int, int, int] | None:
        """(step, epoch, samples consumed in it) it was decided on; None where unknown (under ignore_data_skip)."""
        if self.step is None or self.epoch is None or self.epoch_samples is None:
            return None
        return self.step, self.epoch, self.epoch_samples

    def record(self) -> dict[str, Any]:
        return asdict(self)


Decision = tuple[Kept | UserBatch | None, str | None]


def decide(*, written_batch: int, written_by: int, per_device: int, accumulation: int, world_size: int,
           keep: bool, where: str, written_per_device: int | None = None, command_accumulation: int | None = None,
           position: tuple[int, int, int] | None = None, ignore_data_skip: bool = False) -> Decision:
    """(the change, None), (None, None) when none is needed, or (None, one line with a HINT). Pure.

    The checkpoint's command (its per-device batch ``written_per_device`` and ``command_accumulation``, else the
    accumulation its samples per step give) run again, on any world size: the accumulation that keeps
    ``written_batch`` samples per optimizer step (:class:`Kept`), refused where no integer one does. Another
    per-device batch or accumulation: the user's (:class:`UserBatch`), refused where ``position`` (step, epoch,
    samples consumed in it) is not a whole number of this run's optimizer steps, or is unknown, unless
    ``ignore_data_skip`` (nothing is skipped: the position is not kept, as upstream). ``keep`` False
    (JitConfig.keep_global_batch): any change refused. A checkpoint that does not say its per-device batch cannot
    tell the user's change from the chain's: kept. ``where``: the checkpoint, to name in a refusal."""
    now = per_device * accumulation * world_size
    if now == written_batch:
        return None, None
    command = written_command(written_batch, written_by, written_per_device, command_accumulation)
    if command is not None and command != (per_device, accumulation):
        if not keep:
            return None, refusal(where, written_batch, now, world_size, keep)
        return user_batch(written_batch=written_batch, written_by=written_by, command=command,
                          per_device=per_device, accumulation=accumulation, world_size=world_size, where=where,
                          position=position, ignore_data_skip=ignore_data_skip)
    per_step = per_device * world_size
    if keep and written_batch % per_step == 0:
        return Kept(from_world_size=written_by, to_world_size=world_size, accumulation_from=accumulation,
                    accumulation_to=written_batch // per_step, samples_per_step=written_batch,
                    per_device_from=written_per_device, per_device_to=per_device), None
    return None, refusal(where, written_batch, now, world_size, keep)


def written_command(written_batch: int, written_by: int, written_per_device: int | None,
                    command_accumulation: int | None) -> tuple[int, int] | None:
    """The per-device batch and accumulation of the checkpoint's command; None where it does not say its
    per-device batch (an older manifest and no trainer state), or its numbers do not fit together."""
    if not written_per_device:
        return None
    if command_accumulation:
        return written_per_device, command_accumulation
    per_step = written_per_device * written_by
    if per_step <= 0 or written_batch % per_step:
        return None
    return written_per_device, written_batch // per_step


def user_batch(*, written_batch: int, written_by: int, command: tuple[int, int], per_device: int,
               accumulation: int, world_size: int, where: str, position: tuple[int, int, int] | None,
               ignore_data_skip: bool = False) -> Decision:
    """The user's batch, or why it cannot start exactly at the checkpoint's data position (under
    ``ignore_data_skip`` it does not start there: never refused for it)."""
    now = per_device * accumulation * world_size
    if position is None and not ignore_data_skip:
        return None, (f"{where}: does not say where in the data it is, so this run's {now} samples per optimizer "
                      f"step (the checkpoint's {written_batch}) cannot start there. HINT: resume with "
                      f"per_device_train_batch_size {command[0]} and gradient_accumulation_steps {command[1]}")
    step, epoch, samples = position if position is not None else (None, None, None)
    if samples is not None and samples % now and not ignore_data_skip:
        return None, (f"{where}: {samples} samples into epoch {epoch} when written, not a whole number of this run's "
                      f"{now} samples per optimizer step (per-device batch {per_device} x accumulation "
                      f"{accumulation} x {world_size} ranks), so no step of them starts there: the data position "
                      f"cannot be kept exactly. HINT: {_position_hint(samples, world_size, command, written_by)}")
    return UserBatch(per_device_from=command[0], per_device_to=per_device, accumulation_from=command[1],
                     accumulation_to=accumulation, from_world_size=written_by, to_world_size=world_size,
                     samples_from=written_batch, samples_to=now, step=step, epoch=epoch, epoch_samples=samples,
                     ignore_data_skip=ignore_data_skip), None


MAX_PRODUCTS_NAMED = 12  # a refusal names at most this many per-device batch x accumulation products


def _position_hint(samples: int, world_size: int, command: tuple[int, int], written_by: int) -> str:
    products = [d // world_size for d in elastic_plan.divisors(samples) if d % world_size == 0]
    back = (f"or resume with the checkpoint's per_device_train_batch_size {command[0]} and "
            f"gradient_accumulation_steps {command[1]} until a checkpoint at an epoch's start")
    if not products:
        return (f"no batch on {world_size} ranks divides {samples} samples: resume on a number of ranks that "
                f"divides {samples} ({written_by} did), {back}")
    named = ", ".join(str(n) for n in products[:MAX_PRODUCTS_NAMED])
    return f"per_device_train_batch_size x gradient_accumulation_steps {named} on {world_size} ranks, {back}"


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
    """How the warning names the two runs (a kept batch has the command's per-device batch on both)."""
    return f"{kept.from_world_size} ranks", f"{kept.to_world_size} ranks"


def steps_per_epoch(samples: int, per_device: int, world_size: int, accumulation: int, drop_last: bool) -> int:
    """Optimizer steps in an epoch as the Trainer counts them (len(dataloader) per rank, even batches)."""
    batches = samples // per_device // world_size if drop_last else math.ceil(math.ceil(samples / per_device) /
                                                                              world_size)
    return max(math.ceil(batches / accumulation), 1)


def refusal(where: str, written_batch: int, now: int, world_size: int, keep: bool = False) -> str:
    """The one line for a resume whose samples per optimizer step would differ from the checkpoint's: under
    JitConfig(keep_global_batch=False), or for the checkpoint's command on a world size no accumulation fits."""
    head = f"{where}: {written_batch} samples per optimizer step when written, {now} in this run"
    if not keep:
        return (f"{head}, and JitConfig(keep_global_batch=False) refuses a change of the global batch. HINT: keep "
                f"per_device_train_batch_size x gradient_accumulation_steps x world size at {written_batch}")
    return (f"{head}: the same command keeps the global batch (the data position and the LR schedule count its "
            f"steps), and no integer gradient accumulation keeps it on {world_size} ranks. HINT: "
            f"{_hint(written_batch, world_size)}")


def _hint(written_batch: int, world_size: int) -> str:
    if written_batch % world_size:
        return elastic_plan.no_batch_hint(written_batch, world_size)
    per_rank = written_batch // world_size
    pairs = ", ".join(f"{n} x {per_rank // n}" for n in elastic_plan.divisors(per_rank)[:MAX_PRODUCTS_NAMED])
    return f"per_device_train_batch_size x gradient_accumulation_steps {pairs} on {world_size} ranks keeps it"


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


def accumulation_of_command(args: Any, kept: dict[str, int] | None) -> int:
    """The gradient accumulation of this run's command: its args', or where a kept change set them (``kept``: the
    run's batch record, this run's change or the chain's) the command's before it."""
    return int(kept["accumulation_from"]) if kept else int(args.gradient_accumulation_steps)


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
