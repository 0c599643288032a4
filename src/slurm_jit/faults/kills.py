"""Row 1: SIGKILL to every rank at a random instant inside a checkpoint save, in chains of trials.

A chain is one output directory. Each trial resumes (``--resume``), lets the first save of the run complete
(timing it: sentinel created to sentinel removed), then kills both ranks' process groups a random fraction of that
time after the second save's sentinel appeared. ckpt-check then judges the directory (quick and ``--deep``): the
killed checkpoint may be complete only when the kill came after its manifest, and the resume point must be the
newest checkpoint that was truly complete. The next trial resumes from it. At the end the chain runs to its last
step, and every loss it ever logged (retrained steps too) must equal the uninterrupted run's, bitwise.
"""

from __future__ import annotations

import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from slurm_jit.checkpoint import protocol
from slurm_jit.faults import common

FULL_TRIALS_PER_STAGE = 25  # 50 kills in all: the minimum
FULL_WIDTH, FULL_LAYERS = 768, 4  # ~30 M parameters: a 0.57 GB checkpoint, saved in 1.5-3.7 s on 2 loaded cores
SAVE_TIME_SLACK = 1.2  # the random instant spans the measured save time and a bit more: also just after it


@dataclass(frozen=True, kw_only=True)
class Chain:
    """One chain of trials: a ZeRO stage, a model size whose save takes the time wanted, how many kills."""

    zero_stage: int
    trials: int
    width: int  # hidden size of the tiny GPT-2: the state (and so the save time) grows with its square
    layers: int

    def args(self) -> list[str]:
        max_steps = 2 * self.trials + 4  # each trial moves the chain on by one to two steps
        return ["--zero-stage", str(self.zero_stage), "--max-steps", str(max_steps), "--save-steps", "1",
                "--save-total-limit", "2", "--width", str(self.width), "--layers", str(self.layers),
                "--kill-wait", "0"]


def _resume_point(out: Path) -> int:
    check = common.ckpt_check(out)
    resume = check.get("resume_from")
    return int(Path(resume).name.split("-")[1]) if resume else 0


def _sentinel(out: Path, step: int) -> Path:
    return out / f"checkpoint-{step}" / protocol.SENTINEL_NAME


def _one_trial(out: Path, chain: Chain, rng: random.Random, tally: common.Tally, save_times: list[float]) -> None:
    start_step = _resume_point(out)
    first, target = start_step + 1, start_step + 2
    ranks = common.start(out, [*chain.args(), "--resume"])
    try:
        if not common.wait_until(_sentinel(out, first).exists, ranks):
            tally.fail(f"trial from step {start_step}: the save of step {first} never began")
            return
        t0 = time.monotonic()
        common.wait_until(lambda: (out / f"checkpoint-{first}" / protocol.MANIFEST_NAME).exists()
                          and not _sentinel(out, first).exists(), ranks)
        save_times.append(time.monotonic() - t0)
        if not common.wait_until(_sentinel(out, target).exists, ranks):
            tally.fail(f"trial from step {start_step}: the save of step {target} never began")
            return
        time.sleep(rng.uniform(0.0, save_times[-1] * SAVE_TIME_SLACK))
    finally:
        for rank in range(len(ranks.procs)):
            ranks.signal(rank, signal.SIGKILL)
        ranks.wait(30)
    tally.trials += 1
    _judge(out, first, target, tally)


def _judge(out: Path, first: int, target: int, tally: common.Tally) -> None:
    quick, quick_status, deep_status = common.checked(out, tally)
    # the kill may land after the target's manifest, even after a later save: the newest truly complete one
    truly_newest = max((step for step, status in deep_status.items() if status == "complete"), default=0)
    if truly_newest < first:  # the save finished before the kill (it may since have been rotated away)
        tally.fail(f"checkpoint-{first}, finished before the kill, is {quick_status.get(first)}")
    resume = quick.get("resume_from")
    resumed = int(Path(resume).name.split("-")[1]) if resume else 0
    if resumed != truly_newest:
        tally.lost_steps += max(0, truly_newest - resumed)
        tally.fail(f"after a kill in the save of {target}: resume from {resumed}, newest complete {truly_newest}")
    for ckpt in out.glob("checkpoint-*"):  # judged: the killed save out of the way (disk), as quarantine would
        suffix = ckpt.name.removeprefix("checkpoint-")
        if ckpt.is_dir() and (not suffix.isdigit() or deep_status.get(int(suffix)) != "complete"):
            shutil.rmtree(ckpt)


def run_chain(root: Path, chain: Chain, seed: int, tally: common.Tally, save_times: list[float],
              keep_sample: Path | None) -> None:
    """Reference run, the trials, the chain's end; losses compared; one complete checkpoint kept as a sample."""
    reference = common.fresh(root / f"zero{chain.zero_stage}-reference")
    codes, log = common.run(reference, chain.args())
    if codes != [0, 0]:
        tally.fail(f"ZeRO-{chain.zero_stage} reference run exited {codes}: {log[-300:]}")
        return
    out = common.fresh(root / f"zero{chain.zero_stage}-chain")
    rng = random.Random(seed)
    for _ in range(chain.trials):
        _one_trial(out, chain, rng, tally, save_times)
    codes, log = common.run(out, [*chain.args(), "--resume"])
    if codes != [0, 0]:
        tally.fail(f"ZeRO-{chain.zero_stage} chain's last run exited {codes}: {log[-300:]}")
        return
    why = common.compare_losses(common.losses(out), common.losses(reference))
    if why:
        tally.fail(f"ZeRO-{chain.zero_stage}: {why}")
    if keep_sample is not None:
        newest = common.ckpt_check(out).get("resume_from")
        if newest:
            shutil.copytree(newest, keep_sample / Path(newest).name, symlinks=True)
    shutil.rmtree(reference)


def run_row(root: Path, quick: bool, sample: Path, trials_per_stage: int = FULL_TRIALS_PER_STAGE,
            ) -> tuple[common.Row, list[str]]:
    """Row 1 (full: ``trials_per_stage`` under ZeRO-2 and as many under ZeRO-3; quick: 2 under ZeRO-2, a small
    state), and the arguments that resume the complete checkpoint it leaves in ``sample`` (for rows 3 and 7)."""
    t0 = time.monotonic()
    chains = ([Chain(zero_stage=2, trials=2, width=64, layers=2)] if quick else
              [Chain(zero_stage=2, trials=trials_per_stage, width=FULL_WIDTH, layers=FULL_LAYERS),
               Chain(zero_stage=3, trials=trials_per_stage, width=FULL_WIDTH, layers=FULL_LAYERS)])
    tally = common.Tally()
    save_times: list[float] = []
    for i, chain in enumerate(chains):
        run_chain(root, chain, seed=1000 + i, tally=tally, save_times=save_times,
                  keep_sample=sample if i == 0 else None)
    shown = (f"saves of {min(save_times):.1f}-{max(save_times):.1f} s (median "
             f"{sorted(save_times)[len(save_times) // 2]:.1f} s)") if save_times else "no save timed"
    detail = (f"SIGKILL to both ranks at a random instant in the save (0-{SAVE_TIME_SLACK:.0%} of the measured "
              f"save time after its sentinel appeared), {' + '.join(f'{c.trials} ZeRO-{c.zero_stage}' for c in chains)}"
              f" trials, width {chains[0].width} x {chains[0].layers} layers, {shown}; ckpt-check quick vs --deep "
              "after each; each chain's every logged loss equals the uninterrupted run's bitwise")
    resume_args = [*chains[0].args(), "--max-steps", str(2 * chains[0].trials + 8)]  # the last one wins
    return tally.row("random SIGKILL mid-save", detail, time.monotonic() - t0), resume_args
