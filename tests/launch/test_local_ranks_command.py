"""``python -m slurm_jit.local_ranks -n 2 -- SCRIPT.py``: the documented way to run ranks outside Slurm. Real
ranks (torch.distributed over gloo), a real SIGTERM forwarded to every rank, and one-line refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

DEADLINE_S = 120
ALL_REDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item():g}", flush=True)
dist.destroy_process_group()
"""
WAIT_FOR_TERM = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print(f"rank {os.environ['RANK']} got SIGTERM", flush=True), sys.exit(0)))
print("ready", flush=True)
time.sleep(60)
sys.exit(3)
"""

ONE_RANK_FAILS = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    sys.exit(3)  # rank 0 would wait for it forever, in a collective
print("ready", flush=True)
time.sleep(120)  # bounded: a failed test leaves no rank behind for long
"""
IGNORES_TERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stuck where no stop is taken (a collective, a C call)
print("ready", flush=True)
time.sleep(120)  # bounded: a failed test leaves no rank behind for long
"""
QUICK_S = 60  # far under the scripts' 120 s sleep: the command did not just wait them out


def local_ranks(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "slurm_jit.local_ranks", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_two_ranks_of_a_script_run_as_documented(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(ALL_REDUCE)
    proc = local_ranks("-n", "2", "--", "python", "script.py", cwd=tmp_path)
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, out + err
    logs = [(tmp_path / "rank-logs" / f"rank{r}.log").read_text() for r in (0, 1)]
    assert "rank 0 of 2: sum 3" in logs[0] and "rank 1 of 2: sum 3" in logs[1], logs
    assert "exit codes [0, 0]" in out


def test_sigterm_reaches_every_rank(tmp_path: Path) -> None:
    (tmp_path / "wait.py").write_text(WAIT_FOR_TERM)
    proc = local_ranks("-n", "2", "--log-dir", "logs", "--", "wait.py", cwd=tmp_path)
    try:
        logs = [tmp_path / "logs" / f"rank{r}.log" for r in (0, 1)]
        deadline = time.monotonic() + DEADLINE_S
        while not all(p.exists() and "ready" in p.read_text() for p in logs):
            assert time.monotonic() < deadline and proc.poll() is None, "ranks never became ready"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    assert [f"rank {r} got SIGTERM" in logs[r].read_text() for r in (0, 1)] == [True, True]


def test_misuse_is_one_line_with_a_hint(tmp_path: Path) -> None:
    for argv in (["-n", "two", "--", "x.py"], ["-n", "2"], ["-n", "2", "--", "missing.py"], ["--ranks", "2"]):
        proc = local_ranks(*argv, cwd=tmp_path)
        out, err = proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 2 and out == "", (argv, out)
        (line,) = err.splitlines()
        assert "HINT:" in line, line
    usage = local_ranks("--help", cwd=tmp_path)
    out, _ = usage.communicate(timeout=DEADLINE_S)
    assert usage.returncode == 0 and "-- SCRIPT.py" in out


def _wait_ready(proc: subprocess.Popen[str], logs: list[Path]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not all(p.exists() and "ready" in p.read_text() for p in logs):
        assert time.monotonic() < deadline and proc.poll() is None, "ranks never became ready"
        time.sleep(0.2)


def test_a_rank_that_fails_ends_the_others_with_its_exit_status(tmp_path: Path) -> None:
    (tmp_path / "fails.py").write_text(ONE_RANK_FAILS)
    proc = local_ranks("-n", "2", "--", "fails.py", cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=QUICK_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3, out + err
    assert "rank 1 exited with 3: the other ranks get SIGTERM" in out and "exit codes [-15, 3]" in out, out


def test_a_second_signal_kills_ranks_that_take_no_sigterm(tmp_path: Path) -> None:
    (tmp_path / "stuck.py").write_text(IGNORES_TERM)
    proc = local_ranks("-n", "2", "--", "stuck.py", cwd=tmp_path)
    try:
        _wait_ready(proc, [tmp_path / "rank-logs" / f"rank{r}.log" for r in (0, 1)])
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None, "one SIGTERM is forwarded, not a kill"
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=QUICK_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "every rank SIGKILLed" in out and "exit codes [-9, -9]" in out, out + err
    assert proc.returncode == 128 + signal.SIGKILL, out


def test_a_script_whose_name_starts_with_python_is_run(tmp_path: Path) -> None:
    (tmp_path / "python_train.py").write_text("import os; print('rank', os.environ['RANK'], 'ran')")
    proc = local_ranks("-n", "1", "--", "python_train.py", cwd=tmp_path)
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, out + err
    assert "rank 0 ran" in (tmp_path / "rank-logs" / "rank0.log").read_text()


def test_a_log_dir_that_cannot_be_one_is_one_line_and_starts_no_rank(tmp_path: Path) -> None:
    # Before: FileExistsError / NotADirectoryError tracebacks out of start(); a rank log that could not be opened
    # after the first ranks were started left them running.
    (tmp_path / "marks.py").write_text("open(f\"ran-{__import__('os').environ['RANK']}\", 'w').close()")
    (tmp_path / "a-file").write_text("")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank1.log").mkdir()  # rank 0's log opens, rank 1's cannot
    for log_dir in ("a-file", "a-file/sub", "logs"):
        proc = local_ranks("-n", "2", "--log-dir", log_dir, "--", "marks.py", cwd=tmp_path)
        out, err = proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 2 and out == "" and "Traceback" not in err, (log_dir, err)
        (line,) = err.splitlines()
        assert log_dir in line and "HINT:" in line, line
    time.sleep(1.0)  # a rank started by mistake would have written its mark by now
    assert not list(tmp_path.glob("ran-*"))
