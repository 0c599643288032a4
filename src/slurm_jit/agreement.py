"""Rank agreement on "stop now", over a CPU (gloo) side group.

Every rank calls :meth:`StopAgreement.poll` at the same points (after each optimizer step, before each evaluation
batch), with its own local wish to stop. ``poll`` returns the all-reduced (MAX) answer of the round started at the
previous call and starts a new non-blocking round, so the collective overlaps the next step and costs about nothing
in steady state; all ranks read the same round, so they stop after the same step. Local signals only change the
values sent, never the sequence of collectives: every rank issues the same collectives in the same order.

A gloo side group keeps GPU runs free of an extra device synchronisation.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

SIDE_GROUP_TIMEOUT_S = 1800  # torch.distributed's default collective timeout


class StopAgreement:
    def __init__(self, timeout_s: float = SIDE_GROUP_TIMEOUT_S) -> None:
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.group: Any = None
        if self.distributed:
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._pending: tuple[Any, torch.Tensor] | None = None

    def _reduce(self, local: bool, async_op: bool) -> tuple[Any, torch.Tensor]:
        flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        work = None
        if self.distributed:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=async_op)
        return work, flag

    def _drain(self) -> bool:
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        return bool(flag.item())

    def poll(self, local: bool) -> bool:
        """The agreed answer of the previous round; starts the next round with ``local``."""
        agreed = self._drain()
        self._pending = self._reduce(local, async_op=True)
        return agreed

    def agree_now(self, local: bool) -> bool:
        """A blocking round (after the pending one, whose answer counts too)."""
        agreed = self._drain()
        _, flag = self._reduce(local, async_op=False)
        return agreed or bool(flag.item())

    def close(self) -> None:
        """Finish the round in flight, wait for every rank, and tear the side group down.

        A gloo group left to the interpreter's exit can abort the process ("terminate called without an active
        exception") when the peer rank has already exited.
        """
        self._drain()
        if self.distributed and self.group is not None:
            dist.barrier(group=self.group)
            dist.destroy_process_group(self.group)
            self.group = None
            self.distributed = False

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)
