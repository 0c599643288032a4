"""Row 6 (and the trials row 5 reads): SIGTERM to the 2 ranks 0, 0.1 and 0.5 s apart, upstream
``enable_jit_checkpoint`` against JitTrainer: checkpoints completed, hangs (killed), crashes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slurm_jit.bench import runs
from slurm_jit.bench.rows import NO_TARGET, Row, measured
from slurm_jit.checkpoint import protocol

DELAYS_S = (0.0, 0.1, 0.5)  # issue 10: signals 0, 0.1 and 0.5 s apart
OURS_KILL_WAIT_S = 1.0  # short trials; row 5 subtracts it, and the agreement does not depend on it
UPSTREAM_KILL_WAIT_S = 3.0  # upstream's JITCheckpointManager: fixed
# A rank alive this long after the last signal plus kill_wait is hung (upstream waits for the collective timeout,
# 30 min); the tiny model's save and teardown take a few seconds.
HANG_AFTER_S = 20.0
OURS_TARGET = ">= 1.0"  # every trial ends with a complete checkpoint, no hang, no crash
TINY_ARGS = ["--width", "64", "--layers", "2", "--heads", "2", "--max-steps", "100000", "--step-sleep", "0.05"]


@dataclass(frozen=True, kw_only=True)
class Trial:
    trainer: str  # "ours" or "upstream"
    delay_s: float
    outcome: runs.Outcome
    completed: bool  # a new checkpoint without the sentinel (ours: complete by the protocol)
    kill_wait_s: float

    @property
    def verdict(self) -> str:
        if self.outcome.hung:
            return "hang"
        return "crash" if not self.outcome.clean else ("completed" if self.completed else "no checkpoint")


def _completed(trainer: str, outcome: runs.Outcome) -> bool:
    if not outcome.new_ckpts:
        return False
    ckpt = outcome.new_ckpts[-1]
    if trainer == "upstream":
        return not (ckpt / protocol.SENTINEL_NAME).exists()
    step = int(ckpt.name.rsplit("-", 1)[1])
    return protocol.inspect(ckpt, step).status is protocol.Status.COMPLETE


def trial(out: Path, trainer: str, delay_s: float) -> Trial:
    if trainer == "ours":
        extra, kill_wait_s = ["--kill-wait", str(OURS_KILL_WAIT_S)], OURS_KILL_WAIT_S
    else:
        extra, kill_wait_s = ["--trainer", "plain", "--upstream-jit"], UPSTREAM_KILL_WAIT_S
    outcome = runs.run(out, [*TINY_ARGS, *extra], plan=(0.0, delay_s), hang_after_s=kill_wait_s + HANG_AFTER_S)
    return Trial(trainer=trainer, delay_s=delay_s, outcome=outcome, completed=_completed(trainer, outcome),
                 kill_wait_s=kill_wait_s)


def run_trials(base: Path, per_delay: int, trainers: tuple[str, ...] = ("ours", "upstream"),
               delays_s: tuple[float, ...] = DELAYS_S) -> list[Trial]:
    return [trial(base / f"{trainer}-{delay_s}-{i}", trainer, delay_s)
            for i in range(per_delay) for delay_s in delays_s for trainer in trainers]


def rows(trials: list[Trial]) -> list[Row]:
    result = []
    for trainer in ("ours", "upstream"):
        mine = [t for t in trials if t.trainer == trainer and t.delay_s in DELAYS_S]
        if not mine:
            continue
        by_delay = {}
        for delay_s in DELAYS_S:
            verdicts = [t.verdict for t in mine if t.delay_s == delay_s]
            by_delay[f"{delay_s:g}s"] = {v: verdicts.count(v) for v in sorted(set(verdicts))}
        done = sum(t.completed and t.outcome.clean for t in mine)
        name = "JitTrainer" if trainer == "ours" else "upstream enable_jit_checkpoint"
        result.append(measured(
            f"staggered_{trainer}_completed", done / len(mine), "fraction",
            OURS_TARGET if trainer == "ours" else NO_TARGET,
            f"{name}: trials ending with a complete checkpoint and a clean exit, SIGTERM to the 2 ranks 0, 0.1, "
            f"0.5 s apart, {len(mine) // len(DELAYS_S)} trial(s) each; a rank alive {HANG_AFTER_S:g} s past "
            "kill_wait after the last signal is a hang (killed)", by_delay=by_delay))
    return result
