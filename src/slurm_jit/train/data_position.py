"""The data position across a resume, in samples consumed: where a run whose optimizer steps hold another number of
samples than the checkpoint's starts reading, and what every save records of it.

Upstream's Trainer resumes ``global_step`` optimizer steps of this run's size into the data
(``_init_training_state``: epoch ``global_step // steps per epoch``, then ``global_step % steps per epoch`` x
accumulation batches skipped). That is the checkpoint's position only while every step before it held this run's
samples per optimizer step. So every save records the position itself (:data:`POSITION_KEY`: the epoch, and the
samples consumed in it), and a resume starts there wherever upstream's count would put it elsewhere (the user's
batch, :class:`.keep_batch.UserBatch`, and every later resume of that chain): that epoch, samples / (per-device batch
x world size) batches skipped, the global step (the learning-rate schedule's) kept. Where the position is a whole
number of this run's steps (``decide`` refuses the rest) the skipped batches are exactly the samples consumed:
accelerate deals one seeded sampler's order out in per-device batches, rank after rank, on any batch and world size
(a sampler whose order depends on the batch, transformers' group_by_length: refused, :mod:`.batch_order`).

How long the run then trains: ``max_steps`` is the user's (the global step counts on to it); ``num_train_epochs``
trains what is left of the data at this run's batch (``max_steps`` becomes the checkpoint's step plus those steps).

:func:`resume_at` is pure; :func:`training_values` and :func:`started` are the JitTrainer's
``set_initial_training_values`` and ``_init_training_state``, :func:`manifest_fields` what a save records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from transformers.trainer_utils import has_length

from slurm_jit.train import keep_batch

POSITION_KEY = "data_position"  # in the manifest of every save: {"epoch": epochs done, "samples": consumed in the next}
# set_initial_training_values' tuple: (num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples,
# total_train_batch_size, steps_in_epoch, max_steps)
TrainingValues = tuple[int, int, int, int, int, int | None, int]


@dataclass(frozen=True, kw_only=True)
class Position:
    """Where in the data a checkpoint's step is."""

    step: int  # the global step: the optimizer steps taken, the LR schedule's
    epoch: int  # epochs completed
    samples: int  # samples consumed in the current epoch, every rank's

    def record(self) -> dict[str, int]:
        return {"epoch": self.epoch, "samples": self.samples}


@dataclass(frozen=True, kw_only=True)
class Resume:
    """Where a resume starts reading, in this run's optimizer steps, and the training loop's bounds with it."""

    epoch: int  # epochs_trained
    steps_in: int  # this run's optimizer steps into that epoch already consumed
    steps_per_epoch: int  # upstream's, but for a dataset without length: enough for max_steps
    num_train_epochs: int
    max_steps: int


@dataclass(frozen=True, kw_only=True)
class Origin:
    """Where this run's training loop started, in its own optimizer steps: every save's position follows from it."""

    step: int
    epoch: int
    steps_in: int  # optimizer steps into that epoch
    steps_per_epoch: int | None  # upstream's num_update_steps_per_epoch; None: a dataset without length (a stream)
    samples_per_step: int

    def at(self, step: int) -> Position:
        done = self.steps_in + step - self.step
        if self.steps_per_epoch is None:
            return Position(step=step, epoch=self.epoch, samples=done * self.samples_per_step)
        done += self.epoch * self.steps_per_epoch
        return Position(step=step, epoch=done // self.steps_per_epoch,
                        samples=done % self.steps_per_epoch * self.samples_per_step)


@dataclass
class Tracker:
    """One train()'s data position (``Run.data_position``): the checkpoint's, where this run resumes, where it is."""

    resumed: Position | None = None  # the checkpoint's, when it says or the user's batch needs it
    resume: Resume | None = None  # where upstream's count is not the position: set by training_values
    steps_per_epoch: int | None = None  # this run's (None: no length), from training_values
    samples_per_step: int = 0
    origin: Origin | None = None  # from started(): what the manifest's position is computed from


def resume_at(position: Position, *, samples_per_step: int, values: TrainingValues, has_length: bool,
              epoch_based: bool, epochs_arg: float) -> Resume | None:
    """Where to start reading ``position`` with ``samples_per_step``, given upstream's ``values``; None where
    upstream's count of position.step steps already starts there, or where the position is not a whole number of
    this run's steps (decide() refuses that for the user's batch). Pure."""
    num_train_epochs, per_epoch, _, _, _, _, max_steps = values
    if samples_per_step <= 0 or position.samples % samples_per_step:
        return None
    steps_in, epoch, step = position.samples // samples_per_step, position.epoch, position.step
    if not has_length:  # upstream: one pass of max_steps steps over the stream
        if (epoch, steps_in) == (step // per_epoch, step % per_epoch):
            return None
        return Resume(epoch=epoch, steps_in=steps_in, steps_per_epoch=max(per_epoch, steps_in + max_steps - step),
                      num_train_epochs=num_train_epochs, max_steps=max_steps)
    if steps_in >= per_epoch:  # this run's epoch holds fewer samples (dataloader_drop_last): that one is done
        epoch, steps_in = epoch + 1, 0
    done = epoch * per_epoch + steps_in
    if done == step:
        return None
    if epoch_based:  # what is left of num_train_epochs at this run's steps
        max_steps = step + max(math.ceil(epochs_arg * per_epoch) - done, 0)
    left = max_steps - step
    if left <= 0:  # nothing left to train: no epoch to run
        num_train_epochs = epoch
    elif not epoch_based:  # the epochs max_steps reaches into from here
        num_train_epochs = math.ceil((done + left) / per_epoch)
    return Resume(epoch=epoch, steps_in=steps_in, steps_per_epoch=per_epoch, num_train_epochs=num_train_epochs,
                  max_steps=max_steps)


def training_values(trainer: Any, tracker: Tracker | None, values: TrainingValues) -> TrainingValues:
    """Every rank, in upstream's train loop: upstream's ``values`` with the resume's bounds where the position is
    not upstream's count (ignore_data_skip: upstream's own); ``tracker`` is this train()'s (None outside one)."""
    if tracker is None:
        return values
    with_length = has_length(trainer.train_dataset)  # as upstream's dataloader over it
    args = trainer.args
    tracker.samples_per_step = keep_batch.samples_per_step(trainer)
    tracker.resume = None
    if tracker.resumed is not None and not args.ignore_data_skip:
        tracker.resume = resume_at(tracker.resumed, samples_per_step=tracker.samples_per_step, values=values,
                                   has_length=with_length, epoch_based=int(args.max_steps) <= 0,
                                   epochs_arg=float(args.num_train_epochs))
    resume = tracker.resume
    if resume is not None:
        _, _, examples, samples, total, in_epoch, _ = values
        if not with_length:  # upstream's batches per pass: max_steps x accumulation
            in_epoch = resume.steps_per_epoch * int(args.gradient_accumulation_steps)
        values = (resume.num_train_epochs, resume.steps_per_epoch, examples, samples, total, in_epoch,
                  resume.max_steps)
    tracker.steps_per_epoch = values[1] if with_length else None
    return values


def started(trainer: Any, tracker: Tracker | None, epochs_trained: int, batches_trained: int) -> tuple[int, int]:
    """Every rank, once the trainer state is loaded (a resume's: the checkpoint's step): where the loop starts
    (epochs trained, batches to skip in the first), the resume's where training_values set one; records it as this
    run's origin."""
    if tracker is None:
        return epochs_trained, batches_trained
    accumulation = int(trainer.args.gradient_accumulation_steps)
    step = int(trainer.state.global_step)
    resume = tracker.resume
    if resume is not None and tracker.resumed is not None and step == tracker.resumed.step:
        epochs_trained, batches_trained = resume.epoch, resume.steps_in * accumulation
    tracker.origin = Origin(step=step, epoch=epochs_trained, steps_in=batches_trained // accumulation,
                            steps_per_epoch=tracker.steps_per_epoch, samples_per_step=tracker.samples_per_step)
    return epochs_trained, batches_trained


def manifest_fields(tracker: Tracker | None, step: int) -> dict[str, Any]:
    """This save's data position at ``step``, for its manifest (none before this run's loop has started)."""
    origin = tracker.origin if tracker is not None else None
    return {} if origin is None else {POSITION_KEY: origin.at(step).record()}


def recorded(manifest: dict[str, Any]) -> Position | None:
    """The position a manifest records (None: an older version's, or not whole numbers)."""
    found, step = manifest.get(POSITION_KEY), _whole(manifest.get("step"))
    if not isinstance(found, dict) or step is None:
        return None
    epoch, samples = _whole(found.get("epoch")), _whole(found.get("samples"))
    return None if epoch is None or samples is None else Position(step=step, epoch=epoch, samples=samples)


def counted(manifest: dict[str, Any], trainer: Any, written_batch: int, written_by: int,
            written_per_device: int | None) -> Position | None:
    """A manifest's position, or (an older version's) upstream's count of its steps on the checkpoint's batch: its
    epochs' steps from this run's dataset length; None where the checkpoint's per-device batch is unknown."""
    found, step = recorded(manifest), _whole(manifest.get("step"))
    if found is not None or step is None or not written_per_device:
        return found
    per_step = written_per_device * written_by
    dataset = getattr(trainer, "train_dataset", None)
    if per_step <= 0 or written_batch % per_step or dataset is None:
        return None
    if not has_length(dataset):  # an IterableDataset: one stream, no epochs
        return Position(step=step, epoch=0, samples=step * written_batch)
    per_epoch = keep_batch.steps_per_epoch(len(dataset), written_per_device, written_by, written_batch // per_step,
                                           bool(trainer.args.dataloader_drop_last))
    return Position(step=step, epoch=step // per_epoch, samples=step % per_epoch * written_batch)


def _whole(value: Any) -> int | None:
    """``value`` when it is a whole number >= 0 (a manifest's), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def as_record(position: Position | None) -> dict[str, int] | None:
    """What the resume pick broadcasts to the ranks."""
    return None if position is None else {"step": position.step, **position.record()}


def from_record(record: dict[str, int] | None) -> Position | None:
    return None if record is None else Position(**record)
