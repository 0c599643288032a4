"""Whether the sampler's order of an epoch depends on the batch: a resume inside an epoch whose batch orders it
otherwise reads on in another order than the one the samples consumed came from (samples trained twice, others never).

The data position (:mod:`.data_position`) skips the samples consumed in the sampler's order; that is exact where the
order is the checkpoint's run's. transformers' ``Trainer._get_train_sampler`` (5.x) builds it from the batch for two
``train_sampling_strategy`` values: ``"group_by_length"``'s ``LengthGroupedSampler(train_batch_size x
gradient_accumulation_steps)`` sorts megabatches of 50 times that, and ``"batch_rebalance"``'s
``BatchRebalanceSampler`` balances each global batch over the ranks and the accumulation. ``"random"`` and
``"sequential"`` do not depend on it. A subclass's own ``_get_train_sampler`` cannot be told: one warning. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_jit.checkpoint import elastic_plan

GROUP_BY_LENGTH = "group_by_length"
BATCH_REBALANCE = "batch_rebalance"
MAX_PAIRS_NAMED = 12  # a refusal names at most this many per-device batch x accumulation pairs


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A run's batch, as transformers builds its sampler from it."""

    per_device: int  # train_batch_size (x n_gpu under one process's DataParallel)
    accumulation: int  # 0: unknown (a checkpoint whose numbers do not fit together)
    world_size: int

    def order_key(self, strategy: str) -> tuple[int, ...] | None:
        """What ``strategy``'s order depends on; None where it does not depend on the batch."""
        if strategy == GROUP_BY_LENGTH:
            return (self.per_device * self.accumulation,)
        if strategy == BATCH_REBALANCE:
            return self.per_device, self.accumulation, self.world_size
        return None

    def said(self) -> str:
        accumulation = self.accumulation or "?"
        return f"per-device batch {self.per_device} x accumulation {accumulation} on {self.world_size} ranks"


def written_shape(samples_per_step: int, world_size: int, per_device: int) -> Shape:
    """The checkpoint's run's shape from its samples per step, world size and per-device batch."""
    per_step = per_device * world_size
    accumulation = samples_per_step // per_step if per_step > 0 and samples_per_step % per_step == 0 else 0
    return Shape(per_device=per_device, accumulation=accumulation, world_size=world_size)


def inside_epoch(position: tuple[int, int, int] | None) -> bool:
    """Whether a resume at ``position`` (step, epoch, samples consumed in it) starts inside an epoch (unknown: it
    may). At an epoch's start the next epoch's order is a new one anyway: nothing is read twice."""
    return position is None or position[2] > 0


def refusal(strategy: str, written: Shape, now: Shape, position: tuple[int, int, int] | None,
            where: str) -> str | None:
    """One line with a HINT where ``strategy`` orders the epoch by the batch, the two shapes order it otherwise, and
    the resume starts inside it; else None."""
    key = written.order_key(strategy)
    if key is None or key == now.order_key(strategy) or not inside_epoch(position):
        return None
    at = "at a position it does not record" if position is None else \
        f"{position[2]} samples into epoch {position[1]}"
    if strategy == GROUP_BY_LENGTH and written.accumulation:
        product = key[0]
        pairs = ", ".join(f"{d} x {product // d}" for d in elastic_plan.divisors(product)[:MAX_PAIRS_NAMED])
        keep = (f"per_device_train_batch_size x gradient_accumulation_steps {product} as when written ({pairs}) on "
                f"{written.world_size} ranks")
    elif written.accumulation:
        keep = (f"per_device_train_batch_size {written.per_device} and gradient_accumulation_steps "
                f"{written.accumulation} on {written.world_size} ranks, as when written")
    else:
        keep = f"the checkpoint's batch on {written.world_size} ranks"
    return (f"{where}: train_sampling_strategy={strategy!r} orders each epoch by the batch ({written.said()} when "
            f"written, {now.said()} in this run), so a resume {at} would read on in another order: samples trained "
            f"twice, others never. HINT: resume with {keep}, or from a checkpoint at an epoch's start")


def own_sampler_warning(owner: str, written: Shape, now: Shape, position: tuple[int, int, int] | None) -> str | None:
    """One line where ``owner``'s own ``_get_train_sampler`` may order the epoch by the batch, the batch changed and
    the resume starts inside the epoch; else None."""
    if written == now or not inside_epoch(position):
        return None
    at = "" if position is None else f" ({position[2]} samples into epoch {position[1]})"
    return (f"{owner}._get_train_sampler is not transformers': if its order depends on the batch ({written.said()} "
            f"when written, {now.said()} in this run), the resume{at} reads on in another order, samples trained "
            "twice and others never. HINT: resume with the checkpoint's batch, or from a checkpoint at an epoch's "
            "start")
