"""Can every rank write the output directory? Asked once per ``train()``, before the output lock, the resume pick
and the first step.

Rank 0's output lock proves only rank 0's view. Under ZeRO every rank writes its own shards, and on another node the
output directory may be another mount (read-only, full, over quota, not mounted at all): that rank's first write
would fail in the middle of the first save, a traceback and an incomplete checkpoint. So every rank makes a small
test write of its own (:func:`probe`), rank 0 gathers the answers and every rank gets the same verdict
(:func:`refusal_on_any_rank`): one line naming the rank and its host, or None. Nothing is written but the probe
file, which is removed at once, so a refusal leaves every checkpoint and record as it was.

Before that, at ``JitTrainer(...)``, :func:`made_or_refused` creates the output directory where upstream's
``Trainer.__init__`` would (its bare ``os.makedirs`` raises a traceback for a file, a dangling symbolic link, a
read-only or full file system): one line with a HINT instead.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Any

from slurm_jit.timing import TIMING_DIR
from slurm_jit.train.save_errors import REFUSAL_HINTS

PROBE_PREFIX = ".slurm-jit-writable-"  # + host and pid: ranks on one node each write their own
PROBE_PAYLOAD = b"slurm-jit: can this rank write here?\n"


def probe(output_dir: str | os.PathLike[str]) -> tuple[str, int] | None:
    """Why this process cannot write ``output_dir`` (one line, no HINT) and the errno, or None when a test write
    there works."""
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
        blocked = blocked_by(output_dir)
        return (blocked, exc.errno or 0) if blocked else (_why(exc, where), exc.errno or 0)
    return None


def blocked_by(output_dir: str | os.PathLike[str]) -> str | None:
    """What stands where ``output_dir`` should be when it is not a directory (a file, a dangling link), or None."""
    path = Path(output_dir)
    if path.is_dir() or not os.path.lexists(path):
        return None
    if path.is_symlink() and not path.exists():
        return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
    return f"{path} is {'a symbolic link to ' if path.is_symlink() else ''}a file, not a directory"


def made_or_refused(output_dir: str | os.PathLike[str]) -> str | None:
    """Create ``output_dir`` (as upstream's Trainer does at construction): None, or why not in one line with a
    HINT. Nothing is removed or replaced."""
    blocked = blocked_by(output_dir)
    if blocked:
        return (f"slurm_jit: output_dir {os.fspath(output_dir)} cannot be used: {blocked}; nothing was written. "
                f"HINT: point output_dir at a directory (or move {os.fspath(output_dir)} away; a link to storage "
                "that is not mounted here: mount it)")
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as exc:
        return (f"slurm_jit: output_dir {os.fspath(output_dir)} cannot be created: {_why(exc, Path(output_dir))}; "
                f"nothing was written. HINT: {_hint(exc.errno or 0, os.fspath(output_dir), socket.gethostname())}")
    return None


def refusal_at_construction(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """``JitTrainer(*args, **kwargs)``: where upstream's Trainer would create output_dir (the saving rank), create
    it here first; why it cannot be, or None. ``Trainer(model, args, ...)``: the TrainingArguments second."""
    targs = kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None)
    if targs is None or not getattr(targs, "should_save", False) or not getattr(targs, "output_dir", None):
        return None  # upstream's default arguments, or a rank that does not save: upstream creates nothing
    return made_or_refused(targs.output_dir)


def _why(exc: OSError, where: Path) -> str:
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"{exc.strerror or type(exc).__name__} ({code}): {exc.filename or where}"


def _hint(code: int, output_dir: str, host: str) -> str:
    """What to do about a refused write of ``output_dir`` on ``host``, by errno: a full disk or a used-up quota
    are said as such; anything else (read-only, permission, not mounted) is a mount to fix."""
    if code in (errno.ENOSPC, errno.EDQUOT):
        return REFUSAL_HINTS[code].format(where=output_dir)
    return (f"make {output_dir} writable from every node (read-only or missing mount on {host}?), or point "
            "output_dir at shared storage every node can write")


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


def _line(output_dir: str, refused: list[tuple[int, str, tuple[str, int]]], world_size: int) -> str:
    rank, host, (why, code) = refused[0]
    others = f" (and {len(refused) - 1} more of {world_size} ranks)" if len(refused) > 1 else ""
    return (f"output_dir {output_dir} cannot be written by rank {rank} on {host}{others}: {why}; no rank trained "
            f"and nothing was saved or changed. HINT: every rank writes its share of a checkpoint: "
            f"{_hint(code, output_dir, host)}")
