"""The output-directory lock (train/output_lock.py): real POSIX locks between real processes, a real read-only
mount.

A lock holder is a child process that takes the lock through the module and sleeps; the test takes it again in
this process. About 3 s. The trainer-level path (a second 2-rank launch refused while the first trains, a
read-only output_dir refused before any step) runs in tools/faults --quick (tests/faults/test_faults.py).
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
from collections.abc import Callable, Iterator
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
# A requeued run that takes the lock over, on a host named by argv[3] ("": this one), retrying the kernel lock every
# argv[2] seconds; it releases the lock at a line on stdin and says whether its retry thread is still alive.
TAKE_OVER = """\
import socket, sys
from slurm_jit.train import output_lock
output_lock.TAKEOVER_RETRY_S = float(sys.argv[2])
if sys.argv[3]:
    socket.gethostname = lambda: sys.argv[3]
lock, why = output_lock.acquire(sys.argv[1])
print(why if lock is None else "locked" if lock.locked else "took over", flush=True)
sys.stdin.readline()
output_lock.release(lock)
print("released, retrying:", lock.retry is not None and lock.retry.is_alive(), flush=True)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """Child processes to kill after the test, whatever happens."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(HOLDER_START_TIMEOUT_S)


@pytest.fixture
def holder(started: list[subprocess.Popen[str]]) -> Callable[..., subprocess.Popen[str]]:
    def start(out: Path, **env: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True,
                                env=_env(**env))
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()  # blocks until the child has the lock (or was refused)
        assert line == "held", line
        return proc

    return start


@pytest.fixture
def taker(started: list[subprocess.Popen[str]]) -> Callable[..., subprocess.Popen[str]]:
    """A requeued run of job 77 (restart 1) that takes over the lock of its earlier run."""
    def start(out: Path, retry_s: float, host: str = "", job_id: str = "77") -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", TAKE_OVER, str(out), str(retry_s), host],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=_env(SLURM_JOB_ID=job_id, SLURM_RESTART_COUNT="1"))
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line == "took over", line
        return proc

    return start


def _earlier_run_on_a_dead_node(holder: Callable[..., subprocess.Popen[str]], out: Path,
                                job_id: str = "77") -> subprocess.Popen[str]:
    """Restart 0 of the job, its lock held as a dead node's NFS lease holds it until the lease ends (killing it
    ends it). Its host is renamed under its live lock: a second host cannot be had here."""
    proc = holder(out, SLURM_JOB_ID=job_id, SLURM_RESTART_COUNT="0")
    path = output_lock.lock_path(out)
    path.write_text(json.dumps({**json.loads(path.read_text()), "host": "node-gone"}))
    return proc


def _end(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(HOLDER_START_TIMEOUT_S)


def _record(out: Path) -> dict[str, object]:
    text = output_lock.lock_path(out).read_text()
    return json.loads(text) if text.strip() else {}


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


# ------------------------------------------------ a takeover, and the third job after the earlier run's lease ends

def test_a_third_job_is_refused_while_the_run_that_took_over_lives(tmp_path: Path, holder, taker,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the requeued run that took over never held the kernel lock; when the dead node's lease ended, a third
    # job found it free and trained into the same directory.
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    out = tmp_path / "out"
    earlier = _earlier_run_on_a_dead_node(holder, out)
    requeued = taker(out, retry_s=600)  # on this host; its retry does not come before the third job
    _end(earlier)  # the lease ends: the kernel lock is free
    lock, why = output_lock.acquire(out)
    assert lock is None and why is not None, "a third job took the directory the requeued run trains in"
    assert "Slurm job 77 (restart 1)" in why and f"pid {requeued.pid}" in why, why
    assert "HINT: wait for it to end" in why and f"remove {output_lock.lock_path(out)}" in why, why
    assert "\n" not in why, why
    assert _record(out)["pid"] == requeued.pid  # the refused one wrote nothing
    _end(requeued)  # killed before it had the kernel lock: its record names a process that is gone
    lock, why = output_lock.acquire(out)
    assert lock is not None and lock.locked, why
    output_lock.release(lock)


def test_the_run_that_took_over_holds_the_kernel_lock_once_the_lease_ends(tmp_path: Path, holder,
                                                                         taker) -> None:
    out = tmp_path / "out"
    earlier = _earlier_run_on_a_dead_node(holder, out)
    requeued = taker(out, retry_s=0.05)
    assert _record(out)["kernel_lock"] is False and _record(out)["pid"] == requeued.pid
    _end(earlier)
    deadline = time.monotonic() + HOLDER_START_TIMEOUT_S
    while _record(out).get("kernel_lock") is not True:
        assert time.monotonic() < deadline, f"the requeued run never took the kernel lock: {_record(out)}"
        time.sleep(0.05)
    assert _kernel_lock_busy(out)
    lock, why = output_lock.acquire(out)
    assert lock is None and why is not None and f"pid {requeued.pid}" in why, why
    _end(requeued)  # killed holding the kernel lock: the kernel drops it
    lock, why = output_lock.acquire(out)
    assert lock is not None and lock.locked, why
    output_lock.release(lock)


def _kernel_lock_busy(out: Path) -> bool:
    fd = os.open(output_lock.lock_path(out), os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        assert exc.errno in output_lock.HELD_ERRNOS, exc
        return True
    finally:
        os.close(fd)  # drops it, if this probe took it
    return False


def test_release_ends_the_retry_and_leaves_no_lock_behind(tmp_path: Path, holder, started,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # A retry left running after release would take the lock when the lease ends, in this process; a later lock
    # of this process's (POSIX locks are per process) would then be another's to drop.
    monkeypatch.setattr(output_lock, "TAKEOVER_RETRY_S", 0.05)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    out = tmp_path / "out"
    earlier = _earlier_run_on_a_dead_node(holder, out)
    lock, why = output_lock.acquire(out)
    assert lock is not None and not lock.locked and lock.retry is not None and lock.retry.is_alive(), why
    output_lock.release(lock)
    assert not lock.retry.is_alive() and _record(out)["host"] == "node-gone"  # the record it took over
    _end(earlier)
    time.sleep(0.5)  # ten retry periods
    assert not _kernel_lock_busy(out)


def test_a_run_that_took_over_says_once_that_its_record_names_another(tmp_path: Path, holder,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    # A newcomer that judged it gone (a Slurm that did not know its job) took the directory: nothing here can stop
    # either training, but the one that took over must not go on silently.
    monkeypatch.setattr(output_lock, "TAKEOVER_RETRY_S", 0.05)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    out = tmp_path / "out"
    _earlier_run_on_a_dead_node(holder, out)  # its lease holds the kernel lock throughout
    with caplog.at_level("ERROR", logger=output_lock.__name__):
        lock, why = output_lock.acquire(out)
        assert lock is not None and not lock.locked, why
        try:
            output_lock.lock_path(out).write_text(json.dumps({**_record(out), "job_id": "99", "pid": 4242}))
            deadline = time.monotonic() + HOLDER_START_TIMEOUT_S
            while not any(r.levelname == "ERROR" for r in caplog.records):
                assert time.monotonic() < deadline, "the run that took over never said it lost the directory"
                time.sleep(0.05)
            time.sleep(0.5)  # ten more tries
        finally:
            output_lock.release(lock)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "Slurm job 99" in errors[0] and "HINT:" in errors[0], errors


def test_a_run_that_took_over_releases_and_its_retry_ends(tmp_path: Path, holder, taker) -> None:
    out = tmp_path / "out"
    _earlier_run_on_a_dead_node(holder, out)  # its lease never ends here
    requeued = taker(out, retry_s=0.05)
    assert requeued.stdin is not None and requeued.stdout is not None
    requeued.stdin.write("release\n")
    requeued.stdin.flush()
    assert requeued.stdout.readline().strip() == "released, retrying: False"
    assert requeued.wait(HOLDER_START_TIMEOUT_S) == 0
    assert _record(out)["host"] == "node-gone"  # the record it took over, for the next requeue


def test_a_requeue_after_a_takeover_that_ended_takes_over_again(tmp_path: Path, holder, taker,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: release emptied the record while the dead node's lock still held (NFSv3: until that node reboots):
    # the next requeue found a busy lock naming no one and was refused, for as long as that lock lived.
    out = tmp_path / "out"
    _earlier_run_on_a_dead_node(holder, out)  # its lock never ends here
    requeued = taker(out, retry_s=600)  # restart 1: trains, is stopped at its time limit, releases
    assert requeued.stdin is not None and requeued.stdout is not None
    requeued.stdin.write("release\n")
    requeued.stdin.flush()
    assert requeued.stdout.readline().strip() == "released, retrying: False"
    assert requeued.wait(HOLDER_START_TIMEOUT_S) == 0
    monkeypatch.setenv("SLURM_JOB_ID", "99")  # another job is still refused: the dead node's lock holds
    lock, why = output_lock.acquire(out)
    assert lock is None and why is not None and "Slurm job 77 (restart 0) on host node-gone" in why, why
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setattr(output_lock, "TAKEOVER_RETRY_S", 600.0)
    lock, why = output_lock.acquire(out)
    assert lock is not None and not lock.locked, why
    output_lock.release(lock)  # a second train() of this process takes it over again
    lock, why = output_lock.acquire(out)
    assert lock is not None and not lock.locked, why
    output_lock.release(lock)
    assert _record(out)["host"] == "node-gone"


def test_a_requeue_on_the_same_host_takes_over_from_a_dead_run_that_took_over(tmp_path: Path, holder, taker,
                                                                               monkeypatch) -> None:
    # Restart 1 took over on this host and died (the lease of restart 0 still holds the kernel lock): restart 2
    # used to wait 30 s for a live holder that was not there, then was refused.
    monkeypatch.setattr(output_lock, "EARLIER_RUN_WAIT_S", 5.0)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    out = tmp_path / "out"
    _earlier_run_on_a_dead_node(holder, out)
    _end(taker(out, retry_s=600))
    t0 = time.monotonic()
    lock, why = output_lock.acquire(out)
    assert lock is not None and not lock.locked, why
    assert time.monotonic() - t0 < 2.0  # no wait for a process that is gone
    output_lock.release(lock)


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_a_third_job_asks_slurm_whether_the_run_that_took_over_on_another_host_runs(
        tmp_path: Path, holder, taker, jobs: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_jit import slurm

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    job_id = slurm.run(["sbatch", "--parsable", "--ntasks=1", "--cpus-per-task=1", "--mem=100M", "--time=5",
                        f"--output={tmp_path}/%j.out", "--wrap=sleep 600"]).strip().split(";")[0]
    jobs.append(job_id)
    _until(lambda: slurm.job_state(slurm.show_job(job_id)) == "RUNNING", f"job {job_id} running", timeout_s=600)
    out = tmp_path / "out"
    earlier = _earlier_run_on_a_dead_node(holder, out, job_id=job_id)
    taker(out, retry_s=600, host="node-b", job_id=job_id)  # its pid cannot be checked from here: Slurm says
    _end(earlier)
    lock, why = output_lock.acquire(out)
    assert lock is None and why is not None and f"Slurm job {job_id} (restart 1) on host node-b" in why, why
    slurm.cancel(job_id)
    _until(lambda: slurm.job_state(slurm.show_job(job_id)) in output_lock.JOB_ENDED_STATES, f"job {job_id} ended")
    lock, why = output_lock.acquire(out)
    assert lock is not None and lock.locked, why
    output_lock.release(lock)


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_a_holder_job_whose_name_is_not_utf8_is_still_asked_about(tmp_path: Path, jobs: list[str]) -> None:
    # Before: scontrol's answer, with the job name's byte 0xff, raised UnicodeDecodeError out of acquire() on
    # rank 0 (the other ranks waiting for its verdict).

    argv = [b"sbatch", b"--parsable", b"--ntasks=1", b"--cpus-per-task=1", b"--mem=100M", b"--time=5",
            b"--output=" + os.fsencode(tmp_path) + b"/%j.out", b"--job-name=run-\xff", b"--wrap=sleep 600"]
    job_id = subprocess.run(argv, capture_output=True, check=True, timeout=60).stdout.decode().strip()
    jobs.append(job_id)
    why = _newcomer_refused_while_taken_over_by(job_id, tmp_path / "out")
    assert "HINT:" in why, why


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_a_holder_job_whose_name_spells_another_state_is_still_running(tmp_path: Path, jobs: list[str]) -> None:
    # Before: the name's "JobState=COMPLETED", printed before the real JobState, was taken for it: the third job
    # took the directory the run that took over trains in.
    from slurm_jit import slurm

    job_id = slurm.run(["sbatch", "--parsable", "--ntasks=1", "--cpus-per-task=1", "--mem=100M", "--time=5",
                        f"--output={tmp_path}/%j.out", "--job-name=lr=3e-4 JobState=COMPLETED",
                        "--wrap=sleep 600"]).strip().split(";")[0]
    jobs.append(job_id)
    _newcomer_refused_while_taken_over_by(job_id, tmp_path / "out")
    assert slurm.show_job(job_id)["JobName"] == "lr=3e-4 JobState=COMPLETED"


def _until(done: Callable[[], bool], what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s  # a job waits for the shared cluster's cores
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


# ------------------------------------------------------------------- lock files and records not written by us

@pytest.mark.parametrize("content", [b"[" * 4000, b'{"host": "a\\nb", "pid": 1, "since": 0}',
                                     b'{"host": "h", "pid": 1, "since": NaN}',
                                     b'{"host": "h", "pid": 1, "since": 1e300}'],
                         ids=["nested", "newline-in-host", "since-nan", "since-huge"])
def test_a_record_not_written_by_us_is_refused_in_one_line(tmp_path: Path, holder, content: bytes) -> None:
    # Before: a RecursionError, ValueError or OverflowError out of acquire() on rank 0 (the other ranks waiting for
    # its verdict forever), or a refusal over two lines.
    out = tmp_path / "out"
    holder(out)
    output_lock.lock_path(out).write_bytes(content)
    lock, why = output_lock.acquire(out)
    assert lock is None and why is not None and "HINT:" in why and "\n" not in why, why


@pytest.mark.parametrize(("fields", "taken"), [({"pid": 1}, False), ({"pid": 1, "pid_start": -1}, True),
                                               ({"host": "node-b", "job_id": "not-a-job"}, False),
                                               ({"host": "node-b", "job_id": None}, False)],
                         ids=["pid-1", "pid-1-recycled", "not-a-job-id", "no-job"])
def test_a_free_lock_whose_record_says_it_was_taken_over_is_decided_by_its_holder(
        tmp_path: Path, fields: dict[str, object], taken: bool) -> None:
    # A record written (or forged) by a run that took over, with the kernel lock free: refused while its holder
    # may live, with the file to remove when it is gone; taken when that holder is known gone.
    out = tmp_path / "out"
    path = output_lock.lock_path(out)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"job_id": "77", "restart_count": "1", "host": os.uname().nodename, "pid": 4242,
                                "since": time.time(), "kernel_lock": False, **fields}))
    lock, why = output_lock.acquire(out)
    if taken:
        assert lock is not None and lock.locked, why
        output_lock.release(lock)
        return
    assert lock is None and why is not None, "took a directory its record says another run trains in"
    assert "HINT: wait for it to end" in why and f"remove {path}" in why and "\n" not in why, why
    assert json.loads(path.read_text())["kernel_lock"] is False  # nothing written


def test_without_locking_a_recycled_pid_is_not_the_holder(tmp_path: Path, started,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def no_lock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "lockf", no_lock)
    out = tmp_path / "out"
    path = output_lock.lock_path(out)
    path.parent.mkdir(parents=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    started.append(alive)
    record = {"job_id": None, "restart_count": None, "host": os.uname().nodename, "pid": alive.pid,
              "since": time.time(), "pid_start": _start_ticks(alive.pid)}
    path.write_text(json.dumps(record))
    assert output_lock.acquire(out)[0] is None  # that very process: alive
    path.write_text(json.dumps({**record, "pid_start": record["pid_start"] + 1}))  # its pid, another process
    lock, why = output_lock.acquire(out)
    assert lock is not None, why
    output_lock.release(lock)
    path.write_text(json.dumps({**record, "pid": 2**40}))  # before: OverflowError out of os.kill
    lock, why = output_lock.acquire(out)
    assert lock is not None, why
    output_lock.release(lock)


def _start_ticks(pid: int) -> int:
    """proc(5): /proc/<pid>/stat field 22, the process's start time in clock ticks since boot."""
    return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19])


@pytest.mark.parametrize("kind", ["directory", "symlink", "fifo", "hard link"])
def test_a_lock_path_that_is_not_our_file_is_refused_and_left_alone(tmp_path: Path, kind: str) -> None:
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    out = tmp_path / "out"
    path = output_lock.lock_path(out)
    path.parent.mkdir(parents=True)
    {"directory": path.mkdir, "symlink": lambda: path.symlink_to(precious), "fifo": lambda: os.mkfifo(path),
     "hard link": lambda: os.link(precious, path)}[kind]()
    lock, why = output_lock.acquire(out)
    assert lock is None and why is not None and f"HINT: remove {path}" in why and "\n" not in why, why
    assert precious.read_text() == "keep me"


def _newcomer_refused_while_taken_over_by(job_id: str, out: Path) -> str:
    """Once ``job_id`` runs: a takeover record naming it (on another host) refuses a newcomer in one line; the
    line."""
    from slurm_jit import slurm

    _until(lambda: slurm.run(["squeue", "-h", "-o", "%T", "-j", job_id]).strip() == "RUNNING",  # no name
           f"job {job_id} running", timeout_s=600)
    path = output_lock.lock_path(out)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"job_id": job_id, "restart_count": "1", "host": "node-b", "pid": 4242,
                                "since": time.time(), "kernel_lock": False}))
    lock, why = output_lock.acquire(out)
    assert lock is None and why is not None, "took a directory a running job's run trains in"
    assert f"Slurm job {job_id} (restart 1) on host node-b" in why and "\n" not in why, why
    return why
