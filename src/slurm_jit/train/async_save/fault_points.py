"""Fault injection for the async save path (``tools/faults --only async-kills`` and the tests; never set otherwise).

``SLURM_JIT_FAULT_ASYNC=<point>:<step>:<action>[:<rank>]`` makes the async save of checkpoint-``<step>`` stall
(``<action>``: seconds) or fail (``raise``: an OSError, the writer thread dying on this rank alone) at one named
instant, on every rank or on global rank ``<rank>`` only; several such specs, comma-separated, each act. Before a
stall it logs :data:`STALLED` (a harness waits for that line, then kills): an instant hit deterministically, not by
timing. The points, in the order they pass:

``stage``     the training thread, the states staged in host memory (their copies deferred), before the ranks
              agree that all staged
``copy``      the background thread, before the deferred copies (the next optimizer step waits for them: the
              training stalls too)
``write``     the background thread, the first file written, the others not (nothing fsynced yet)
``marker``    the background thread, this rank's files durable, its done marker not yet written (stall one rank:
              the instant between the ranks' markers)
``published`` the background thread, this rank's done marker renamed into place, the directory not yet fsynced
              (from here rank 0 may commit this rank's files)
``manifest``  rank 0's thread, every marker read and removed, the manifest not yet written (the sentinel is there)
``rotated``   rank 0's thread, the manifest written (the checkpoint complete) and the older checkpoints rotated (a
              rotation that fails in its last step)

``SLURM_JIT_FAULT_COPY_WAIT_S=<seconds>`` shortens the optimizer step's bound on its wait for the staging copies
(:mod:`.step_gate`), so that a test sees copies held at ``copy`` fail that step within seconds.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

FAULT_ASYNC_ENV = "SLURM_JIT_FAULT_ASYNC"  # fault injection: "<point>:<step>:<seconds|raise>[:<rank>]",...
POINTS = ("stage", "copy", "write", "marker", "published", "manifest", "rotated")
RAISE = "raise"
STALLED = "slurm_jit: fault injection: async save stalled at %s of checkpoint-%d on rank %d"  # the harness's cue
COPY_WAIT_ENV = "SLURM_JIT_FAULT_COPY_WAIT_S"  # fault injection: the step gate's bound on the copies, shortened

logger = logging.getLogger(__name__)


class InjectedFault(OSError):
    """The failure :data:`FAULT_ASYNC_ENV` asked for (``raise``)."""


@dataclass(frozen=True)
class _Spec:
    point: str
    step: int
    action: str
    rank: int | None


def _specs() -> list[_Spec]:
    raw = os.environ.get(FAULT_ASYNC_ENV, "")
    specs = []
    for one in (raw.split(",") if raw else []):
        parts = one.split(":")
        if len(parts) not in (3, 4) or parts[0] not in POINTS:
            raise ValueError(f"slurm_jit: {FAULT_ASYNC_ENV}={raw!r} is not <point>:<step>:<seconds|raise>[:<rank>] "
                             f"(comma-separated) with a point in {POINTS}. HINT: unset it (fault injection only)")
        specs.append(_Spec(parts[0], int(parts[1]), parts[2], int(parts[3]) if len(parts) == 4 else None))
    return specs


def _step_of(ckpt: Path) -> int:
    suffix = ckpt.name.removeprefix("checkpoint-")
    return int(suffix) if suffix.isdigit() else -1


def hit(point: str, ckpt: Path) -> None:
    """The faults asked for at ``point`` of the save of ``ckpt`` on this rank, if any: stalls, then an OSError."""
    rank = int(os.environ.get("RANK", "0") or 0)
    for spec in _specs():
        if spec.point != point or spec.step != _step_of(ckpt) or spec.rank not in (None, rank):
            continue
        if spec.action == RAISE:
            raise InjectedFault(f"fault injection: the async save failed at {point} on rank {rank}")
        logger.warning(STALLED, point, spec.step, rank)
        time.sleep(float(spec.action))


def copy_wait_s() -> float | None:
    """The shortened bound :data:`COPY_WAIT_ENV` asks for (seconds), or None (unset: the bound is derived)."""
    raw = os.environ.get(COPY_WAIT_ENV, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"slurm_jit: {COPY_WAIT_ENV}={raw!r} is not a number of seconds above 0. HINT: unset it "
                         "(fault injection only)")
    return seconds
