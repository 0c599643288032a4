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
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

SIDE_GROUP_TIMEOUT_S = 1800  # torch.distributed's default collective timeout


NO_SIGNAL_MS = 2**62  # "no signal on this rank": never the minimum


@dataclass(frozen=True)
class Decision:
    """What all ranks agreed on in one round."""

    stop: bool  # some rank wants to stop
    wait_s: float = 0.0  # until kill_wait has passed since the earliest signal on any rank (0: it has)


@dataclass
class _Round:
    work: Any
    values: torch.Tensor
    sent_at: float


class StopAgreement:
    def __init__(self, timeout_s: float = SIDE_GROUP_TIMEOUT_S) -> None:
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.group: Any = None
        if self.distributed:
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._pending: _Round | None = None

    def _reduce(self, stop: bool, remaining_s: float | None, async_op: bool) -> _Round:
        # One MAX all-reduce carries both answers: max(stop) and, negated, min(remaining kill_wait).
        remaining_ms = NO_SIGNAL_MS if remaining_s is None else int(remaining_s * 1000)
        values = torch.tensor([1 if stop else 0, -remaining_ms], dtype=torch.int64)
        work = None
        if self.distributed:
            work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group, async_op=async_op)
        return _Round(work=work, values=values, sent_at=time.monotonic())

    @staticmethod
    def _read(round_: _Round) -> Decision:
        if round_.work is not None:
            round_.work.wait()
        stop, neg_remaining_ms = (int(v) for v in round_.values.tolist())
        if -neg_remaining_ms >= NO_SIGNAL_MS:
            return Decision(stop=bool(stop))
        remaining_s = -neg_remaining_ms / 1000 - (time.monotonic() - round_.sent_at)
        return Decision(stop=bool(stop), wait_s=max(0.0, remaining_s))

    def _drain(self) -> Decision:
        if self._pending is None:
            return Decision(stop=False)
        pending, self._pending = self._pending, None
        return self._read(pending)

    def poll(self, stop: bool, remaining_s: float | None = None) -> Decision:
        """The agreed answer of the previous round; starts the next round with this rank's wish.

        ``remaining_s``: how long until kill_wait has passed since this rank's first signal (None: no signal).
        """
        agreed = self._drain()
        self._pending = self._reduce(stop, remaining_s, async_op=True)
        return agreed

    def agree_now(self, stop: bool, remaining_s: float | None = None) -> Decision:
        """A blocking round (after the pending one, whose answer counts too)."""
        earlier = self._drain()
        now = self._read(self._reduce(stop, remaining_s, async_op=False))
        return Decision(stop=earlier.stop or now.stop, wait_s=now.wait_s)

    def close(self, wait_for_peers: bool = True) -> None:
        """Finish the round in flight, wait for every rank, and tear the side group down.

        A gloo group left to the interpreter's exit can abort the process ("terminate called without an active
        exception") when the peer rank has already exited. ``wait_for_peers=False`` (after a failure, when a
        peer may never come): drop the round in flight and tear the group down without a barrier.
        """
        if wait_for_peers:
            self._drain()
        self._pending = None
        if self.distributed and self.group is not None:
            if wait_for_peers:
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
