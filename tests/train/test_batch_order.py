"""The sampler's order and the batch on a resume (train/batch_order.py): transformers' group_by_length and
batch_rebalance samplers order an epoch by the batch, so a resume inside the epoch with another batch would read on in
another order than the samples consumed came from. Pure: the real LengthGroupedSampler, no trainer. The resume pick
and a real one-process run: test_keep_batch.py, test_user_batch.py."""

from __future__ import annotations

import torch
from transformers.trainer_pt_utils import LengthGroupedSampler

from slurm_jit.train import batch_order
from slurm_jit.train.batch_order import Shape

LENGTHS = [(i * 37) % 101 + 1 for i in range(400)]  # 400 samples of lengths 1-101


def _order(batch: int) -> list[int]:
    generator = torch.Generator().manual_seed(42)
    return list(LengthGroupedSampler(batch, lengths=LENGTHS, generator=generator))


def test_the_length_grouped_order_depends_on_the_batch_that_the_refusal_compares() -> None:
    """What the refusal guards against, on transformers' own sampler: 160 samples consumed at 8 a step (per-device
    x accumulation), then read on at 4: the next 160 hold samples already trained, others of the epoch are never
    read. With the same per-device batch x accumulation (2 x 4 for 8 x 1) the order is the same: not refused."""
    written, halved = _order(8), _order(4)
    consumed = set(written[:160])
    assert consumed & set(halved[160:320]) and set(range(400)) - consumed - set(halved[160:])
    assert _order(2 * 4) == written
    at = (20, 0, 160)
    before, after = Shape(per_device=8, accumulation=1, world_size=1), Shape(per_device=4, accumulation=1, world_size=1)
    line = batch_order.refusal("group_by_length", before, after, at, "ckpt-20")
    assert line is not None and "\n" not in line
    assert line.startswith("ckpt-20: train_sampling_strategy='group_by_length' orders each epoch by the batch "
                           "(per-device batch 8 x accumulation 1 on 1 ranks when written, per-device batch 4 x "
                           "accumulation 1 on 1 ranks in this run), so a resume 160 samples into epoch 0 would read on "
                           "in another order"), line
    assert line.endswith("HINT: resume with per_device_train_batch_size x gradient_accumulation_steps 8 as when "
                         "written (1 x 8, 2 x 4, 4 x 2, 8 x 1) on 1 ranks, or from a checkpoint at an epoch's start")
    same_product = Shape(per_device=4, accumulation=2, world_size=1)
    assert batch_order.refusal("group_by_length", before, same_product, at, "ckpt-20") is None


def test_an_epoch_start_or_a_sampler_that_ignores_the_batch_is_not_refused() -> None:
    """At an epoch's start the next order is new anyway; random and sequential do not depend on the batch; an
    unknown position may be inside an epoch: refused."""
    before, after = Shape(per_device=8, accumulation=1, world_size=1), Shape(per_device=4, accumulation=1, world_size=1)
    assert batch_order.refusal("group_by_length", before, after, (50, 1, 0), "c") is None
    for strategy in ("random", "sequential"):
        assert batch_order.refusal(strategy, before, after, (20, 0, 160), "c") is None
    unknown = batch_order.refusal("group_by_length", before, after, None, "c")
    assert unknown is not None and "a resume at a position it does not record" in unknown


def test_batch_rebalance_orders_by_the_world_size_too_so_a_kept_batch_is_refused() -> None:
    """The same command on 1 rank instead of 2 keeps 4 samples per step (accumulation 1 -> 2): batch_rebalance
    balances each global batch over the ranks and the accumulation, so its order differs; group_by_length's
    megabatch (2 x 1 -> 2 x 2 per rank) too."""
    written = batch_order.written_shape(4, 2, 2)
    assert written == Shape(per_device=2, accumulation=1, world_size=2)
    kept = Shape(per_device=2, accumulation=2, world_size=1)
    line = batch_order.refusal("batch_rebalance", written, kept, (6, 0, 24), "c")
    assert line is not None and line.endswith("HINT: resume with per_device_train_batch_size 2 and "
                                              "gradient_accumulation_steps 1 on 2 ranks, as when written, or from a "
                                              "checkpoint at an epoch's start"), line
    assert batch_order.refusal("group_by_length", written, kept, (6, 0, 24), "c") is not None
    assert batch_order.refusal("batch_rebalance", written, written, (6, 0, 24), "c") is None


def test_a_subclass_sampler_with_another_batch_is_one_warning() -> None:
    before, after = Shape(per_device=2, accumulation=1, world_size=1), Shape(per_device=1, accumulation=1, world_size=1)
    note = batch_order.own_sampler_warning("MyTrainer", before, after, (2, 0, 4))
    assert note is not None and note.startswith("MyTrainer._get_train_sampler is not transformers': if its order "
                                                "depends on the batch"), note
    assert "the resume (4 samples into epoch 0) reads on in another order" in note
    assert batch_order.own_sampler_warning("MyTrainer", before, before, (2, 0, 4)) is None
    assert batch_order.own_sampler_warning("MyTrainer", before, after, (2, 1, 0)) is None
