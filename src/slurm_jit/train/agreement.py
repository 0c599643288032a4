"""Rank agreement on "stop now", over a CPU (gloo) side group.

Every rank calls :meth:`StopAgreement.at_boundary` after each optimizer step (and :meth:`poll` before each
evaluation batch) with its own local wish to stop; one all-reduce (MAX) per call carries every rank's wish. Two
ways to read it, the same on every rank (the mode is agreed, never local):

- **blocking** (:data:`~slurm_jit.grace.calc.AGREE_BLOCKING`): the round is read at the boundary that started
  it, so a signal during step k stops training after step k. Used where steps are long enough that a small CPU
  all-reduce is negligible beside them (:func:`slurm_jit.grace.calc.agreement_mode`).
- **overlapped**: the round is read at the next boundary, so the collective is hidden behind a step and costs
  about nothing, and the stop can come one step later. Used for short steps, where that step is short too.

Until warm-up is over every round is blocking; the round of the first timed step carries each rank's step time
and the cost of its blocking rounds so far, and the agreed (MAX) values fix the mode for the rest of ``train()``.
All ranks read the same rounds, so they stop after the same step. Local signals only change the values sent,
never the sequence of collectives: every rank issues the same collectives in the same order.

The same all-reduce also carries, at each step boundary, the async periodic save every rank's writer has finished
(``done_step``, the lowest of the ranks' answers): where it is the save in flight, its callbacks are told at that
boundary on every rank (train/async_save/claim.py), with no collective of its own.

A gloo side group keeps GPU runs free of an extra device synchronisation.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slurm_jit.grace import calc
from slurm_jit.train import dist_env
from slurm_jit.train.refusals import JitRefusal

logger = logging.getLogger(__name__)

SIDE_GROUP_TIMEOUT_S = 1800  # torch.distributed's default collective timeout


NO_SIGNAL_MS = 2**62  # "no signal on this rank": never the minimum
NOT_DONE = -1  # "no async save of this rank written and unclaimed": any rank's makes the agreed answer this


@dataclass(frozen=True)
class Decision:
    """What all ranks agreed on in one round."""

    stop: bool  # some rank wants to stop
    wait_s: float = 0.0  # until kill_wait has passed since the earliest signal on any rank (0: it has)
    step_s: float = 0.0  # the longest last step of any rank (0: not sent)
    allreduce_s: float = 0.0  # the highest cost of one blocking round any rank measured (0: none yet)
    done_step: int = NOT_DONE  # the async save every rank's writer had finished when the round was sent


@dataclass
class _Round:
    work: Any
    values: torch.Tensor
    sent_at: float


@dataclass(frozen=True)
class ModeChoice:
    """The agreement mode fixed after warm-up, and the agreed numbers it was chosen from."""

    mode: str
    step_s: float
    allreduce_s: float
    threshold_s: float


def _side_group(rank: int, timeout_s: float) -> Any:
    """The gloo side group; a rank that ended before it was made is one line here, not a traceback: the rank 0
    that hosted the rendezvous store (a refusal at construction on the saving rank: DistNetworkError at once), or
    any other rank (its address never comes: gloo's connect waits ``timeout_s``, the side group's timeout, then
    DistStoreError), never torch's 1800 s default."""
    try:
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    except dist.DistError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise JitRefusal(
            f"slurm_jit: rank {rank} could not reach the other ranks before the first step ({first}): another rank "
            "ended first; this rank trained nothing and saved nothing. HINT: the first error in the job log, from "
            "the rank that ended, says why") from None


class StopAgreement:
    def __init__(self, timeout_s: float = SIDE_GROUP_TIMEOUT_S) -> None:
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.group: Any = None
        self.nodes: list[str | None] = [dist_env.node_name()]  # each rank's node: names a lost peer's node
        if self.distributed:
            self.group = _side_group(self.rank, timeout_s)
            self.nodes = [None] * self.world_size
            dist.all_gather_object(self.nodes, dist_env.node_name(), group=self.group)
        self._pending: _Round | None = None
        self.mode = calc.AGREE_BLOCKING  # until fixed after warm-up
        self.choice: ModeChoice | None = None
        self._round_cost_s: float | None = None  # the cheapest blocking round this rank has seen

    @property
    def latency_steps(self) -> int:
        """Steps from a signal until the stop, as rounds are read now."""
        return calc.LATENCY_STEPS[self.mode]

    def _reduce(self, stop: bool, remaining_s: float | None, async_op: bool, step_s: float = 0.0,
                done_step: int = NOT_DONE) -> _Round:
        # One MAX all-reduce carries every answer: max(stop), min(remaining kill_wait) negated, max(step time),
        # max(cost of a blocking round), min(done step) negated; times in whole ms or us.
        remaining_ms = NO_SIGNAL_MS if remaining_s is None else int(remaining_s * 1000)
        cost_us = int((self._round_cost_s or 0.0) * 1e6)
        values = torch.tensor([1 if stop else 0, -remaining_ms, int(step_s * 1000), cost_us, -done_step],
                              dtype=torch.int64)
        work = None
        if self.distributed:
            work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group, async_op=async_op)
        return _Round(work=work, values=values, sent_at=time.monotonic())

    @staticmethod
    def _read(round_: _Round) -> Decision:
        if round_.work is not None:
            round_.work.wait()
        stop, neg_remaining_ms, step_ms, cost_us, neg_done = (int(v) for v in round_.values.tolist())
        wait_s = 0.0
        if -neg_remaining_ms < NO_SIGNAL_MS:
            wait_s = max(0.0, -neg_remaining_ms / 1000 - (time.monotonic() - round_.sent_at))
        return Decision(stop=bool(stop), wait_s=wait_s, step_s=step_ms / 1000, allreduce_s=cost_us / 1e6,
                        done_step=-neg_done)

    def _drain(self) -> Decision:
        if self._pending is None:
            return Decision(stop=False)
        pending, self._pending = self._pending, None
        return self._read(pending)

    def poll(self, stop: bool, remaining_s: float | None = None, done_step: int = NOT_DONE) -> Decision:
        """The agreed answer of the previous round; starts the next round with this rank's wish.

        ``remaining_s``: how long until kill_wait has passed since this rank's first signal (None: no signal).
        ``done_step``: the async save this rank's writer has finished (:data:`NOT_DONE`: none).
        """
        agreed = self._drain()
        self._pending = self._reduce(stop, remaining_s, async_op=True, done_step=done_step)
        return agreed

    def agree_now(self, stop: bool, remaining_s: float | None = None, step_s: float = 0.0,
                  done_step: int = NOT_DONE) -> Decision:
        """A blocking round (after the pending one, whose answer counts too; the later done step)."""
        earlier = self._drain()
        t0 = time.monotonic()
        now = self._read(self._reduce(stop, remaining_s, async_op=False, step_s=step_s, done_step=done_step))
        cost_s = time.monotonic() - t0
        self._round_cost_s = cost_s if self._round_cost_s is None else min(self._round_cost_s, cost_s)
        return Decision(stop=earlier.stop or now.stop, wait_s=now.wait_s, step_s=now.step_s,
                        allreduce_s=now.allreduce_s, done_step=max(earlier.done_step, now.done_step))

    def at_boundary(self, stop: bool, remaining_s: float | None, step_s: float, choose_mode: bool,
                    done_step: int = NOT_DONE) -> Decision:
        """The stop decision at an optimizer-step boundary, read as the mode says.

        ``choose_mode`` (the same on every rank: after the first timed step) fixes the mode from this round's
        agreed step time and round cost. Call it with a blocking mode, as every boundary before it is.
        """
        if self.mode == calc.AGREE_OVERLAPPED:
            return self.poll(stop, remaining_s, done_step)
        decision = self.agree_now(stop, remaining_s, step_s, done_step)
        if choose_mode and self.choice is None:
            self.mode = calc.agreement_mode(decision.step_s, decision.allreduce_s)
            self.choice = ModeChoice(mode=self.mode, step_s=decision.step_s, allreduce_s=decision.allreduce_s,
                                     threshold_s=calc.blocking_threshold_s(decision.allreduce_s))
        return decision

    def close(self, wait_for_peers: bool = True) -> None:
        """Finish the round in flight, wait for every rank, and tear the side group down.

        A gloo group left to the interpreter's exit can abort the process ("terminate called without an active
        exception") when the peer rank has already exited. ``wait_for_peers=False`` (after a failure, when a
        peer may never come): drop the round in flight and tear the group down without a barrier.
        """
        try:
            if wait_for_peers:
                self._drain()
                if self.distributed and self.group is not None:
                    dist.barrier(group=self.group)
        except RuntimeError as exc:  # gloo's errors (DistError is one): a peer gone after the work was done
            # Only a clean end waits here: the stop record (finished, jit_stop) is written and stays; a traceback
            # would make a done rank look crashed (its peer ended first, e.g. rank 0 by its end-of-training bound).
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            logger.warning("slurm_jit: rank %d: a peer was gone at the closing barrier (%s); the side group is "
                           "torn down without it, what was saved stays", self.rank, first)
        self._pending = None
        if self.distributed and self.group is not None:
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

    def broadcast_after(self, obj: Any, heartbeat: str) -> Any:
        """Rank 0's ``obj`` on every rank, after any number of heartbeats rank 0 broadcasts first (tuples whose
        first item is ``heartbeat``): each wait is one broadcast, bounded by the side group's timeout."""
        while True:
            got = self.broadcast(obj)
            if not (isinstance(got, tuple) and got and got[0] == heartbeat):
                return got

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def all_true(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on every rank: one all-reduce of one number (a gather and a
        broadcast of objects are four collectives, each with its pickling)."""
        if not self.distributed:
            return bool(flag)
        box = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.group)
        return bool(box.item())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)
