"""The numbers the grace calculator rests on, each with where it comes from (sbatch(1), slurm.conf(5), the
launchers' sources, measurements here), the one error type, and the trainer's agreement-mode rule (blocking or
overlapped stop rounds), which the trainer imports (through :mod:`~.calc`) so that the two cannot drift apart.

Pure: no I/O, no clock. See :mod:`slurm_jit.grace.calc` for the formula these feed.
"""

from __future__ import annotations

# The environment variable that carries N of --signal=TERM@N to the trainer (see the module docstring).
LEAD_ENV_VAR = "SLURM_JIT_SIGNAL_LEAD_S"

# transformers docs (JIT checkpointing on Slurm): "the 3 s kill_wait before the checkpoint starts".
DEFAULT_KILL_WAIT_S = 3.0
# Judgement, not a measurement: step and save times measured on a quiet machine spread under load (shared
# filesystems, stragglers); 20 % of the timed terms covers that spread, and the floor covers signal delivery
# (slurmctld -> slurmd -> slurmstepd) and the handler running at the next step boundary.
DEFAULT_MARGIN_FRACTION = 0.20
DEFAULT_MARGIN_FLOOR_S = 10.0
SLURM_SIGNAL_EARLY_S = 60  # sbatch(1) --signal: "may be sent up to 60 seconds earlier than specified"
SLURM_SIGNAL_LEAD_MIN_S = 1  # sbatch(1) allows sig_time 0: a warning at the very end, useless here
SLURM_SIGNAL_LEAD_MAX_S = 65535  # sbatch(1) --signal: sig_time is "an integer value between 0 and 65535"
SLURM_KILL_WAIT_DEFAULT_S = 30  # slurm.conf(5) KillWait: "The default value is 30 seconds."
SLURM_GRACE_TIME_DEFAULT_S = 0  # slurm.conf(5) partition GraceTime: "The default value is zero"
# torch/distributed/elastic/multiprocessing/api.py PContext.close(timeout=30) (pytorch#119856) and
# deepspeed/launcher/launch.py terminate_process_tree (psutil.wait_procs(timeout=30), then kill);
# `accelerate launch` runs multi-process jobs through torch.distributed.run.
LAUNCHER_KILL_AFTER_S = {"torchrun": 30, "deepspeed": 30, "accelerate": 30}
# Judgement: a grace (plus the early signal) above a quarter of the allocation costs more than it protects.
GRACE_FRACTION_WARN = 0.25
MIN_STEP_SAMPLES = 20  # below this a p99 or max of step times is mostly noise
# Bytes per parameter in a checkpoint. ZeRO paper (Rajbhandari et al. 2020, sec. 3.1): mixed-precision Adam
# keeps 16-bit weights, an fp32 master copy and fp32 momentum and variance (K = 12 bytes of optimizer state).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MASTER_COPY_BYTES = 4  # fp32 master weights, kept when the model dtype is 16-bit and there is an optimizer
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 4, "none": 0}  # momentum (+ variance) in fp32

# How the trainer's ranks read their stop rounds (one small all-reduce over a CPU gloo group per step boundary).
AGREE_BLOCKING = "blocking"  # read at the boundary that started it: the stop comes after the signal's step
AGREE_OVERLAPPED = "overlapped"  # read at the next boundary, the all-reduce hidden behind a step: one step later
LATENCY_STEPS = {AGREE_BLOCKING: 1, AGREE_OVERLAPPED: 2}  # steps from the signal until the stop, at most
# Measured here (2 local ranks, gloo, a 4 x int64 MAX all-reduce, 2000 rounds, load average 8): 0.33 ms median,
# 4 ms p99. From 0.5 s on even the p99 round is under 1 % of a step; below it, the second step of latency costs
# under 0.5 s of grace, which the margin's floor covers, while a blocking round would cost > 1 % of every step.
BLOCKING_MIN_STEP_S = 0.5
# Judgement: a blocking round may cost up to 1 % of a step. The trainer measures the round on its own cluster
# (many ranks over TCP take longer than 2 local ones) and reads rounds blocking only where this holds too.
BLOCKING_MAX_OVERHEAD = 0.01


class GraceError(ValueError):
    """Bad input or an impossible grace period; the message ends with a HINT on how to fix it."""


def blocking_threshold_s(allreduce_s: float = 0.0) -> float:
    """The shortest step for which the trainer reads stop rounds blocking, given one round's cost."""
    return max(BLOCKING_MIN_STEP_S, allreduce_s / BLOCKING_MAX_OVERHEAD)


def agreement_mode(step_s: float, allreduce_s: float = 0.0) -> str:
    """The trainer's rule: blocking rounds (latency 1 step) where a round is negligible beside a step."""
    return AGREE_BLOCKING if step_s >= blocking_threshold_s(allreduce_s) else AGREE_OVERLAPPED


def latency_reason(steps: int, recorded: bool = False) -> str:
    """Why the stop comes that many steps after the signal, in words."""
    how = "as the trainer recorded" if recorded else f"steps {'>=' if steps == 1 else '<'} {BLOCKING_MIN_STEP_S:g} s"
    if steps == 1:
        return f"the stop comes after the step the signal lands in (stop rounds read at that boundary, {how})"
    return f"the stop can come one step later (stop rounds read one step late, overlapped, {how})"
