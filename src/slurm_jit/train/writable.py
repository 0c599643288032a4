"""Can every rank write the output directory? Asked once per ``train()``, before the output lock, the resume pick
and the first step.

Rank 0's output lock proves only rank 0's view. Under ZeRO every rank writes its own shards, and on another node the
output directory may be another mount (read-only, full, over quota, not mounted at all): that rank's first write
would fail in the middle of the first save, a traceback and an incomplete checkpoint. So every rank makes a small
test write of its own (:func:`probe`), rank 0 gathers the answers and every rank gets the same verdict
(:func:`refusal_on_any_rank`): one line naming the rank and its host, or None. Nothing is written but the probe
file, which is removed at once, so a refusal leaves every checkpoint and record as it was.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Any

from slurm_jit.timing import TIMING_DIR

PROBE_PREFIX = ".slurm-jit-writable-"  # + host and pid: ranks on one node each write their own
PROBE_PAYLOAD = b"slurm-jit: can this rank write here?\n"


def probe(output_dir: str | os.PathLike[str]) -> str | None:
    """Why this process cannot write ``output_dir`` (one line, no HINT), or None when a test write there works."""
    where = Path(output_dir) / TIMING_DIR
    target = where / f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}"
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, PROBE_PAYLOAD)
            os.fsync(fd)
        finally:
            os.close(fd)
            target.unlink(missing_ok=True)
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return f"{exc.strerror or type(exc).__name__} ({code}): {exc.filename or where}"
    return None


def refusal_on_any_rank(agreement: Any, output_dir: str | os.PathLike[str]) -> str | None:
    """The same answer on every rank: None when every rank could write ``output_dir``, else one line with a HINT
    naming the first rank that could not. ``agreement``: the trainer's side group (gather, broadcast)."""
    mine = (int(agreement.rank), socket.gethostname(), probe(output_dir))
    answers = agreement.gather(mine)
    verdict = None
    if answers is not None:  # rank 0
        refused = [(rank, host, why) for rank, host, why in answers if why]
        verdict = _line(os.fspath(output_dir), refused, len(answers)) if refused else None
    return agreement.broadcast(verdict)


def _line(output_dir: str, refused: list[tuple[int, str, str]], world_size: int) -> str:
    rank, host, why = refused[0]
    others = f" (and {len(refused) - 1} more of {world_size} ranks)" if len(refused) > 1 else ""
    return (f"output_dir {output_dir} cannot be written by rank {rank} on {host}{others}: {why}; no rank trained "
            f"and nothing was saved or changed. HINT: every rank writes its share of a checkpoint: make "
            f"{output_dir} writable from every node (read-only or missing mount on {host}?), or point output_dir at "
            "shared storage every node can write")
