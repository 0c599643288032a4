"""Row 5: signal storms against real ranks, each followed by a resume whose losses must equal the uninterrupted
run's: ten SIGTERMs within a second; SIGTERM then SIGKILL inside kill_wait (no checkpoint begun, the previous ones
intact); SIGTERM to one rank only; SIGUSR1, SIGUSR2 and SIGHUP, which are not stop signals (Python's default
action ends the process: the run dies like a crash, and the last complete checkpoint is what resumes)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from slurm_jit import local_ranks
from slurm_jit.faults import common
from slurm_jit.train import stop_record

KILL_WAIT_S = 3.0
SAVE_STEPS = 5
# Steps of >= 0.3 s: the first full run (steps of 0.05 s) reached its last step within kill_wait after the storm,
# finished normally, and its "resume" of the finished run trained a step 31 the reference never had: a false FAIL.
ARGS = ["--zero-stage", "2", "--max-steps", "30", "--save-steps", str(SAVE_STEPS), "--step-sleep", "0.3", "--kill-wait",
        str(KILL_WAIT_S)]
STORM_SIGNALS = 10
STORM_SPAN_S = 1.0


def _periodic_step(name: str) -> bool:
    """``checkpoint-N``, or one set aside (``checkpoint-N.incomplete...``, ``checkpoint-N.superseded-K``), at a
    periodic save's step."""
    step = name.removeprefix("checkpoint-").split(".")[0]
    return step.isdigit() and int(step) % SAVE_STEPS == 0


def _storm(ranks: local_ranks.Ranks) -> None:
    for _ in range(STORM_SIGNALS):
        for rank in range(len(ranks.procs)):
            ranks.signal(rank, signal.SIGTERM)
        time.sleep(STORM_SPAN_S / STORM_SIGNALS)


def _term_then_kill(ranks: local_ranks.Ranks) -> None:
    for rank in range(len(ranks.procs)):
        ranks.signal(rank, signal.SIGTERM)
    time.sleep(KILL_WAIT_S / 2)
    for rank in range(len(ranks.procs)):
        ranks.signal(rank, signal.SIGKILL)


def _one_rank(ranks: local_ranks.Ranks) -> None:
    ranks.signal(1, signal.SIGTERM)


def _unrelated(ranks: local_ranks.Ranks) -> None:
    for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        for rank in range(len(ranks.procs)):
            ranks.signal(rank, signum)
        time.sleep(0.3)


SCENARIOS: list[tuple[str, Callable[[local_ranks.Ranks], None], bool]] = [  # (name, fault, a JIT stop expected)
    ("10 SIGTERMs in 1 s", _storm, True),
    ("SIGTERM then SIGKILL inside kill_wait", _term_then_kill, False),
    ("SIGTERM to rank 1 only", _one_rank, True),
    ("SIGUSR1+SIGUSR2+SIGHUP", _unrelated, False),
]


def _scenario(root: Path, name: str, fault: Callable[[local_ranks.Ranks], None], jit_stop: bool,
              reference: list[tuple[int, float]], tally: common.Tally) -> str:
    out = common.fresh(root / name.replace(" ", "-")) / "out"
    ranks = common.start(out, ARGS)
    try:
        if not common.wait_until(lambda: len(common.losses(out)) >= 7, ranks):  # past the periodic save of 5
            tally.fail(f"{name}: never reached step 7")
            return f"{name}: not run"
        dirs_before = {p.name for p in out.glob("checkpoint-*")}
        fault(ranks)
        codes = ranks.wait(common.START_TIMEOUT_S)
    finally:
        ranks.kill()
    tally.trials += 1
    record = stop_record.read(out) or {}
    check = common.ckpt_check(out, "--deep")
    quick = common.ckpt_check(out)
    for step, status in common.statuses(quick).items():
        if status == "complete" and common.statuses(check).get(step) != "complete":
            tally.false_complete += 1
    newest = quick.get("resume_from")
    if jit_stop:
        tally.check(codes == [0, 0] and record.get("state") == "jit_stop", f"{name}: exit {codes}, {record}")
        tally.check(newest is not None and newest == record.get("checkpoint"), f"{name}: resume {newest}")
    else:
        # Training goes on during kill_wait, so a periodic save (every SAVE_STEPS) may land in it and finish or be
        # cut by the SIGKILL: only a JIT checkpoint is "begun" by the stop (seen: checkpoint-10, periodic, complete).
        new_dirs = {p.name for p in out.glob("checkpoint-*")} - dirs_before
        kinds = {Path(c["path"]).name: c.get("kind") for c in quick["checkpoints"]}
        jit_begun = {d for d in new_dirs if kinds.get(d) == "jit" or not _periodic_step(d)}
        tally.check(not jit_begun or name.startswith("SIGUSR"), f"{name}: a JIT checkpoint was begun: {jit_begun}")
        tally.check(record.get("state") != "jit_stop", f"{name}: a JIT stop recorded: {record}")
        tally.check(newest is not None and newest.endswith(("checkpoint-5", "checkpoint-10", "checkpoint-15")),
                    f"{name}: resume {newest}")
    resumed_codes, _ = common.run(out, [*ARGS, "--resume"])
    why = common.compare_losses(common.losses(out), reference)
    tally.check(resumed_codes == [0, 0] and why is None, f"{name}: resume exited {resumed_codes}: {why}")
    return f"{name}: exit {codes}, {record.get('state')}, resumed from {Path(newest).name if newest else None}"


def run_row(root: Path) -> common.Row:
    t0 = time.monotonic()
    tally = common.Tally()
    ref_out = common.fresh(root / "storms-reference") / "out"
    codes, log = common.run(ref_out, ARGS)
    if codes != [0, 0]:
        tally.fail(f"reference exited {codes}: {log[-300:]}")
        return tally.row("signal storms", "", time.monotonic() - t0)
    reference = common.losses(ref_out)
    seen = [_scenario(root, name, fault, jit, reference, tally) for name, fault, jit in SCENARIOS]
    detail = "; ".join(seen) + "; every resume's losses (retrained steps too) equal the uninterrupted run's"
    return tally.row("signal storms", detail, time.monotonic() - t0)
