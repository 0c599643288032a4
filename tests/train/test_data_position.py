"""The data position in samples across a resume (train/data_position.py): the pure arithmetic of where a resume
starts reading and how long it trains, what a save records, and a manifest's position read back (recorded, or
counted as upstream counts an older one's steps). The real runs are in test_user_batch.py."""

from __future__ import annotations

from types import SimpleNamespace

from slurm_jit.train import data_position
from slurm_jit.train.data_position import Origin, Position, Resume

# set_initial_training_values' tuple for 32 samples, per-device batch 2 on 1 rank: 16 steps per epoch
MAX_STEPS_20 = (2, 16, 32, 40, 2, 16, 20)  # max_steps=20: 2 epochs
EPOCHS_2 = (2, 16, 32, 64, 2, 16, 32)  # num_train_epochs=2: max_steps 32


def test_a_position_that_upstream_counts_right_is_left_to_upstream() -> None:
    """2 samples per step all along: step 5 is 10 samples into epoch 0, step 17 is 2 into epoch 1."""
    for step, epoch, samples in ((5, 0, 10), (17, 1, 2), (0, 0, 0)):
        position = Position(step=step, epoch=epoch, samples=samples)
        assert data_position.resume_at(position, samples_per_step=2, values=MAX_STEPS_20, has_length=True,
                                       epoch_based=False, epochs_arg=3.0) is None


def test_a_halved_batch_reads_on_from_the_samples_consumed_to_the_users_max_steps() -> None:
    """Written at step 3 with 4 samples per step (12 consumed), resumed with 2: 6 of this run's steps into epoch 0
    (upstream would skip 3), the schedule at step 3, max_steps the user's 20: 17 steps left, into epoch 1."""
    resume = data_position.resume_at(Position(step=3, epoch=0, samples=12), samples_per_step=2,
                                     values=MAX_STEPS_20, has_length=True, epoch_based=False, epochs_arg=3.0)
    assert resume == Resume(epoch=0, steps_in=6, steps_per_epoch=16, num_train_epochs=2, max_steps=20)
    # max_steps 30: 27 steps left from 6 steps in reach step 33 of this run's count, into a third epoch
    resume = data_position.resume_at(Position(step=3, epoch=0, samples=12), samples_per_step=2,
                                     values=(2, 16, 32, 60, 2, 16, 30), has_length=True, epoch_based=False,
                                     epochs_arg=3.0)
    assert resume is not None and resume.num_train_epochs == 3 and resume.max_steps == 30


def test_num_train_epochs_trains_what_is_left_of_the_data_at_the_new_batch() -> None:
    """2 epochs of 32 samples; written at step 3 with 4 per step (12 consumed): 52 samples left, 26 steps of 2, so
    max_steps 3 + 26 = 29 (upstream's count: 32, four steps of data twice)."""
    resume = data_position.resume_at(Position(step=3, epoch=0, samples=12), samples_per_step=2, values=EPOCHS_2,
                                      has_length=True, epoch_based=True, epochs_arg=2.0)
    assert resume == Resume(epoch=0, steps_in=6, steps_per_epoch=16, num_train_epochs=2, max_steps=29)
    doubled = data_position.resume_at(Position(step=6, epoch=0, samples=12), samples_per_step=4,
                                      values=(2, 8, 32, 64, 4, 8, 16), has_length=True, epoch_based=True,
                                      epochs_arg=2.0)  # 2 -> 4 per step: 3 steps in, 13 left
    assert doubled == Resume(epoch=0, steps_in=3, steps_per_epoch=8, num_train_epochs=2, max_steps=19)


def test_an_epoch_that_ends_before_the_position_starts_the_next() -> None:
    """dataloader_drop_last with a bigger batch: this run's epoch holds 16 of the 32 samples (2 steps of 8), and 16
    were consumed: that epoch is done, the next starts at its beginning."""
    resume = data_position.resume_at(Position(step=8, epoch=0, samples=16), samples_per_step=8,
                                     values=(3, 2, 32, 48, 8, 2, 6), has_length=True, epoch_based=True,
                                     epochs_arg=3.0)
    assert resume is not None and (resume.epoch, resume.steps_in) == (1, 0)
    assert resume.max_steps == 8 + 3 * 2 - 2  # the two epochs left, 2 steps each


def test_nothing_left_runs_no_epoch() -> None:
    resume = data_position.resume_at(Position(step=10, epoch=0, samples=20), samples_per_step=1,
                                     values=(1, 32, 32, 10, 1, 32, 10), has_length=True, epoch_based=False,
                                     epochs_arg=3.0)
    assert resume is not None and resume.num_train_epochs == 0 and resume.max_steps == 10


def test_a_stream_without_length_reads_on_and_its_pass_covers_max_steps() -> None:
    """An IterableDataset: upstream runs one pass of max_steps steps (batches max_steps x accumulation); 12 samples
    consumed at step 3 are 6 steps of 2, and 17 steps remain: the pass must hold 6 + 17."""
    resume = data_position.resume_at(Position(step=3, epoch=0, samples=12), samples_per_step=2,
                                     values=(2**63 - 1, 20, 40, 40, 2, 20, 20), has_length=False, epoch_based=False,
                                     epochs_arg=3.0)
    assert resume is not None and (resume.epoch, resume.steps_in, resume.steps_per_epoch) == (0, 6, 23)
    assert data_position.resume_at(Position(step=3, epoch=0, samples=6), samples_per_step=2,
                                   values=(2**63 - 1, 20, 40, 40, 2, 20, 20), has_length=False, epoch_based=False,
                                   epochs_arg=3.0) is None


def test_a_position_that_is_not_a_whole_number_of_steps_is_not_moved() -> None:
    """decide() refuses it for the user's batch; resume_at itself leaves upstream's count (auto_find_batch_size's
    own halving, say)."""
    assert data_position.resume_at(Position(step=3, epoch=0, samples=12), samples_per_step=8, values=EPOCHS_2,
                                   has_length=True, epoch_based=True, epochs_arg=2.0) is None


def test_every_save_records_the_position_from_where_the_run_started() -> None:
    """16 steps of 2 samples per epoch. A fresh run: step 13 is 26 samples in, step 16 ends epoch 0. A run resumed
    at step 3 six of its steps into epoch 0 (the user's halved batch): step 13 is 16 steps in, epoch 0's end."""
    fresh = Origin(step=0, epoch=0, steps_in=0, steps_per_epoch=16, samples_per_step=2)
    resumed = Origin(step=3, epoch=0, steps_in=6, steps_per_epoch=16, samples_per_step=2)
    stream = Origin(step=3, epoch=0, steps_in=6, steps_per_epoch=None, samples_per_step=2)  # no epochs
    for step, at_fresh, at_resumed in ((6, (0, 12), (0, 18)), (13, (0, 26), (1, 0)), (16, (1, 0), (1, 6)),
                                       (17, (1, 2), (1, 8))):
        assert fresh.at(step) == Position(step=step, epoch=at_fresh[0], samples=at_fresh[1])
        assert resumed.at(step) == Position(step=step, epoch=at_resumed[0], samples=at_resumed[1])
        assert stream.at(step) == Position(step=step, epoch=0, samples=(6 + step - 3) * 2)
    assert resumed.at(13).record() == {"epoch": 1, "samples": 0}  # what the manifest holds


def test_a_manifest_position_is_read_back_or_counted_as_upstream_counts_it() -> None:
    recorded = {"step": 6, data_position.POSITION_KEY: {"epoch": 1, "samples": 8}}
    assert data_position.recorded(recorded) == Position(step=6, epoch=1, samples=8)
    for bad in ({"step": 6, data_position.POSITION_KEY: {"epoch": True, "samples": 8}},
                {"step": 6, data_position.POSITION_KEY: [1, 8]}, {data_position.POSITION_KEY: {"epoch": 1,
                                                                                               "samples": 8}}):
        assert data_position.recorded(bad) is None
    # an older manifest: 22 samples, 2 ranks x 2 per device x 1 = 4 per step, 6 steps per epoch (padded)
    trainer = SimpleNamespace(train_dataset=list(range(22)), args=SimpleNamespace(dataloader_drop_last=False))
    assert data_position.counted({"step": 8}, trainer, 4, 2, 2) == Position(step=8, epoch=1, samples=8)
    trainer.args.dataloader_drop_last = True  # 5 steps per epoch
    assert data_position.counted({"step": 8}, trainer, 4, 2, 2) == Position(step=8, epoch=1, samples=12)
    assert data_position.counted({"step": 8}, trainer, 4, 2, None) is None  # the per-device batch unknown
    assert data_position.counted(recorded, trainer, 4, 2, None) == Position(step=6, epoch=1, samples=8)
