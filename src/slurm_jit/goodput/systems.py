"""The three systems of ``tools/goodput``, each as a careful user would set it up, and their submission.

(a) ``plain``: ``transformers.Trainer`` with periodic saves every K steps, ``resume_from_checkpoint`` of the
    newest checkpoint, and the usual sbatch recipe: ``--signal=B:USR1@N`` reaches the batch shell, whose trap runs
    ``scontrol requeue`` (the training itself saves nothing: it is killed by the requeue).
(b) ``upstream``: the same with ``TrainingArguments(enable_jit_checkpoint=True)`` and ``--signal=TERM@N`` (no
    ``B:``: the ranks get it and save); the batch script requeues the job when srun returns before the training's
    end (upstream's JIT stop returns from ``train()`` and exits 0: the script checks the step it reached).
(c) ``jit``: the JitTrainer through ``python launch/submit.py`` (``--signal=TERM@N``, its requeue policy with
    ``--retry-on-failure`` and ``--retry-on-hang``), async snapshots every K/10 steps, ``hang_timeout_s`` sized
    to the steps.

Every system runs :mod:`slurm_jit.goodput.train` (demo_train's model and data) on the same ranks, with the same
``--signal`` lead N and ``srun --kill-on-bad-exit=1`` (a dead rank ends the step; the launcher sets the same).
A job that ends before the training's end is resubmitted by :mod:`.chain` (an attentive user), whatever the
system; Slurm's requeues of the same job id are the recipes' own.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from slurm_jit import slurm
from slurm_jit.goodput import probe
from slurm_jit.goodput.schedule import Schedule

ROOT = Path(__file__).resolve().parents[3]
SUBMIT_PY = ROOT / "launch" / "submit.py"
MAX_REQUEUES = 20  # (c): far more than a chain needs; the chain's budget ends a system that never finishes
RETRIES = 5  # (c): --retry-on-failure and --retry-on-hang (a careful user's: a crash or a hang is not the code's)
SAVE_TOTAL_LIMIT = 3  # every system keeps its 3 newest checkpoints (the snapshots would fill the disk)
REFERENCE_TIME_MIN = 20  # the uninterrupted run: a limit it never meets
FINAL_STATE = "final-state.json"  # demo_train's, after train() returned: the step, the weights' digest
SUBMIT_TIMEOUT_S = 300.0  # python launch/submit.py: imports, ckpt-check, sbatch on a loaded host


@dataclass(frozen=True, kw_only=True)
class SystemSpec:
    key: str  # "a", "b", "c": the calculator's keys (slurm_jit.grace.goodput.SYSTEMS)
    name: str
    label: str


SYSTEMS = {
    "a": SystemSpec(key="a", name="plain", label="(a) Trainer, periodic saves, B:USR1 trap requeues"),
    "b": SystemSpec(key="b", name="upstream", label="(b) Trainer + enable_jit_checkpoint, TERM@N"),
    "c": SystemSpec(key="c", name="jit", label="(c) JitTrainer via launch/submit.py, async snapshots"),
}


class SubmitError(RuntimeError):
    """A system's job could not be submitted; the message says why."""


@dataclass(frozen=True, kw_only=True)
class Paths:
    """Where one chain (or reference run) writes."""

    out: Path  # the training's output directory
    events: Path  # the probe's events and fault markers

    @classmethod
    def under(cls, root: Path, key: str, reference: bool) -> Paths:
        base = root / (f"reference-{key}" if reference else f"system-{key}")
        return cls(out=base / "out", events=base / "events")


def training_argv(key: str, schedule: Schedule, paths: Paths, python: str = sys.executable) -> list[str]:
    """One rank's command: the probe's training with each system's flags."""
    common = [python, "-u", "-m", "slurm_jit.goodput.train", str(paths.events), "--output-dir", str(paths.out),
              "--max-steps", str(schedule.work_steps), "--step-sleep", f"{schedule.step_sleep_s:g}",
              "--save-total-limit", str(SAVE_TOTAL_LIMIT)]
    if key == "a":
        return [*common, "--trainer", "plain", "--save-steps", str(schedule.save_steps)]
    if key == "b":
        return [*common, "--trainer", "plain", "--upstream-jit", "--save-steps", str(schedule.save_steps)]
    if key == "c":
        return [*common, "--resume", "--async-periodic-saves", "--save-steps", str(schedule.snapshot_steps),
                "--hang-timeout", f"{schedule.hang_timeout_s:g}"]
    raise SubmitError(f"system {key!r}. HINT: one of {', '.join(SYSTEMS)}")


def batch_script(key: str, schedule: Schedule, paths: Paths, time_limit_min: int,
                 python: str = sys.executable) -> str:
    """The sbatch script of (a) or (b): the usual recipe, as a user writes it."""
    if key not in ("a", "b"):
        raise SubmitError(f"system {key!r} has no hand-written script. HINT: (c) is submitted by launch/submit.py")
    lead = schedule.signal_lead_s
    signal_line = f"#SBATCH --signal=B:USR1@{lead}" if key == "a" else f"#SBATCH --signal=TERM@{lead}"
    srun = shlex.join(["srun", "--kill-on-bad-exit=1", *training_argv(key, schedule, paths, python)])
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name=goodput-{key}",
        f"#SBATCH --ntasks={schedule.world_size}",
        "#SBATCH --cpus-per-task=1",
        f"#SBATCH --time={time_limit_min}",
        signal_line,
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={paths.out.parent}/slurm-%j.out",
        'echo "goodput: batch start $(date +%s.%N) job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}"',
    ]
    if key == "a":  # the warning reaches this shell; srun in the background so that the trap runs at once
        return "\n".join([*header,
                          "trap 'echo \"goodput: USR1 $(date +%s.%N): requeue\"; scontrol requeue \"$SLURM_JOB_ID\"' "
                          "USR1",
                          f"{srun} &", "wait", ""])
    # demo_train writes final-state.json after train() returned, and upstream's JIT checkpoint returns from train()
    # too: the careful user's check is the step train() reached, not that it returned
    reached = shlex.join([python, "-c", REACHED_CHECK, str(paths.out / FINAL_STATE), str(schedule.work_steps)])
    return "\n".join([*header, srun,
                      f'if ! {reached}; then echo "goodput: srun ended before the training\'s end: '
                      'requeue"; scontrol requeue "$SLURM_JOB_ID"; fi', ""])


def final_state(paths: Paths, work_steps: int) -> dict[str, object] | None:
    """final-state.json (demo_train's, after train() returned) where it says the training reached its last step;
    else None (no file, a partial one, or an earlier step: upstream's JIT stop, system (b), returns from train()).
    (b)'s batch script runs the same test (:data:`REACHED_CHECK`)."""
    try:
        state = json.loads((paths.out / FINAL_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    step = state.get("global_step") if isinstance(state, dict) else None
    return state if type(step) is int and step >= work_steps else None


def finished(paths: Paths, work_steps: int) -> bool:
    return final_state(paths, work_steps) is not None


def resume_step(key: str, paths: Paths) -> int:
    """The step a next run of system ``key`` would resume after (0: a fresh start): (a) and (b) what their training
    resumes from (:func:`~slurm_jit.goodput.train.newest_checkpoint`: the highest ``checkpoint-N``, complete or
    not), (c) the JitTrainer's pick (the newest checkpoint ckpt-check calls complete)."""
    from slurm_jit.checkpoint import protocol

    if key == "c":
        try:
            found = protocol.find_resumable(paths.out).checkpoint
        except OSError:
            return 0
        return found.step if found is not None else 0
    from slurm_jit.goodput.train import newest_checkpoint

    newest = newest_checkpoint(str(paths.out))
    match = protocol.CHECKPOINT_RE.fullmatch(Path(newest).name) if newest else None
    return int(match.group(1)) if match else 0


# (b)'s batch script: exit 0 where final-state.json (argv[1]) says step argv[2] was reached, as final_state() tests
REACHED_CHECK = """import json, sys
try:
    state = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"goodput: no end of training in {sys.argv[1]}: {exc}")
step = state.get("global_step") if isinstance(state, dict) else None
sys.exit(0 if type(step) is int and step >= int(sys.argv[2]) else f"goodput: the training stopped at step {step}")"""


def submit_argv(schedule: Schedule, paths: Paths, time_limit_min: int, python: str = sys.executable) -> list[str]:
    """(c): python launch/submit.py with a careful user's options."""
    return [python, str(SUBMIT_PY), "--output-dir", str(paths.out), "--job-name", "goodput-c",
            "--ntasks-per-node", str(schedule.world_size), "--cpus-per-task", "1", "--time", str(time_limit_min),
            "--signal-lead", str(schedule.signal_lead_s), "--max-requeues", str(MAX_REQUEUES),
            "--retry-on-failure", str(RETRIES), "--retry-on-hang", str(RETRIES),
            "--", *training_argv("c", schedule, paths, python)]


def prepare(paths: Paths, schedule: Schedule, reference: bool) -> None:
    """The directories, and the faults file the probe reads (none for the uninterrupted reference)."""
    paths.out.mkdir(parents=True, exist_ok=True)
    paths.events.mkdir(parents=True, exist_ok=True)
    if not reference:
        (paths.events / probe.FAULTS_FILE).write_text(json.dumps(schedule.faults()), encoding="utf-8")


def submit(key: str, schedule: Schedule, paths: Paths, *, reference: bool = False) -> str:
    """Submit one job of system ``key`` (its chain's first, or a resubmission); returns the job id."""
    limit = REFERENCE_TIME_MIN if reference else schedule.time_limit_min
    if key == "c":
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        proc = subprocess.run(submit_argv(schedule, paths, limit), capture_output=True, text=True, env=env,
                              timeout=SUBMIT_TIMEOUT_S, check=False)
        found = re.search(r"^submitted job (\d+);", proc.stdout, re.MULTILINE)
        if proc.returncode != 0 or found is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()
            raise SubmitError(f"launch/submit.py failed (exit {proc.returncode}): {tail[-1] if tail else ''}. "
                              f"HINT: run it by hand: {shlex.join(submit_argv(schedule, paths, limit))}")
        return found.group(1)
    script = paths.out.parent / f"job-{key}.sbatch"
    script.write_text(batch_script(key, schedule, paths, limit), encoding="utf-8")
    try:
        return slurm.submit(script)
    except slurm.SlurmError as exc:
        raise SubmitError(f"sbatch of system ({key}) failed: {exc}. HINT: tools/local-slurm up") from exc


URGENT_PARTITION = "urgent"  # tools/local-slurm's partition that preempts 'debug' (PreemptMode=REQUEUE)


def has_urgent_partition() -> bool:
    try:
        slurm.show_partition(URGENT_PARTITION)
    except slurm.SlurmError:
        return False
    return True


def preempt(job: str, time_limit_min: int = 1) -> str:
    """A job of the urgent partition that needs the whole node: Slurm preempts (requeues) the debug job on it.
    Where the cluster has no urgent partition, ``scontrol requeue`` of the job stands in (the same end, no
    GraceTime): returns "requeue"."""
    if not has_urgent_partition():
        slurm.requeue(job)
        return "requeue"
    return slurm.run(["sbatch", "--parsable", "--partition=urgent", "--exclusive", "--nodes=1",
                      f"--time={time_limit_min}", "--job-name=goodput-urgent", "--output=/dev/null",
                      "--wrap", "sleep 5"]).strip().split(";")[0]
