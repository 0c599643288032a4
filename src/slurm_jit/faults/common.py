"""What every fault row needs: the tiny real training on 2 CPU ranks, ckpt-check's verdict, per-step losses."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_jit import local_ranks

START_TIMEOUT_S = 600  # a hang detector: a 2-rank run of the tiny model takes ~15-60 s on a loaded 2-core host
CHECK_TIMEOUT_S = 120  # one ckpt-check (an interpreter start and a walk of a few checkpoints)
POLL_S = 0.005  # how often a kill waits for the moment it is aimed at
WORLD_SIZE = 2
PORT_IN_USE = "EADDRINUSE"  # in a rank's log when the rendezvous port was taken all the same: the run is retried


@dataclass(frozen=True, kw_only=True)
class Row:
    """One line of the fault table."""

    name: str
    trials: int  # faults injected
    false_complete: int  # times ckpt-check (or the stop record) called a broken checkpoint complete
    lost_steps: int  # completed (checkpointed) steps that could not be resumed, summed over trials
    passed: bool
    detail: str  # what was done and seen, in a sentence or two
    seconds: float = 0.0  # wall time of the row

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "trials": self.trials, "false_complete": self.false_complete,
                "lost_steps": self.lost_steps, "passed": self.passed, "detail": self.detail,
                "seconds": round(self.seconds, 1)}


@dataclass
class Tally:
    """Counts a row accumulates; ``fail`` records why it did not pass (the first few reasons)."""

    trials: int = 0
    false_complete: int = 0
    lost_steps: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, why: str) -> None:
        self.failures.append(why)

    def check(self, ok: bool, why: str) -> bool:
        if not ok:
            self.fail(why)
        return ok

    def row(self, name: str, detail: str, seconds: float) -> Row:
        passed = not self.failures and self.false_complete == 0 and self.lost_steps == 0
        shown = "; ".join(self.failures[:3]) + (f" (+{len(self.failures) - 3} more)" if len(self.failures) > 3 else "")
        return Row(name=name, trials=self.trials, false_complete=self.false_complete, lost_steps=self.lost_steps,
                   passed=passed, detail=detail if passed else f"FAILED: {shown}. {detail}", seconds=seconds)


def log_dir(out: Path) -> Path:
    """Where the ranks of ``out`` log: beside it, or outside a mount point given as ``OUT/..`` (logs must not
    take the room of a small file system under test, nor vanish with it)."""
    return out.parent.parent / f"logs-{out.parent.name}-{out.name}" if out.parent.is_mount() else \
        out.parent / f"logs-{out.name}"


def start(out: Path, args: Sequence[str], env: dict[str, str] | None = None,
          world_size: int = WORLD_SIZE) -> local_ranks.Ranks:
    """Start the demo training's ranks (each its own process group); logs under :func:`log_dir`."""
    return local_ranks.start(["-m", "slurm_jit.demo_train", "--output-dir", str(out), *args], world_size,
                             log_dir(out), env=env, port=local_ranks.free_port())



def log_size(out: Path) -> list[int]:
    logs = log_dir(out)
    return [(logs / f"rank{r}.log").stat().st_size if (logs / f"rank{r}.log").exists() else 0
            for r in range(WORLD_SIZE)]


def new_log(ranks: local_ranks.Ranks, offsets: list[int]) -> str:
    return "".join(p.read_bytes()[o:].decode(errors="replace") for p, o in zip(ranks.logs, offsets, strict=False))


def run(out: Path, args: Sequence[str], env: dict[str, str] | None = None,
        world_size: int = WORLD_SIZE) -> tuple[list[int | None], str]:
    """Run the ranks to their end: (exit codes, what this run logged); once more if the port was taken."""
    for _ in range(2):
        offsets = log_size(out)
        ranks = start(out, args, env, world_size)
        try:
            codes = ranks.wait(START_TIMEOUT_S)
        finally:  # interrupted (SIGTERM, ^C): no rank group outlives the harness
            ranks.kill()
        log = new_log(ranks, offsets)
        if PORT_IN_USE not in log:
            break
    return codes, log


def losses(out: Path) -> list[tuple[int, float]]:
    """Every (step, loss) rank 0 logged, in order, across every run in ``out`` (a retrained step twice)."""
    path = out / "losses-rank0.jsonl"
    if not path.exists():
        return []
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines()) if r]


def compare_losses(got: list[tuple[int, float]], reference: list[tuple[int, float]]) -> str | None:
    """None when every step of the reference was logged and every logged loss (a retrained step too) equals
    the reference's loss of that step bitwise; else what differs."""
    want = dict(reference)
    for step, loss in got:
        if step not in want:
            return f"step {step} is not in the uninterrupted run"
        if loss != want[step]:
            return f"step {step}: loss {loss!r} != uninterrupted {want[step]!r}"
    missing = sorted(set(want) - {s for s, _ in got})
    return f"steps never trained: {missing[:5]}" if missing else None


def ckpt_check(out: Path, *flags: str) -> dict[str, Any]:
    """``ckpt-check OUT --json [flags]`` in its own process: the verdict as the job's gate sees it."""
    proc = subprocess.run([sys.executable, "-m", "slurm_jit.checkpoint.ckpt_check", str(out), "--json", *flags],
                          capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, check=False)
    if proc.returncode == 2:
        return {"exit_code": 2, "error": proc.stderr.strip(), "checkpoints": [], "resume_from": None}
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def statuses(check: dict[str, Any]) -> dict[int, str]:
    return {c["step"]: c["status"] for c in check["checkpoints"]}


def checked(out: Path, tally: Tally, what: str = "") -> tuple[dict[str, Any], dict[int, str], dict[int, str]]:
    """ckpt-check on ``out``, quick and ``--deep``; a checkpoint the quick check calls complete and the deep one
    does not is a false complete (counted, and a failure). Returns the quick check's report and both verdicts by
    step."""
    report = ckpt_check(out)
    quick, deep = statuses(report), statuses(ckpt_check(out, "--deep"))
    for step, status in quick.items():
        if status == "complete" and deep.get(step) != "complete":
            tally.false_complete += 1
            tally.fail(f"{what}checkpoint-{step} complete for ckpt-check but {deep.get(step)} with --deep")
    return report, quick, deep


def wait_until(done: Callable[[], bool], ranks: local_ranks.Ranks | None, timeout_s: float = START_TIMEOUT_S,
               poll_s: float = POLL_S) -> bool:
    """Poll until ``done()``; False when a rank exits first or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if ranks is not None and any(p.poll() is not None for p in ranks.procs):
            return done()
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def env_with(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


class MountError(RuntimeError):
    """A file system for a fault could not be mounted (not root, no mount(8)): the row says so."""


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int, read_only: bool = False) -> Iterator[Path]:
    """A small tmpfs at ``path`` (root only), unmounted whatever happens."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_bytes}" + (",ro" if read_only else "")
    with sigterm_unwinds():
        _mount(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)])
        try:
            yield path
        finally:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False, timeout=CHECK_TIMEOUT_S)


@contextlib.contextmanager
def read_only_bind(source: Path, path: Path) -> Iterator[Path]:
    """``source`` seen read-only at ``path`` (a bind mount, remounted ro: what root cannot write either)."""
    path.mkdir(parents=True, exist_ok=True)
    with sigterm_unwinds():
        _mount(["mount", "--bind", str(source), str(path)])
        try:
            _mount(["mount", "-o", "remount,bind,ro", str(path)])
            yield path
        finally:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False, timeout=CHECK_TIMEOUT_S)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While a mount is held, SIGTERM (CI cancelling the job, timeout(1)) raises SystemExit, so that the finally
    that unmounts runs; its default action would end the process with the mount left behind. (A harness, not the
    trainer: here unwinding at once is the point, so the handler raises rather than sets a flag.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _mount(argv: list[str]) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=CHECK_TIMEOUT_S)
    except OSError as exc:
        raise MountError(f"{argv[0]}: {exc}") from None
    if proc.returncode != 0:
        raise MountError(f"{' '.join(argv)}: {proc.stderr.strip()}")
