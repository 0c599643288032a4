"""What a ``hung`` or lost-peer stop record says in one phrase: the words ``status``, the job log's policy line and
the W&B/TensorBoard stop summaries share.

Pure: a stop record (a dict, as :func:`slurm_jit.train.stop_record.read` returns it) in, words out. A ``hung`` record
carries ``ranks: [{rank, node, step, phase, ...}]`` (the hang reports); a ``failed`` one whose rank ended because a
peer was lost carries ``lost_peer: {rank, step, node, how}`` (the interface agreed for issue 20).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class StuckRank:
    """The rank a hang or a lost peer names: the one to blame, and its node (to exclude from a requeue)."""

    rank: int | None  # the global rank
    node: str | None  # its hostname; None when the record does not say
    step: int | None  # the global step it was at


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# A hostname as Slurm names nodes: no spaces, commas or brackets (ExcNodeList would read those as lists/ranges)
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def _node(value: object) -> str | None:
    return value if isinstance(value, str) and NODE_NAME.fullmatch(value) else None


def lost_peer(record: dict[str, Any] | None) -> StuckRank | None:
    """The lost peer of a ``failed`` record; None for any other record, and for a peer that ended on its own error
    (``lost_peer.error``, its failure report): that is a crash, as the same error on rank 0 would be."""
    peer = record.get("lost_peer") if record and record.get("state") == "failed" else None
    if not isinstance(peer, dict) or peer.get("error") is not None:
        return None
    step = _int_or_none(peer.get("step"))
    return StuckRank(rank=_int_or_none(peer.get("rank")), node=_node(peer.get("node")),
                     step=_int_or_none(record.get("step")) if step is None else step)


# Frames of a rank that waits for its peers (torch.distributed, DeepSpeed's comm wrapper, a gloo/NCCL work's wait):
# in a hang, every rank but the stuck one is usually waiting in one of these for the stuck one.
COLLECTIVE_FILES = ("distributed_c10d.py", "comm.py", "torch.py", "c10d_logger.py")
COLLECTIVE_FUNCTIONS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "wait",
                        "all_to_all", "gather", "scatter", "send", "recv")


def _in_collective(report: dict[str, Any]) -> bool:
    frame = str(report.get("frame") or "")
    where, _, function = frame.partition(" in ")
    return where.split(":")[0] in COLLECTIVE_FILES or any(word in function for word in COLLECTIVE_FUNCTIONS)


def _blame_order(report: dict[str, Any]) -> tuple[bool, float, int]:
    """Sort key: a rank outside a collective first (the others wait for it), then the longest since its last
    boundary, then the lowest rank."""
    since = report.get("since_s")
    rank = _int_or_none(report.get("rank"))
    return (_in_collective(report), -since if isinstance(since, (int, float)) else 0.0,
            rank if rank is not None else 1 << 30)


def _unreported(record: dict[str, Any]) -> StuckRank | None:
    """The lowest rank the record lists under ``unreported`` (no hang report when rank 0 wrote it: its process or
    node gone, or its own watchdog not yet fired), at the record's step; None when it lists none."""
    listed = record.get("unreported")
    found = sorted(((_int_or_none(r.get("rank")), r) for r in listed if isinstance(r, dict)) if isinstance(
        listed, list) else [], key=lambda pair: (pair[0] is None, pair[0] or 0))
    if not found or found[0][0] is None:
        return None
    return StuckRank(rank=found[0][0], node=_node(found[0][1].get("node")), step=_int_or_none(record.get("step")))


def hung_rank(record: dict[str, Any] | None) -> StuckRank | None:
    """The stuck rank of a ``hung`` record (see :func:`_blame_order`); when every report waits in a collective, a
    rank without a report is the one they wait for (:func:`_unreported`); a ``hung`` record without reports gives
    a rank of None at the record's step. None for any other record."""
    if not record or record.get("state") != "hung":
        return None
    listed = record.get("ranks")
    ranks = sorted((r for r in listed if isinstance(r, dict)), key=_blame_order) if isinstance(listed, list) else []
    silent = _unreported(record)
    if silent is not None and (not ranks or _in_collective(ranks[0])):
        return silent
    if not ranks:
        return StuckRank(rank=None, node=None, step=_int_or_none(record.get("step")))
    first = ranks[0]
    step = _int_or_none(first.get("step"))
    return StuckRank(rank=_int_or_none(first.get("rank")), node=_node(first.get("node")),
                     step=_int_or_none(record.get("step")) if step is None else step)


def stuck(record: dict[str, Any] | None) -> StuckRank | None:
    """The hung rank or the lost peer the record names; None when it names neither."""
    return hung_rank(record) or lost_peer(record)


def hang_words(found: StuckRank) -> str:
    """``hang at step S on rank R (node N), stack in the log``."""
    rank = "an unknown rank" if found.rank is None else f"rank {found.rank}"
    return f"hang at step {found.step} on {rank} (node {found.node or 'unknown'}), stack in the log"


def lost_peer_words(found: StuckRank) -> str:
    """``peer rank R lost at step S`` (and its node, when known)."""
    rank = "an unknown rank" if found.rank is None else f"rank {found.rank}"
    return f"peer {rank} lost at step {found.step}" + (f" (node {found.node})" if found.node else "")


def phrase(record: dict[str, Any] | None) -> str | None:
    """:func:`hang_words` or :func:`lost_peer_words` of the record; None for a record that is neither."""
    found = hung_rank(record)
    if found is not None:
        return hang_words(found)
    found = lost_peer(record)
    return None if found is None else lost_peer_words(found)
