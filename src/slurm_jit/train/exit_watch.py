"""After a JIT stop: how long the rank's process takes to end once ``train()`` has returned (the grace's exit term).

What follows ``train()`` still runs inside the signal lead: DeepSpeed's and gloo's shutdown, the rest of the user's
script, the interpreter's exit, and after them the requeue decision. The rank cannot time its own end, so it starts
a watcher (``python -I -S``, no torch: ~20 ms) that holds a pidfd of the rank, waits for the process to end, and
appends one ``exit`` record to the rank's timing log (``timing.py``); grace-calc adds the longest to the teardown.

The watcher ignores the stop signals (Slurm signals every process of the step), holds none of the rank's output
pipes, gives up after ``WATCH_MAX_S``, and writes nothing when the log cannot be opened. Nothing here can fail the
training: a watcher that cannot start is one debug line.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# A process alive this long after a JIT stop's train() returned is a program going on (a notebook, a script's own
# evaluation), not a teardown to size every later grace by: no record then (Slurm's KillWait default is 30 s)
WATCH_MAX_S = 600.0

# argv: the rank's pidfd (inherited), the log's path, since (epoch s), max_s, the record's JSON.
_WATCHER = r"""
import json, os, select, signal, sys, time
for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
pidfd, path, since, max_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
record = json.loads(sys.argv[5])
poller = select.poll()
poller.register(pidfd, select.POLLIN)
if not poller.poll(int(max_s * 1000)):
    sys.exit(0)
now = time.time()
record.update(dur_s=max(0.0, now - since), time=now)
try:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
except OSError:
    sys.exit(0)
try:
    os.write(fd, (json.dumps(record) + "\n").encode())
finally:
    os.close(fd)
"""
def start(log_path: Path, record: dict[str, Any]) -> subprocess.Popen[bytes] | None:
    """Start the watcher of this process; its ``exit`` record (``record`` plus ``dur_s`` and ``time``) goes to
    ``log_path`` once this process has ended. Returns the watcher (tests wait on it), or None."""
    since = time.time()
    pidfd_open = getattr(os, "pidfd_open", None)
    try:
        if pidfd_open is None:
            raise OSError("os.pidfd_open is not available (Linux >= 5.3, Python >= 3.9)")
        pidfd = pidfd_open(os.getpid())
        try:
            return subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHER, str(pidfd), str(log_path), repr(since),
                 repr(WATCH_MAX_S), json.dumps(record)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(pidfd,), close_fds=True,
            )
        finally:
            os.close(pidfd)  # the watcher has its own copy
    except (OSError, ValueError) as exc:
        logger.debug("slurm_jit: exit watcher not started (the grace-calc exit term stays unmeasured): %s", exc)
        return None
