"""Row "SIGKILL in an async periodic save" (issue #23): ``tools/faults --only async-kills`` (also in the full run).

One chain of trials in one output directory, ``JitConfig(async_periodic_saves=True)`` with a periodic save every
step on 2 ZeRO-2 ranks. Each trial resumes (``--resume``), lets the run's first async save commit, and kills in the
run's second one (the target):

- at a named instant (:mod:`slurm_jit.train.async_save.fault_points`: inside the staging, before the deferred copies
  (the next optimizer step held), inside the background write, between the ranks' done markers, during rank 0's
  manifest), hit deterministically: the save stalls there (``SLURM_JIT_FAULT_ASYNC``), the harness waits for the
  stall's log line and SIGKILLs both ranks or one (the other a second later); the target must then be
  ``incomplete``, never ``corrupt`` nor ``complete``;
- at a random instant: both ranks a random fraction of the measured async save (sentinel to manifest) after the
  target's sentinel appeared, the background write slowed by ``SLURM_JIT_FAULT_SAVE_SLEEP_S`` (a slow disk, and a
  second periodic save due while one is in flight: the run waits, logged; the chain's last run must log it); the
  target may be either. ``save_total_limit=2``: rank 0's thread rotates after each commit, kills land there too.

After each kill ckpt-check (quick and ``--deep``) must agree, call nothing ``corrupt``, and resume from the newest
truly complete checkpoint; the next trial resumes from it. At the end the chain runs to its last step and every
loss it ever logged (retrained steps too) must equal the uninterrupted run's bitwise, and its last checkpoint the
uninterrupted run's (:mod:`slurm_jit.exactness`).
"""

from __future__ import annotations

import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from slurm_jit import exactness, local_ranks
from slurm_jit.checkpoint import protocol
from slurm_jit.faults import common
from slurm_jit.train.async_save import fault_points
from slurm_jit.train.save_path import FAULT_SAVE_SLEEP_ENV

NAME = "async-kills"  # tools/faults --only async-kills
ROW_NAME = "SIGKILL in an async periodic save"
# (point, the rank that stalls (None: both), the ranks SIGKILLed first): 12 named instants
NAMED = [("stage", None, (0, 1)), ("stage", None, (1,)), ("copy", None, (0, 1)), ("copy", 1, (1,)),
         ("write", None, (0, 1)), ("write", None, (0,)),
         ("write", 1, (1,)), ("marker", 1, (0, 1)), ("marker", 1, (0,)), ("marker", 0, (0, 1)),
         ("manifest", 0, (0, 1)), ("manifest", 0, (0,))]
FULL_RANDOM = 10  # + 10 random instants: the 20, and more
QUICK_NAMED, QUICK_RANDOM = 4, 2
STALL_S = 300  # longer than the kill takes to come
SLOW_DISK_S = 1.0  # every async save's background write stalls this long: the random instants' window
SLACK = 1.3  # the random instant spans the measured save and a bit more: also just after its commit
SURVIVOR_S = 1.0  # after a one-rank kill, how long the other may act on it (it must claim nothing) before its own
WIDTH, LAYERS = 128, 2
TOTAL_LIMIT = 2  # rotation runs in rank 0's background thread after each commit: kills land in it too
PILE_UP = "waits for the async save of step"  # the log line of a save due while the previous one is in flight


@dataclass(frozen=True)
class _Trial:
    point: str | None  # None: a random instant
    stall_rank: int | None = None
    first: tuple[int, ...] = (0, 1)


def _args(trials: int) -> list[str]:
    return ["--zero-stage", "2", "--max-steps", str(2 * trials + 4), "--save-steps", "1", "--save-total-limit",
            str(TOTAL_LIMIT), "--width", str(WIDTH), "--layers", str(LAYERS), "--kill-wait", "0",
            "--async-periodic-saves"]


def _resume_point(out: Path) -> int:
    resume = common.ckpt_check(out).get("resume_from")
    return int(Path(resume).name.split("-")[1]) if resume else 0


def _ckpt(out: Path, step: int) -> Path:
    return out / f"checkpoint-{step}"


def _stalled(ranks: local_ranks.Ranks, step: int, trial: _Trial) -> bool:
    who = (0, 1) if trial.stall_rank is None else (trial.stall_rank,)
    return all(fault_points.STALLED % (trial.point, step, r) in ranks.logs[r].read_text(errors="replace")
               for r in who)


def _kill(ranks: local_ranks.Ranks, first: tuple[int, ...]) -> None:
    for rank in first:
        ranks.signal(rank, signal.SIGKILL)
    if len(first) < len(ranks.procs):
        time.sleep(SURVIVOR_S)
    for rank in range(len(ranks.procs)):
        ranks.signal(rank, signal.SIGKILL)
    ranks.wait(30)


def _one_trial(out: Path, args: list[str], trial: _Trial, rng: random.Random, tally: common.Tally,
               save_times: list[float]) -> None:
    start = _resume_point(out)
    first, target = start + 1, start + 2
    env = {FAULT_SAVE_SLEEP_ENV: str(SLOW_DISK_S)}
    if trial.point is not None:
        env[fault_points.FAULT_ASYNC_ENV] = f"{trial.point}:{target}:{STALL_S}" + (
            "" if trial.stall_rank is None else f":{trial.stall_rank}")
    what = f"trial from step {start} ({trial.point or 'random'}, kill {trial.first})"
    ranks = common.start(out, [*args, "--resume"], env=common.env_with(**env))
    try:
        sentinel = _ckpt(out, first) / protocol.SENTINEL_NAME
        if not common.wait_until(sentinel.exists, ranks):
            tally.fail(f"{what}: the save of step {first} never began")
            return
        t0 = time.monotonic()
        if not common.wait_until(lambda: (_ckpt(out, first) / protocol.MANIFEST_NAME).exists(), ranks):
            tally.fail(f"{what}: the async save of step {first} was never committed")
            return
        save_times.append(time.monotonic() - t0)
        if trial.point is None:
            if not common.wait_until((_ckpt(out, target) / protocol.SENTINEL_NAME).exists, ranks):
                tally.fail(f"{what}: the save of step {target} never began")
                return
            time.sleep(rng.uniform(0.0, save_times[-1] * SLACK))
        elif not common.wait_until(lambda: _stalled(ranks, target, trial), ranks):
            tally.fail(f"{what}: never stalled at {trial.point} of checkpoint-{target}")
            return
    finally:
        _kill(ranks, trial.first)
    tally.trials += 1
    _judge(out, target, trial, what, tally)


def _judge(out: Path, target: int, trial: _Trial, what: str, tally: common.Tally) -> None:
    quick, quick_status, deep_status = common.checked(out, tally, f"{what}: ")
    for step, status in quick_status.items():
        if status == "corrupt" or deep_status.get(step) == "corrupt":
            tally.fail(f"{what}: checkpoint-{step} called corrupt (it was being written)")
    if trial.point is not None and quick_status.get(target) != "incomplete":
        tally.false_complete += int(quick_status.get(target) == "complete")
        tally.fail(f"{what}: checkpoint-{target}, killed at {trial.point}, is {quick_status.get(target)}")
    newest = max((step for step, status in deep_status.items() if status == "complete"), default=0)
    resume = quick.get("resume_from")
    resumed = int(Path(resume).name.split("-")[1]) if resume else 0
    if resumed != newest or newest < target - 1:
        tally.lost_steps += max(0, max(newest, target - 1) - resumed)
        tally.fail(f"{what}: resume from {resumed}, newest complete {newest}")
    for ckpt in out.glob("checkpoint-*"):  # the killed save out of the way, as the resume's quarantine would
        suffix = ckpt.name.removeprefix("checkpoint-")
        if ckpt.is_dir() and (not suffix.isdigit() or deep_status.get(int(suffix)) != "complete"):
            shutil.rmtree(ckpt)


def _trials(quick: bool, rng: random.Random) -> list[_Trial]:
    named = [_Trial(point, rank, first) for point, rank, first in NAMED]
    if quick:
        named = named[::len(NAMED) // QUICK_NAMED][:QUICK_NAMED]
    trials = named + [_Trial(None) for _ in range(QUICK_RANDOM if quick else FULL_RANDOM)]
    rng.shuffle(trials)
    return trials


def run_row(root: Path, quick: bool, seed: int = 2300) -> common.Row:
    """The row: the reference run, the chain of trials, the chain's end compared bitwise."""
    t0 = time.monotonic()
    tally, rng = common.Tally(), random.Random(seed)
    save_times: list[float] = []
    trials = _trials(quick, rng)
    args = _args(len(trials))
    reference, out = common.fresh(root / "reference"), common.fresh(root / "chain")
    codes, log = common.run(reference, [a for a in args if a != "--async-periodic-saves"])
    if codes != [0, 0]:
        tally.fail(f"reference run exited {codes}: {log[-300:]}")
    else:
        for trial in trials:
            _one_trial(out, args, trial, rng, tally, save_times)
        _chain_end(out, reference, args, tally)
    shown = f"async saves of {min(save_times):.1f}-{max(save_times):.1f} s" if save_times else "no save timed"
    named = sum(t.point is not None for t in trials)
    detail = (f"{named} named instants (stage, before the deferred copies, write, between the ranks' markers, rank "
              f"0's manifest; both ranks or one SIGKILLed) + {len(trials) - named} random ones, ZeRO-2, a save "
              f"every step, the background write slowed {SLOW_DISK_S:g} s, {shown}; ckpt-check quick vs --deep, "
              "never corrupt, resume from the newest "
              "complete; the chain's every loss and its last checkpoint equal the uninterrupted run's bitwise")
    return tally.row(ROW_NAME, detail, time.monotonic() - t0)


def _chain_end(out: Path, reference: Path, args: list[str], tally: common.Tally) -> None:
    codes, log = common.run(out, [*args, "--resume"], env=common.env_with(**{FAULT_SAVE_SLEEP_ENV: str(SLOW_DISK_S)}))
    if codes != [0, 0]:
        tally.fail(f"the chain's last run exited {codes}: {log[-300:]}")
        return
    if PILE_UP not in log:  # the slow disk: each save is due while the previous one is in flight
        tally.fail(f"no save waited for the one in flight (no '{PILE_UP}' in the log)")
    why = common.compare_losses(common.losses(out), common.losses(reference))
    if why:
        tally.fail(why)
    last = max(int(p.name.split("-")[1]) for p in reference.glob("checkpoint-*") if p.name.split("-")[1].isdigit())
    try:
        comparison = exactness.compare(_ckpt(out, last), _ckpt(reference, last), unpickle=True)
    except exactness.BadInput as exc:
        tally.fail(f"checkpoint-{last}: {exc}")
        return
    if not comparison.equal:
        tally.fail(f"checkpoint-{last}: {exactness.report(comparison)}")
