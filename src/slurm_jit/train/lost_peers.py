"""Lost peers: a rank whose peer process ended ends too, with the stop record ``failed`` naming the lost rank.

A collective whose peer ended fails on the ranks still alive: gloo raises at once ("Connection reset by peer",
"Connection closed by peer": the dead process's sockets were closed by its kernel) or, when the peer's node is gone
and nothing closes them, after the group's timeout ("Timed out": ``side_group_timeout_s`` for the side group, the
hang watchdog's bound for a training step). Whatever the rank was doing then (a step, the stop round after a
SIGTERM, a save's barrier) no stop can be agreed and no manifest written without the lost rank: the save stays
incomplete, the newest complete checkpoint is still the one ``ckpt-check`` picks.

Which rank was lost: the error does not say (gloo names an address). Every survivor writes its report
``OUT/slurm-jit/peer-lost-rank<R>.json`` (rank, node, step, how); the survivor with the lowest rank (rank 0 unless
rank 0 was lost) waits for the other ranks' reports (:data:`REPORT_WAIT_S` at most, no wait once every rank
reported) and writes ``failed`` with ``lost_peer``: the lowest rank without a report. With more than two ranks a
survivor still blocked when the wait ends is counted among the missing; ``how`` lists every missing rank.

Every rank reported: no process ended, one was late past a group's timeout. Stop rounds read one step late
(overlapped) fail on both sides at the next boundary: the ranks that waited for the late one say "Timed out", the
late one sees its peers' side closed. The record names a rank whose error was not a timeout (else the lowest other
rank): the same record whichever rank reached it first.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import TYPE_CHECKING

import torch.distributed as dist

from slurm_jit.train import stop_record, watchdog
from slurm_jit.train.save_errors import PEER_GONE_WORDS, TIMED_OUT, gloo_words

if TYPE_CHECKING:
    from slurm_jit.train.run_state import Run
    from slurm_jit.train.session import Session

logger = logging.getLogger(__name__)

# The survivors' reports come within a second of each other (each sees the error within a collective); a rank that
# has not reported after this long is taken as lost: the hang watchdog's wait for its peers' reports, the same reason
REPORT_WAIT_S = watchdog.PEER_REPORT_WAIT_S
HOW_CHARS = 200  # "how" is one line of the stop record and of `stop_record`'s output
# What a record already says that a lost peer must not replace: a complete JIT stop's checkpoint (requeue from it),
# the end of training, a hang (the hung rank's report names it)
KEPT_STATES = ("jit_stop", "finished", "hung")
MAX_CHAIN = 5  # how far down the errors an error was raised from (a save's one line, then gloo's) to look
_TORCH_DIST = os.sep + "torch" + os.sep + "distributed" + os.sep


def how_lost(exc: BaseException) -> str | None:
    """One line (the collective and gloo's words) when ``exc``, or the error it was raised from (a save's one
    line), says a peer ended or stopped answering inside a collective; None for any other error (a user's own
    "timed out" is not a lost peer)."""
    seen: BaseException | None = exc
    for _ in range(MAX_CHAIN):
        if seen is None:
            return None
        text = str(seen)
        words = any(w in text for w in PEER_GONE_WORDS)
        if words and (isinstance(seen, dist.DistError) or "gloo" in text):
            first = next((line for line in text.splitlines() if any(w in line for w in PEER_GONE_WORDS)), text)
            said = gloo_words(first)
            where = _collective(seen)
            return (f"{where}: {said}" if where else said)[:HOW_CHARS]
        seen = seen.__cause__ or seen.__context__
    return None


def _collective(exc: BaseException) -> str | None:
    """The torch.distributed function that raised (``barrier``, ``all_reduce``, ...), or None."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    names = [f.name for f in frames if _TORCH_DIST in f.filename and f.name not in ("wrapper", "wait")]
    return names[-1] if names else None


def lost_ranks(world_size: int, reporters: set[int]) -> list[int]:
    """The ranks that wrote no report: lost (or, with more than two ranks, still blocked)."""
    return [r for r in range(world_size) if r not in reporters]


def named_ranks(world_size: int, reports: dict[int, str], writer: int) -> list[int]:
    """The ranks the record names: those without a report; when every rank reported (one was late, none ended),
    the first whose error was not a timeout, else the lowest rank but ``writer``."""
    missing = lost_ranks(world_size, set(reports))
    if missing:
        return missing
    late = [r for r, how in sorted(reports.items()) if r != writer and TIMED_OUT not in how]
    return late[:1] or [r for r in range(world_size) if r != writer][:1]


def _own_failure(out: str, rank: int) -> str | None:
    """The error rank ``rank`` reported before it ended (train/stop_path.py), if it did."""
    for report in stop_record.reports(out, stop_record.FAILED_GLOB):
        if report.get("rank") == rank and isinstance(report.get("error"), str):
            return str(report["error"])[:2000]
    return None


def record(session: Session, run: Run, how: str) -> bool:
    """This survivor's report; the lowest survivor also writes ``failed`` with ``lost_peer``. True when this rank
    wrote the record."""
    trainer = session.trainer
    out, rank, world = str(trainer.args.output_dir), int(trainer.args.process_index), int(trainer.args.world_size)
    step = getattr(trainer.state, "global_step", None)
    nodes = _nodes(session, world)
    stop_record.write_report(stop_record.peer_lost_report_path(out, rank),
                             {"rank": rank, "node": nodes[rank], "step": step, "how": how})
    reports = _wait_for_reports(out, world)
    if rank != min(set(reports) | {rank}):
        return False
    if rank != 0 and run.timing is None:  # before every rank passed rank 0's lock: the output_dir may be another
        return False  # training's (a rank 0 locked out of it), whose record is not this run's to write
    missing = named_ranks(world, reports, rank)
    lost = missing[0]
    said = how if len(missing) == 1 else f"{how}; no report from ranks {missing}"
    lost_peer = {"rank": lost, "step": step, "node": nodes[lost], "how": said}
    error = f"peer rank {lost} lost at step {step}: {said}"
    own = _own_failure(out, lost)
    if own is not None:  # it ended on its own error (a DataLoader worker's death, say): that is why
        lost_peer["error"] = own
        error = f"{error}; rank {lost} failed: {own}"
    with stop_record.WRITE_LOCK:
        earlier = stop_record.read(out)  # this run's: rank 0 wrote ``running`` at its start
        if earlier is not None and (earlier["state"] in KEPT_STATES or earlier.get("lost_peer")):
            # recorded before: rank 0's final record, or the first survivor's loss (a peer that only stalled past
            # the side group's timeout and then found that survivor gone must not rename the loss)
            logger.error("slurm_jit: peer rank %s lost after the stop record said %s; kept", lost, earlier["state"])
            return False
        stop_record.write(out, "failed", step=step, error=error, lost_peer=lost_peer,
                          resumed_from=run.resumed_from)
    logger.error("slurm_jit: peer rank %s (node %s) lost at step %s (%s); rank %d ends too, nothing saved after "
                 "the newest complete checkpoint is called complete. HINT: rank %s's own log (and sacct, dmesg: "
                 "killed? out of memory? node failure?) says why it ended; a requeue resumes from the checkpoint "
                 "`ckpt-check %s` names", lost, nodes[lost], step, said, rank, lost, out)
    return True


def _nodes(session: Session, world: int) -> list[str | None]:
    agreement = session.open_agreement
    nodes = list(agreement.nodes) if agreement is not None else []
    return nodes if len(nodes) == world else [None] * world


def _wait_for_reports(out: str, world: int) -> dict[int, str]:
    """Each reporting rank's ``how``, once every rank reported or :data:`REPORT_WAIT_S` has passed (a rank that
    saw its peer's side closed can see it before the peer's own timeout is raised: not lost, only late)."""
    found = stop_record.wait_for_reports(out, stop_record.PEER_LOST_GLOB, world, REPORT_WAIT_S)
    return {int(r["rank"]): str(r.get("how")) for r in found if isinstance(r.get("rank"), int)}

