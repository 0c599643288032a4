"""The output-directory lock (train/output_lock.py): real POSIX locks between real processes, a real read-only
mount.

A lock holder is a child process that takes the lock through the module and sleeps; the test takes it again in
this process. About 3 s. The trainer-level path (a second 2-rank launch refused while the first trains, a
read-only output_dir refused before any step) runs in tools/faults --quick (tests/test_faults.py).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_jit.train import output_lock

HOLD = """\
import sys, time
from slurm_jit.train import output_lock
lock, why = output_lock.acquire(sys.argv[1])
print("held" if lock else why, flush=True)
time.sleep(600)
"""
HOLDER_START_TIMEOUT_S = 60  # an interpreter start on a loaded 2-core host


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[callable]:  # type: ignore[valid-type]
    started: list[subprocess.Popen[str]] = []

    def start(out: Path, **env: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True,
                                env=_env(**env))
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()  # blocks until the child has the lock (or was refused)
        assert line == "held", line
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait(HOLDER_START_TIMEOUT_S)


def test_a_second_acquire_is_refused_with_the_holder_named(tmp_path: Path, holder, monkeypatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    proc = holder(tmp_path / "out", SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="0")
    lock, why = output_lock.acquire(tmp_path / "out")
    assert lock is None and why is not None
    assert "Slurm job 4242 (restart 0)" in why and f"pid {proc.pid}" in why and "HINT:" in why, why
    assert "\n" not in why


def test_a_lock_left_by_a_killed_holder_is_taken_over(tmp_path: Path, holder) -> None:
    proc = holder(tmp_path / "out")
    proc.send_signal(signal.SIGKILL)
    proc.wait(HOLDER_START_TIMEOUT_S)
    assert json.loads(output_lock.lock_path(tmp_path / "out").read_text())["pid"] == proc.pid  # still named
    lock, why = output_lock.acquire(tmp_path / "out")
    assert lock is not None and why is None
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    output_lock.release(lock)
    assert lock.path.read_text() == ""  # released: empty, free for the next one


def test_a_requeued_run_of_the_same_job_takes_over_a_lock_still_held(tmp_path: Path, holder,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The earlier run's lock still held (a dead node's NFS lease): same job, another restart count, another host
    # (the holder's name rewritten under its live lock: a second host cannot be had here).
    holder(tmp_path / "out", SLURM_JOB_ID="77", SLURM_RESTART_COUNT="0")
    path = output_lock.lock_path(tmp_path / "out")
    path.write_text(json.dumps({**json.loads(path.read_text()), "host": "node-gone"}))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert output_lock.acquire(tmp_path / "out")[0] is None  # the same run twice: refused
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock, why = output_lock.acquire(tmp_path / "out")
    assert lock is not None and why is None
    output_lock.release(lock)
    monkeypatch.setenv("SLURM_JOB_ID", "78")  # another job: refused
    assert output_lock.acquire(tmp_path / "out")[0] is None


def test_without_locking_the_named_holder_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The one fake: a file system that cannot lock (Lustre without -o flock) cannot be mounted here.
    def no_lock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "lockf", no_lock)
    path = output_lock.lock_path(tmp_path / "out")
    path.parent.mkdir(parents=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        path.write_text(json.dumps({"job_id": None, "restart_count": None, "host": os.uname().nodename,
                                    "pid": alive.pid, "since": time.time()}))
        lock, why = output_lock.acquire(tmp_path / "out")
        assert lock is None and why is not None and f"remove {path}" in why, why
    finally:
        alive.kill()
        alive.wait()
    lock, why = output_lock.acquire(tmp_path / "out")  # its pid is gone: stale
    assert lock is not None, why
    output_lock.release(lock)


HOLD_AND_FORK = """\
import os, sys, time
from slurm_jit.train import output_lock
lock, why = output_lock.acquire(sys.argv[1])
if os.fork() == 0:  # a DataLoader worker: forked after the lock was taken, outlives its parent
    time.sleep(600)
    os._exit(0)
print("held", flush=True)
time.sleep(600)
"""


def test_a_forked_child_does_not_keep_a_killed_holders_lock(tmp_path: Path) -> None:
    # With flock the lock belonged to the open file, shared by every forked DataLoader worker: a worker that
    # outlived a SIGKILLed rank 0 kept the output directory locked, and the requeued run was refused.
    proc = subprocess.Popen([sys.executable, "-c", HOLD_AND_FORK, str(tmp_path / "out")], stdout=subprocess.PIPE,
                            text=True, env=_env(), start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        proc.send_signal(signal.SIGKILL)  # the holder only: its forked child lives on
        proc.wait(HOLDER_START_TIMEOUT_S)
        lock, why = output_lock.acquire(tmp_path / "out")
        assert lock is not None and why is None, why
        output_lock.release(lock)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
def test_a_read_only_output_dir_is_one_line_with_a_hint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(out)], check=True, timeout=60)
    try:
        lock, why = output_lock.acquire(out)
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False, timeout=60)
    assert lock is None and why is not None
    assert "cannot be written (Read-only file system" in why and "HINT:" in why and "\n" not in why, why


def test_a_second_trainer_in_this_process_is_refused_and_keeps_the_first_lock(tmp_path: Path) -> None:
    # POSIX locks belong to the process: a second lockf from this process succeeds, and closing its descriptor
    # drops the first trainer's lock, so a launch elsewhere would be let in while the first one trains.
    first, why = output_lock.acquire(tmp_path / "out")
    assert first is not None, why
    try:
        second, why = output_lock.acquire(tmp_path / "out")
        assert second is None and why is not None, "a second trainer in this process took the same output_dir"
        assert "this process" in why and "HINT:" in why and "\n" not in why, why
        probe = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(600)", ""), str(tmp_path / "out")],
                               capture_output=True, text=True, env=_env(), timeout=HOLDER_START_TIMEOUT_S)
        assert probe.stdout.strip() != "held", "the first trainer's lock was dropped by the refused second one"
    finally:
        output_lock.release(first)
    again, why = output_lock.acquire(tmp_path / "out")  # released: this process may take it again
    assert again is not None, why
    output_lock.release(again)


def test_a_requeued_run_on_the_same_host_waits_for_a_live_earlier_run(tmp_path: Path, holder,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A busy lock whose holder is on THIS host is held by a live process (the kernel drops a dead one's): an
    # earlier run of this job still tearing down. Taking it over would let two trainings write, and when the old
    # one released, nobody would hold the lock at all.
    monkeypatch.setattr(output_lock, "EARLIER_RUN_WAIT_S", 1.0)
    proc = holder(tmp_path / "out", SLURM_JOB_ID="77", SLURM_RESTART_COUNT="0")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock, why = output_lock.acquire(tmp_path / "out")
    assert lock is None and why is not None, "took over a lock its live holder on this host still held"
    assert "Slurm job 77 (restart 0)" in why and f"pid {proc.pid}" in why and "\n" not in why, why
    monkeypatch.setattr(output_lock, "EARLIER_RUN_WAIT_S", 30.0)
    threading.Timer(1.0, proc.kill).start()  # the earlier run ends during the wait: the lock is taken, for real
    t0 = time.monotonic()
    lock, why = output_lock.acquire(tmp_path / "out")
    assert lock is not None and lock.locked, why
    assert time.monotonic() - t0 < 20.0  # it waited for the holder's end, not for the whole wait
    output_lock.release(lock)
