"""Start N ranks of a command on this host, each in its own process group, as ``srun`` starts its tasks.

Tests and benchmarks use it to signal ranks one by one (``os.killpg``), at chosen moments, as Slurm does across
nodes; torchrun would forward one SIGTERM to all ranks at once and SIGKILL them 30 s later.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    log_path = Path(log_dir)
    log_path.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for rank in range(world_size):
        rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PATH": path}
        log = log_path / f"rank{rank}.log"
        with open(log, "ab") as out:
            procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log)
    return Ranks(procs=procs, logs=logs)
