"""Start N ranks of a command on this host, each in its own process group, as ``srun`` starts its tasks.

Tests and benchmarks use it to signal ranks one by one (``os.killpg``), at chosen moments, as Slurm does across
nodes; torchrun would forward one SIGTERM to all ranks at once and SIGKILL them 30 s later.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# MASTER_PORT from below Linux's ephemeral range (32768-60999): rank 0 binds it seconds after it was found free
# (imports first), and on a shared host any outgoing connection (another test's gloo sockets among them) may take
# an ephemeral port meanwhile (seen: EADDRINUSE, rank 1 gone, rank 0 waiting forever). Below the range only an
# explicit bind can collide; the system RNG, so that processes started in the same instant pick apart.
QUIET_PORTS = (20000, 30000)
_PORT_RNG = random.SystemRandom()


def free_port() -> int:
    """A port nothing on 127.0.0.1 is bound to now, below the ephemeral range (QUIET_PORTS)."""
    while True:
        port = _PORT_RNG.randrange(*QUIET_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


@dataclass
class Ranks:
    """A running group of ranks; ``procs[r]`` is rank r, the leader of its own process group."""

    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]
    started: float = field(default_factory=time.monotonic)

    def signal(self, rank: int, signum: int = signal.SIGTERM, group: bool = True) -> None:
        proc = self.procs[rank]
        if proc.poll() is None:
            if group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)

    def wait(self, timeout_s: float) -> list[int | None]:
        """Exit codes (None for a rank still running at the deadline; the group is then SIGKILLed)."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        codes = [p.poll() for p in self.procs]
        self.kill()
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")


def start(argv: Sequence[str], world_size: int, log_dir: str | os.PathLike[str],
          env: Mapping[str, str] | None = None, port: int | None = None) -> Ranks:
    """Start ``python argv`` once per rank with RANK/WORLD_SIZE/MASTER_* set; output to log_dir/rank<R>.log.
    ``port``: MASTER_PORT (default: one the kernel says is free now)."""
    port = port or free_port()
    # This interpreter's bin directory first: DeepSpeed's op loader runs `ninja`, and another ninja version
    # (Debian's) discards the build log and rebuilds the op from scratch.
    bin_dir = os.path.dirname(sys.executable)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    logs = [Path(log_dir) / f"rank{rank}.log" for rank in range(world_size)]
    procs = []
    with contextlib.ExitStack() as opened:  # every log open before any rank starts: an OSError starts none
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        outs = [opened.enter_context(open(log, "ab")) for log in logs]
        for rank, out in enumerate(outs):
            rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank),
                        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PATH": path}
            procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    return Ranks(procs=procs, logs=logs)


# --- the command: python -m slurm_jit.local_ranks -n 2 -- train.py ARGS ------------------------------------

PROG = "python -m slurm_jit.local_ranks"
USAGE = f"""usage: {PROG} [-n N] [--log-dir DIR] -- SCRIPT.py [ARGS...]

Start N ranks of SCRIPT.py on this host (this interpreter; RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT set), as
srun starts one task per rank, without Slurm. Each rank writes DIR/rank<R>.log (default ./rank-logs). SIGTERM or
Ctrl-C to this command reaches every rank, as Slurm's warning does: a JitTrainer stops with a JIT checkpoint; a
second one kills every rank. A rank that fails ends the others (SIGTERM, SIGKILL 30 s later), as srun does.
Exit status: the failed rank's (128+N for signal N), else 0.

  -n, --nranks N   how many ranks (default 2)
  --log-dir DIR    where the per-rank logs go (default ./rank-logs)

example: {PROG} -n 2 -- examples/train.py out"""
DEFAULT_NRANKS = 2
POLL_S = 0.2  # how often the waiting loop looks at the ranks and the signal flag
# After one rank failed, the others (stuck in a collective with it, most likely) get SIGTERM, then SIGKILL this
# much later: Slurm's KillWait default between a step's SIGTERM and its SIGKILL (srun --kill-on-bad-exit).
KILL_WAIT_S = 30.0


class UsageError(ValueError):
    """A misused command line: one line with a HINT."""


def parse_cli(argv: Sequence[str]) -> tuple[int, Path, list[str]]:
    """(ranks, log dir, the script and its arguments) from ``-n N [--log-dir DIR] -- SCRIPT.py ARGS``."""
    nranks, log_dir, args = DEFAULT_NRANKS, Path("rank-logs"), list(argv)
    while args and args[0] != "--":
        option = args.pop(0)
        if option not in ("-n", "--nranks", "--log-dir") or not args:
            raise UsageError(f"{option!r}: not an option here, or missing its value. HINT: {PROG} -n 2 -- "
                             "train.py ARGS (see --help)")
        value = args.pop(0)
        if option == "--log-dir":
            log_dir = Path(value)
        elif not value.isdigit() or int(value) < 1:
            raise UsageError(f"{option} {value}: not a number of ranks. HINT: e.g. -n 2")
        else:
            nranks = int(value)
    command = args[1:]
    if command and re.fullmatch(r"python[\d.]*", os.path.basename(command[0])):
        command = command[1:]  # "-- python train.py": the ranks run this interpreter in any case
    if not command:
        raise UsageError(f"no script to run. HINT: put it after --, e.g. {PROG} -n 2 -- examples/train.py out")
    if command[0].endswith(".py") and not os.path.isfile(command[0]):
        raise UsageError(f"{command[0]}: no such file. HINT: the path of your training script, from here")
    return nranks, log_dir, command


class _Latch:
    """The signal handler only records the signal (and how many came); the waiting loop acts on it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0

    def __call__(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum
        self.count += 1


def run(nranks: int, log_dir: Path, command: list[str]) -> int:
    """Start the ranks, forward SIGTERM/SIGINT to every rank's process group (a second one: SIGKILL), end the
    others when one fails, wait; the exit status."""
    latch = _Latch()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, latch)
    try:
        ranks = start(command, nranks, log_dir)
    except OSError as exc:  # FileExistsError (a file), NotADirectoryError, PermissionError, a full disk
        raise UsageError(f"--log-dir {log_dir}: cannot hold the rank logs ({exc.strerror}: {exc.filename}). "
                         "HINT: give a directory this user can write (default ./rank-logs)") from None
    print(f"{PROG}: {nranks} rank(s) of {' '.join(command)}; logs {log_dir}/rank<R>.log; pid {os.getpid()} "
          "(kill -TERM it to stop every rank as Slurm's warning does; a second time kills them)", flush=True)
    try:
        first_failed = _watch(ranks, latch)
    finally:
        ranks.kill()
    codes = [p.returncode for p in ranks.procs]
    print(f"{PROG}: exit codes {codes}", flush=True)
    code = codes[first_failed] if first_failed is not None else next((c for c in codes if c), 0)
    return 128 - code if code < 0 else code  # killed by signal N: 128+N, as a shell (and srun) says


def _watch(ranks: Ranks, latch: _Latch) -> int | None:
    """Wait for every rank; the first rank that failed by itself, if any."""
    forwarded, first_failed, kill_at = 0, None, None
    while any(p.poll() is None for p in ranks.procs):
        if latch.count > forwarded:
            forwarded = latch.count
            if forwarded == 1:
                _end_all(ranks, signal.SIGTERM, f"signal {latch.signum} forwarded to every rank as SIGTERM (again: "
                                                "SIGKILL)")
            else:
                _end_all(ranks, signal.SIGKILL, "a second signal: every rank SIGKILLed")
        failed = next((r for r, p in enumerate(ranks.procs) if p.poll() not in (None, 0)), None)
        if first_failed is None and failed is not None and not forwarded:
            first_failed, kill_at = failed, time.monotonic() + KILL_WAIT_S
            _end_all(ranks, signal.SIGTERM, f"rank {failed} exited with {ranks.procs[failed].returncode}: the "
                                            f"other ranks get SIGTERM, SIGKILL {KILL_WAIT_S:.0f} s later")
        if kill_at is not None and time.monotonic() >= kill_at:
            kill_at = None
            _end_all(ranks, signal.SIGKILL, f"ranks still running {KILL_WAIT_S:.0f} s after SIGTERM: SIGKILLed")
        time.sleep(POLL_S)
    return first_failed


def _end_all(ranks: Ranks, signum: int, said: str) -> None:
    for rank in range(len(ranks.procs)):
        with contextlib.suppress(ProcessLookupError):  # exited since the poll
            ranks.signal(rank, signum)
    print(f"{PROG}: {said}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    try:
        return run(*parse_cli(args))
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
