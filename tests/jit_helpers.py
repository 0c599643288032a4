"""Helpers for the JitTrainer tests: start real DeepSpeed ranks, signal them as Slurm would, read what they left."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from slurm_jit import local_ranks
from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record

START_TIMEOUT_S = 300  # a fresh machine builds DeepSpeed's CPU comm op on first use (~80 s on 2 cores)
# Not a benchmark: a hang detector. A stop that does not end within this long after the last signal is hung
# (upstream hangs until the 30-minute collective timeout); a healthy one ends within kill_wait + a step + a save.
STOP_DEADLINE_S = 45


def losses(out: Path) -> list[tuple[int, float]]:
    path = out / "losses-rank0.jsonl"
    if not path.exists():
        return []
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines()) if r]


@dataclass
class StopResult:
    codes: list[int | None]
    stop_s: float  # from the first signal until every rank exited
    log: str


def run_to_end(out: Path, args: list[str], env: dict[str, str] | None = None) -> list[int | None]:
    ranks = local_ranks.start(["-m", "slurm_jit.demo_train", "--output-dir", str(out), *args], 2,
                              out.parent / f"logs-{out.name}", env=env)
    return ranks.wait(START_TIMEOUT_S)


def wait_for_steps(ranks: local_ranks.Ranks, out: Path, n: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(losses(out)) < n:
        if any(p.poll() is not None for p in ranks.procs) or time.monotonic() > deadline:
            ranks.kill()
            raise AssertionError(f"training did not reach step {n}:\n{ranks.log(0)[-3000:]}")
        time.sleep(0.05)


def run_and_signal(out: Path, args: list[str], plan: list[tuple[int, float]], after_steps: int = 3,
                   signum: int = signal.SIGTERM, env: dict[str, str] | None = None,
                   wait_until: str | None = None) -> StopResult:
    """Start 2 ranks; once ``after_steps`` are logged (or ``wait_until`` exists), send ``signum`` to each
    (rank, delay-since-previous-signal) of ``plan``, to the rank's whole process group as Slurm does."""
    ranks = local_ranks.start(["-m", "slurm_jit.demo_train", "--output-dir", str(out), *args], 2,
                              out.parent / f"logs-{out.name}", env=env)
    if wait_until is None:
        wait_for_steps(ranks, out, after_steps)
    else:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not list(out.parent.glob(wait_until)) and time.monotonic() < deadline:
            time.sleep(0.02)
    first = time.monotonic()
    for rank, delay in plan:
        time.sleep(delay)
        ranks.signal(rank, signum)
    codes = ranks.wait(STOP_DEADLINE_S + sum(d for _, d in plan))
    stop_s = time.monotonic() - first
    return StopResult(codes=codes, stop_s=stop_s, log=ranks.log(0) + ranks.log(1))


def ckpt_check(out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_jit.checkpoint.ckpt_check", str(out), *flags],
                          capture_output=True, text=True, check=False)


def assert_jit_stop(out: Path, result: StopResult) -> Path:
    """The run stopped for a JIT checkpoint that ckpt-check calls complete, whose DeepSpeed tag is its step."""
    assert result.codes == [0, 0], result.log[-4000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop", record
    ckpt = Path(record["checkpoint"])
    check = ckpt_check(out, "--deep")
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.splitlines()[-1] == str(ckpt)
    info = protocol.inspect(ckpt, record["step"], deep=True)
    assert info.status is protocol.Status.COMPLETE and info.kind == "jit", info
    assert (ckpt / "latest").read_text().strip() == f"global_step{record['step']}"
    # what resume needs, once: no consolidated weights beside the DeepSpeed shards, and the excess is reported
    assert not (ckpt / "model.safetensors").exists()
    manifest = json.loads((ckpt / protocol.MANIFEST_NAME).read_text())
    assert manifest["bytes_needed_for_resume"] + manifest["bytes_weights_duplicate"] == manifest["total_bytes"]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == record["step"]
    return ckpt


def assert_same_losses(resumed: list[tuple[int, float]], reference: list[tuple[int, float]],
                       rel_tol: float = 0.0) -> None:
    """Every step logged once, in order, and each loss equal to the uninterrupted run's (bitwise when 0)."""
    steps = [s for s, _ in resumed]
    assert steps == [s for s, _ in reference], f"steps lost or repeated: {steps}"
    for (step, got), (_, want) in zip(resumed, reference, strict=True):
        if rel_tol == 0.0:
            assert got == want, f"step {step}: {got!r} != {want!r}"
        else:
            assert abs(got - want) <= rel_tol * abs(want), f"step {step}: {got!r} vs {want!r}"


def start_demo(out: Path, args: list[str], world_size: int = 2, log_dir: Path | None = None,
               env: dict[str, str] | None = None) -> local_ranks.Ranks:
    """Start ``world_size`` ranks of demo_train (logs in OUT/../logs-<out name> unless ``log_dir``)."""
    return local_ranks.start(["-m", "slurm_jit.demo_train", "--output-dir", str(out), *args], world_size,
                             log_dir or out.parent / f"logs-{out.name}", env=env)


def wait_for_path(ranks: local_ranks.Ranks, path: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until ``path`` exists; fails (and kills the ranks) when they exit first or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if any(p.poll() is not None for p in ranks.procs) or time.monotonic() > deadline:
            ranks.kill()
            raise AssertionError(f"{path} never appeared:\n{ranks.log(0)[-3000:]}")
        time.sleep(0.02)
