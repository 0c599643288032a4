"""The grace-period calculator: how long before its end a Slurm job must be warned to checkpoint safely.

The formula (Hugging Face transformers docs, JIT checkpointing on Slurm) is the longest step that can be
running when the signal arrives, plus the checkpoint save time, plus the trainer's kill wait before the
checkpoint starts: steps of up to 2 min and a 2 min save need 120 + 120 + 3 = 243 s, ``--signal=TERM@243``.

What the JitTrainer does, exactly (its ranks agree on the stop at step boundaries, see
:mod:`slurm_jit.train.agreement`): from the first signal until ``train()`` returns takes at most
kill_wait + latency_steps x the longest step + the longest save + the teardown (save end to ``train()``
returning). latency_steps is 1 where the trainer reads each stop round at the step boundary that started it
(blocking: steps of at least :data:`BLOCKING_MIN_STEP_S`), 2 where it reads it one step later (overlapped,
short steps). The sum is the bound whatever the step times do; ``max(kill_wait, latency_steps x step)`` would
be one only for steps of equal length. The rule that picks the mode lives here (:func:`agreement_mode`) and the
trainer imports it, so the two cannot drift apart.

This module adds an evaluation that may be running, a safety margin, and the Slurm rules around the number:

* ``--signal`` may be sent up to 60 s *earlier* than asked (sbatch(1)): N is a lower bound, and the early
  signal costs up to 60 s of compute per job end.
* At the time limit every task gets SIGTERM again and SIGKILL ``KillWait`` later (slurm.conf(5), default
  30 s): the hard budget after the warning is N + KillWait, but the checkpoint is sized to fit in N.
* At preemption ``--signal`` is not sent (unless ``SlurmctldParameters=preempt_send_user_signal``): tasks
  get SIGTERM, then SIGKILL after the partition's ``GraceTime`` + KillWait.
* N is 1..65535 (sbatch(1) allows 0, which is no warning at all).
* torchrun and the ``deepspeed`` launcher SIGKILL their workers 30 s after forwarding SIGTERM.
* Without ``B:`` only job steps (srun) get the signal, not the batch shell; with ``B:`` only the batch shell.

tests/test_grace_slurm.py checks the delivery rules and reads KillWait and GraceTime on the local cluster.

Environment contract: this project's launchers and sbatch scripts export ``SLURM_JIT_SIGNAL_LEAD_S`` = the N
of ``#SBATCH --signal=TERM@N``, so the trainer knows the budget it was given.

Pure: no torch, no I/O, no Slurm calls of its own (the queries are passed in), no clock (passed in).
The I/O that feeds it (timing log, write probe, checkpoint sizes) lives in :mod:`slurm_jit.grace.cli`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from slurm_jit import timing

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


# --- parsing user input ---------------------------------------------------------------------------------

_NUMBER = r"(?:\d+(?:\.\d+)?|\.\d+)"
_DURATION_RE = re.compile(rf"(?:({_NUMBER})h)?(?:({_NUMBER})m(?:in)?)?(?:({_NUMBER})s(?:ec)?)?")


def parse_duration(text: str, *, what: str = "duration", allow_zero: bool = False) -> float:
    """Seconds from ``90s``, ``2m``, ``1h30m``, ``2.5`` (plain seconds); GraceError for anything else."""
    value = str(text).strip().lower().replace(" ", "")
    seconds: float | None = None
    if re.fullmatch(_NUMBER, value):
        seconds = float(value)
    else:
        match = _DURATION_RE.fullmatch(value)
        if value and match and any(match.groups()):
            hours, minutes, secs = (float(g) if g else 0.0 for g in match.groups())
            seconds = hours * 3600 + minutes * 60 + secs
    if seconds is None or not math.isfinite(seconds):
        raise GraceError(f"{what}: cannot read {text!r}. HINT: write 90s, 2m, 1h30m or plain seconds")
    if seconds == 0 and not allow_zero:
        raise GraceError(f"{what}: must be more than 0 s. HINT: give the longest time you measured")
    return seconds


def parse_size(text: str, *, what: str = "size") -> int:
    """Bytes from ``512MB``, ``3.5GiB``, ``800MB/s``, ``1e9``: decimal K/M/G/T/P, binary with ``i``; > 0."""
    value = str(text).strip().replace(" ", "").removesuffix("/s")
    match = re.fullmatch(rf"({_NUMBER}(?:[eE]\d+)?)(?:([KMGTPkmgtp])(i?))?[Bb]?", value)
    if not match:
        raise GraceError(f"{what}: cannot read {text!r}. HINT: write e.g. 512MB, 3.5GiB or 1e9")
    number, prefix, binary = match.groups()
    power = "KMGTP".index(prefix.upper()) + 1 if prefix else 0
    value_f = float(number) * (1024**power if binary else 1000**power)
    result = int(value_f) if math.isfinite(value_f) else 0
    if result <= 0:
        raise GraceError(f"{what}: {text!r} is not a positive finite number. HINT: give e.g. 512MB")
    return result


def parse_params(text: str) -> int:
    """A parameter count from ``7B``, ``350M``, ``125k``, ``1.3e9``."""
    value = str(text).strip().replace(" ", "")
    match = re.fullmatch(rf"({_NUMBER}(?:[eE]\d+)?)([KMBTkmbt]?)", value)
    if not match:
        raise GraceError(f"--params: cannot read {text!r}. HINT: write e.g. 7B, 350M or 1.3e9")
    scale = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}[match.group(2).upper()]
    count = float(match.group(1)) * scale
    if not (math.isfinite(count) and count >= 1):
        raise GraceError(f"--params: {text!r} is not a positive count. HINT: the model's parameter count")
    return int(count)


@dataclass(frozen=True, kw_only=True)
class Margin:
    """The safety margin: ``max(floor_s, fraction * (step + eval + save + teardown))``."""

    fraction: float = DEFAULT_MARGIN_FRACTION  # share of the timed terms
    floor_s: float = DEFAULT_MARGIN_FLOOR_S  # never less than this many seconds

    def __post_init__(self) -> None:
        values = (self.fraction, self.floor_s)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise GraceError("margin: must be a finite number >= 0. HINT: write --margin 30s or --margin 20%")

    def seconds(self, timed_s: float) -> float:
        return max(self.floor_s, self.fraction * timed_s)

    def describe(self) -> str:
        if self.fraction and self.floor_s:
            return f"{self.fraction:.0%} of step+eval+save+teardown, at least {self.floor_s:g} s"
        return f"{self.fraction:.0%} of step+eval+save+teardown" if self.fraction else f"{self.floor_s:g} s"


def parse_margin(text: str) -> Margin:
    """``20%`` (of step+eval+save) or a duration (``30s``, ``0``)."""
    value = str(text).strip()
    if value.endswith("%"):
        try:
            percent = float(value[:-1])
        except ValueError:
            percent = math.nan
        if not math.isfinite(percent) or percent < 0:
            raise GraceError(f"--margin: cannot read {text!r}. HINT: write 20% or 30s")
        return Margin(fraction=percent / 100, floor_s=0.0)
    return Margin(fraction=0.0, floor_s=parse_duration(value, what="--margin", allow_zero=True))


# --- the calculation ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Term:
    """One addend of the grace period."""

    name: str  # step / eval / save / kill_wait / margin
    seconds: float
    source: str  # where the number came from, in words


@dataclass(frozen=True, kw_only=True)
class GraceInputs:
    """What the grace period is made of; every time in seconds."""

    step_s: float  # the longest training step that can be running when the signal arrives
    save_s: float  # the checkpoint save time
    eval_s: float = 0.0  # an evaluation that can be running when the signal arrives (0: none can)
    kill_wait_s: float = DEFAULT_KILL_WAIT_S  # the trainer's wait after the signal, before the checkpoint
    latency_steps: int | None = None  # steps from the signal to the stop (1 or 2); None: the trainer's rule
    teardown_s: float = 0.0  # from the end of the save until train() returns
    margin: Margin = field(default_factory=Margin)  # safety margin on top
    sources: Mapping[str, str] = field(default_factory=dict)  # term name -> where its number came from

    def __post_init__(self) -> None:
        for name, value, zero_ok in (
            ("step", self.step_s, False), ("save", self.save_s, False),
            ("eval", self.eval_s, True), ("kill_wait", self.kill_wait_s, True), ("teardown", self.teardown_s, True),
        ):
            finite = isinstance(value, int | float) and math.isfinite(value)
            ok = finite and (value >= 0 if zero_ok else value > 0)
            if not ok:
                limit = "0 or more" if zero_ok else "more than 0"
                raise GraceError(f"{name} time {value!r} s: must be {limit}. HINT: give a time like 2m")
        if self.latency_steps is not None and self.latency_steps not in LATENCY_STEPS.values():
            raise GraceError(f"latency_steps={self.latency_steps!r}. HINT: 1 (blocking) or 2 (overlapped)")

    @property
    def steps_to_stop(self) -> int:
        """1 or 2: how many steps can run from the signal until the stop."""
        return self.latency_steps or LATENCY_STEPS[agreement_mode(self.step_s)]


@dataclass(frozen=True, kw_only=True)
class GraceResult:
    """The needed grace and the ``--signal`` lead N that covers it."""

    terms: tuple[Term, ...]
    needed_s: float  # the sum of the terms
    lead_s: int  # N of --signal=TERM@N: needed_s rounded up to whole seconds
    latency_steps: int = 1  # steps that can run from the signal until the stop

    @property
    def option(self) -> str:
        return f"--signal=TERM@{self.lead_s}"

    @property
    def sbatch_line(self) -> str:
        return f"#SBATCH {self.option}"

    @property
    def export_line(self) -> str:
        return f"export {LEAD_ENV_VAR}={self.lead_s}"

    def term(self, name: str) -> float:
        return sum(t.seconds for t in self.terms if t.name == name)


def compute_grace(inputs: GraceInputs) -> GraceResult:
    """Sum the terms; raises GraceError when the result cannot be a Slurm --signal lead."""
    steps = inputs.steps_to_stop
    step_term_s = steps * inputs.step_s
    timed_s = step_term_s + inputs.eval_s + inputs.save_s + inputs.teardown_s
    src = inputs.sources
    latency = src.get("latency", latency_reason(steps))
    terms = (
        Term(name="step", seconds=step_term_s,
             source=f"{steps} x {inputs.step_s:.3g} s ({src.get('step', 'given')}): {latency}"),
        Term(name="eval", seconds=inputs.eval_s, source=src.get("eval", "none can be running")),
        Term(name="save", seconds=inputs.save_s, source=src.get("save", "given")),
        Term(name="kill_wait", seconds=inputs.kill_wait_s, source=src.get("kill_wait", "given")),
        Term(name="teardown", seconds=inputs.teardown_s, source=src.get("teardown", "not counted")),
        Term(name="margin", seconds=inputs.margin.seconds(timed_s), source=inputs.margin.describe()),
    )
    needed_s = sum(t.seconds for t in terms)
    # round() first so that 120 + 120 + 3 in floating point is 243, not 244 after ceil.
    lead_s = max(SLURM_SIGNAL_LEAD_MIN_S, math.ceil(round(needed_s, 6)))
    if lead_s > SLURM_SIGNAL_LEAD_MAX_S:
        raise GraceError(
            f"needed grace {needed_s:.0f} s exceeds Slurm's largest --signal lead {SLURM_SIGNAL_LEAD_MAX_S} "
            "s (sbatch(1)). HINT: make the checkpoint faster (fewer bytes, a faster filesystem) or the steps "
            "shorter"
        )
    return GraceResult(terms=terms, needed_s=needed_s, lead_s=lead_s, latency_steps=steps)


# --- the cluster ----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ClusterFacts:
    """The Slurm settings that bound the grace period."""

    kill_wait_s: int = SLURM_KILL_WAIT_DEFAULT_S  # slurm.conf KillWait: SIGTERM -> SIGKILL at the time limit
    kill_wait_source: str = "Slurm default (not read: Slurm not reachable)"
    partition: str | None = None  # the partition the facts below are for
    grace_time_s: int | None = None  # the partition's preemption GraceTime; None: unknown
    preemptable: bool | None = None  # can jobs of this partition be preempted; None: unknown
    preempt_send_user_signal: bool = False  # SlurmctldParameters=preempt_send_user_signal

    @property
    def known(self) -> bool:
        return self.grace_time_s is not None


def read_cluster_facts(
    partition: str | None,
    *,
    show_config: Callable[[], dict[str, str]],
    show_partition: Callable[[str], dict[str, str]],
    default_partition: Callable[[], str | None],
    seconds: Callable[[str], int | None],
) -> ClusterFacts:
    """Read KillWait, the partition's GraceTime and the preemption settings through the given Slurm queries.

    A QOS GraceTime is not read: it needs ``sacctmgr`` and accounting, which small clusters often lack.
    """
    config = show_config()
    kill_wait = seconds(config.get("KillWait", "")) if "KillWait" in config else None
    name = partition or default_partition()
    part = show_partition(name) if name else {}
    grace_time = seconds(part.get("GraceTime", "0")) or 0
    preempt_type = config.get("PreemptType", "preempt/none")
    mode = (part.get("PreemptMode") or config.get("PreemptMode", "OFF")).upper()
    return ClusterFacts(
        kill_wait_s=SLURM_KILL_WAIT_DEFAULT_S if kill_wait is None else kill_wait,
        kill_wait_source="scontrol show config" if kill_wait is not None else "Slurm default (not in config)",
        partition=name,
        grace_time_s=grace_time,
        preemptable=preempt_type != "preempt/none" and not mode.startswith("OFF"),
        preempt_send_user_signal="preempt_send_user_signal" in config.get("SlurmctldParameters", ""),
    )


@dataclass(frozen=True, kw_only=True)
class Event:
    at_s: float  # seconds on the caller's clock
    what: str


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """Worst-case events after a warning signal, and whether the checkpoint is done before the first kill."""

    events: tuple[Event, ...]
    checkpoint_done_s: float  # when the worst-case checkpoint is complete
    exit_s: float  # when train() has returned (checkpoint_done_s + teardown)
    second_sigterm_s: float  # the end time: SIGTERM again (the checkpoint should be done by then)
    sigkill_s: float  # when the training processes are SIGKILLed

    @property
    def fits(self) -> bool:
        return self.exit_s <= self.second_sigterm_s

    @property
    def survives(self) -> bool:
        return self.checkpoint_done_s < self.sigkill_s


def _checkpoint_events(result: GraceResult, start_s: float) -> tuple[list[Event], float, float]:
    """(events, checkpoint done, train() returned) after a signal at ``start_s``, in the worst case."""
    busy_s = start_s + result.term("step") + result.term("eval")
    save_start_s = busy_s + result.term("kill_wait")
    done_s = save_start_s + result.term("save")
    exit_s = done_s + result.term("teardown")
    steps = "the step (and evaluation) in progress ends" if result.latency_steps == 1 else (
        "the step in progress and the next one (and evaluation) end")
    events = [
        Event(at_s=busy_s, what=steps),
        Event(at_s=save_start_s, what="kill wait over: the checkpoint starts"),
        Event(at_s=done_s, what="the checkpoint is complete"),
    ]
    if exit_s > done_s:
        events.append(Event(at_s=exit_s, what="train() returns"))
    return events, done_s, exit_s


def time_limit_timeline(
    result: GraceResult, facts: ClusterFacts, *, signal_at_s: float, early_s: float = 0.0,
    launcher: str | None = None,
) -> Timeline:
    """Replay a time-limit ending: the --signal lead_s (+ early_s) before the end, SIGTERM, SIGKILL."""
    end_s = signal_at_s + result.lead_s + early_s
    events, done_s, exit_s = _checkpoint_events(result, signal_at_s)
    kill_s = end_s + facts.kill_wait_s
    events += [
        Event(at_s=signal_at_s, what=f"--signal=TERM@{result.lead_s} arrives"),
        Event(at_s=end_s, what="time limit: SIGTERM again"),
        Event(at_s=kill_s, what=f"KillWait ({facts.kill_wait_s} s) over: SIGKILL"),
    ]
    if launcher in LAUNCHER_KILL_AFTER_S:
        launcher_kill_s = signal_at_s + LAUNCHER_KILL_AFTER_S[launcher]
        events.append(Event(at_s=launcher_kill_s, what=f"{launcher} SIGKILLs workers"))
        kill_s = min(kill_s, launcher_kill_s)
        end_s = min(end_s, kill_s)
    return Timeline(
        events=tuple(sorted(events, key=lambda e: e.at_s)), checkpoint_done_s=done_s, exit_s=exit_s,
        second_sigterm_s=end_s, sigkill_s=kill_s,
    )


def preemption_timeline(result: GraceResult, facts: ClusterFacts, *, preempted_at_s: float) -> Timeline:
    """Replay a preemption: SIGTERM now, SIGTERM again after GraceTime, SIGKILL KillWait later."""
    grace_s = facts.grace_time_s if facts.grace_time_s is not None else SLURM_GRACE_TIME_DEFAULT_S
    events, done_s, exit_s = _checkpoint_events(result, preempted_at_s)
    first = "the --signal" if facts.preempt_send_user_signal else "SIGTERM (not the --signal)"
    events += [
        Event(at_s=preempted_at_s, what=f"preempted: {first}"),
        Event(at_s=preempted_at_s + grace_s, what=f"GraceTime ({grace_s} s) over: SIGTERM again"),
        Event(at_s=preempted_at_s + grace_s + facts.kill_wait_s, what=f"KillWait ({facts.kill_wait_s} s): "
                                                                      "SIGKILL"),
    ]
    return Timeline(
        events=tuple(sorted(events, key=lambda e: e.at_s)), checkpoint_done_s=done_s, exit_s=exit_s,
        second_sigterm_s=preempted_at_s + grace_s, sigkill_s=preempted_at_s + grace_s + facts.kill_wait_s,
    )


def cluster_notes(result: GraceResult, facts: ClusterFacts) -> tuple[list[str], list[str]]:
    """(notes, warnings) about what Slurm does around this grace period."""
    n, kill_wait = result.lead_s, facts.kill_wait_s
    unused_s = n + SLURM_SIGNAL_EARLY_S - result.term("kill_wait") - result.term("save")
    notes = [
        f"Slurm may send the signal up to {SLURM_SIGNAL_EARLY_S} s early (sbatch(1)): N={n} is a lower "
        f"bound; training stops up to {n + SLURM_SIGNAL_EARLY_S} s before the time limit, and up to "
        f"{unused_s:.0f} s of the allocation can go unused after the checkpoint.",
        f"At the time limit Slurm sends SIGTERM again and SIGKILL {kill_wait} s later (KillWait, "
        f"{facts.kill_wait_source}): hard deadline {n + kill_wait} s after the signal; the checkpoint is "
        f"sized to fit in {n} s.",
    ]
    warnings: list[str] = []
    if not facts.known:
        notes.append("Preemption: GraceTime not read (Slurm not reachable); at preemption Slurm sends "
                     "SIGTERM, then SIGKILL after GraceTime + KillWait.")
    elif facts.preemptable is False:
        notes.append(f"Preemption: none configured for partition {facts.partition}.")
    else:
        budget_s = facts.grace_time_s or 0
        how = "the --signal" if facts.preempt_send_user_signal else "SIGTERM, not the --signal,"
        line = (f"Preemption (partition {facts.partition}): {how} arrives, SIGKILL after GraceTime "
                f"{budget_s} s + KillWait {kill_wait} s = {budget_s + kill_wait} s")
        if budget_s < result.needed_s:
            warnings.append(
                f"{line}; GraceTime {budget_s} s < needed {n} s, so a preempted job may "
                "lose its JIT checkpoint. HINT: keep periodic checkpoints frequent, or ask the admins for "
                f"GraceTime>={n}"
            )
        else:
            notes.append(line + ": enough.")
    return notes, warnings


# --- measured and estimated terms -----------------------------------------------------------------------


def select_world_size(records: list[dict[str, Any]], world_size: int | None) -> list[dict[str, Any]]:
    """The records of one world size; GraceError when the log was written by another one (or mixes them)."""
    sizes = sorted({r["world_size"] for r in records if isinstance(r.get("world_size"), int)})
    if world_size is None:
        if len(sizes) > 1:
            raise GraceError(
                f"the timing log mixes world sizes {sizes}; step and save times differ between them. HINT: "
                "pass --world-size N for the job you are sizing"
            )
        return records
    if world_size not in sizes:
        raise GraceError(
            f"the timing log was written with world size {sizes}, not {world_size}. HINT: measure a run at "
            f"world size {world_size}, or give --step-time and --save-time"
        )
    return [r for r in records if r.get("world_size") == world_size]


@dataclass(frozen=True, kw_only=True)
class Measured:
    """Terms read from a timing log, with how many samples each rests on."""

    step_s: float | None
    step_source: str
    latency_steps: int | None  # 1 or 2: steps from the signal to the stop, as the runs read their rounds
    latency_source: str
    save_s: float | None
    save_source: str
    eval_s: float | None
    eval_source: str
    kill_wait_s: float | None  # as the trainer recorded it
    teardown_s: float | None
    teardown_source: str
    warnings: tuple[str, ...]


def _worst_stop_window(summary: timing.TimingSummary, step_stat: str) -> tuple[float, int, str, int] | None:
    """(step, latency steps, mode, samples) of the mode whose latency x step is longest; None without steps."""
    windows = []
    for mode, stats in summary.steps_by_mode.items():
        step_s = stats.max_s if step_stat == "max" else stats.p99_s
        steps = LATENCY_STEPS.get(mode) or LATENCY_STEPS[agreement_mode(step_s)]
        windows.append((steps * step_s, step_s, steps, mode, stats.n))
    if not windows:
        return None
    _, step_s, steps, mode, n = max(windows)
    return step_s, steps, mode, n


def measured_terms(summary: timing.TimingSummary, *, step_stat: str = "max") -> Measured:
    """Step (max or p99) and the latency the runs' agreement mode gives it, longest save of any kind, longest
    evaluation, the recorded kill_wait and the longest teardown, from a timing summary."""
    runs = f"{summary.n_runs} run{'s' if summary.n_runs != 1 else ''}"
    worst = _worst_stop_window(summary, step_stat)
    step_s: float | None = None
    step_source, latency_source, steps = f"no steps over {runs} in the timing log", "", None
    if worst is not None:
        step_s, steps, mode, n = worst
        mixed = f" ({mode} runs)" if len(summary.steps_by_mode) > 1 else ""
        step_source = f"{step_stat} of {n} steps over {runs} in the timing log{mixed}"
        latency_source = latency_reason(steps, recorded=mode in LATENCY_STEPS)
    warnings = []
    if summary.n_steps < MIN_STEP_SAMPLES:
        warnings.append(f"only {summary.n_steps} step samples (warm-up left out); the {step_stat} is rough. "
                        "HINT: let the run go longer before sizing from it")
    save_s, save_source = None, "not measured"
    if summary.saves:
        kind, stats = max(summary.saves.items(), key=lambda kv: kv[1].max_dur_s)
        total = sum(s.count for s in summary.saves.values())
        save_s, save_source = stats.max_dur_s, f"longest of {total} saves ({kind}) in the timing log"
    teardown_source = "no JIT stop in the timing log yet: not counted (the margin covers it)"
    if summary.teardown_max_s is not None:
        teardown_source = f"longest of {summary.n_stops} JIT stops (all ranks) in the timing log: save end to " \
                          "train() returning"
    return Measured(
        step_s=step_s,
        step_source=step_source,
        latency_steps=steps,
        latency_source=latency_source,
        save_s=save_s,
        save_source=save_source,
        eval_s=summary.eval_max_s,
        eval_source=f"longest of {summary.n_evals} evaluations in the timing log",
        kill_wait_s=summary.kill_wait_s,
        teardown_s=summary.teardown_max_s,
        teardown_source=teardown_source,
        warnings=tuple(warnings),
    )


def checkpoint_bytes_per_node(
    *, params: int, dtype: str = "bf16", optimizer: str = "adamw", zero_stage: int = 0,
    world_size: int = 1, nodes: int = 1,
) -> int:
    """Bytes the busiest node (the one with rank 0) writes for one checkpoint; nodes write in parallel.

    Weights are written by rank 0 unless ZeRO-3 shards them; the optimizer state (fp32 master copy and
    moments) is sharded over all ranks from ZeRO-1 on.
    """
    if dtype not in DTYPE_BYTES or optimizer not in OPTIMIZER_STATE_BYTES or zero_stage not in range(4):
        raise GraceError(f"unknown dtype {dtype!r}, optimizer {optimizer!r} or ZeRO stage {zero_stage}. "
                         f"HINT: dtype {sorted(DTYPE_BYTES)}, optimizer {sorted(OPTIMIZER_STATE_BYTES)}, "
                         "stage 0..3")
    if world_size < 1 or nodes < 1 or nodes > world_size:
        raise GraceError(f"world size {world_size} over {nodes} nodes. HINT: 1 <= --nodes <= --world-size")
    weights = DTYPE_BYTES[dtype]
    master = MASTER_COPY_BYTES if weights < MASTER_COPY_BYTES and optimizer != "none" else 0
    optim = master + OPTIMIZER_STATE_BYTES[optimizer]
    ranks_on_node0 = math.ceil(world_size / nodes)
    per_param: float = weights + optim  # ZeRO-0: rank 0 writes everything
    if zero_stage in (1, 2):
        per_param = weights + optim * ranks_on_node0 / world_size
    elif zero_stage == 3:
        per_param = (weights + optim) * ranks_on_node0 / world_size
    return math.ceil(params * per_param)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError("unreachable")


def estimate_save_s(nbytes: int, bandwidth_bps: float) -> float:
    if not (math.isfinite(bandwidth_bps) and bandwidth_bps > 0):
        raise GraceError(f"write bandwidth {bandwidth_bps!r} B/s. HINT: measure it with --probe DIR")
    return nbytes / bandwidth_bps


# --- an elastic resume's conversion, paid at the start of the next job -----------------------------------


@dataclass(frozen=True, kw_only=True)
class Conversion:
    """The next start converts its checkpoint to DeepSpeed's universal format (another world size) before its
    first step: not part of the grace period (the end of a job), but of the next job's time limit."""

    written_by: int  # the ranks that wrote the checkpoint
    world_size: int  # the ranks of the job being sized
    checkpoint: str
    seconds: float | None  # estimated; None: no conversion in the timing log to estimate from
    source: str  # where the estimate came from, in words


def conversion_estimate(converts: list[tuple[float, int]], ckpt_bytes: int | None) -> tuple[float | None, str]:
    """(seconds, source) of converting a checkpoint of ``ckpt_bytes``, from earlier conversions ((dur_s, bytes
    written) in the timing log): the slowest seconds per byte seen, times the bytes (the converter reads the
    shards and writes as many bytes again); the longest one where bytes are unknown; (None, ...) without any."""
    if not converts:
        return None, "no conversion in the timing log yet: not estimated (seconds for small models, minutes for " \
                     "billions of parameters)"
    rates = [dur_s / nbytes for dur_s, nbytes in converts if nbytes > 0]
    n = f"{len(converts)} conversion{'s' if len(converts) != 1 else ''} in the timing log"
    if rates and ckpt_bytes:
        return max(rates) * ckpt_bytes, f"the slowest seconds per byte of {n} x {format_bytes(ckpt_bytes)}"
    return max(dur_s for dur_s, _ in converts), f"longest of {n}"


def conversion_note(conversion: Conversion) -> str:
    """One line for grace-calc's notes (and the launcher's plan)."""
    took = f"~{conversion.seconds:.0f} s" if conversion.seconds is not None else "time unknown"
    return (f"the next start on {conversion.world_size} ranks converts {conversion.checkpoint} (written by "
            f"{conversion.written_by} ranks) to DeepSpeed's universal format before its first step: {took} "
            f"({conversion.source}); it comes out of that job's --time, not out of the --signal lead")


def conversion_finding(conversion: Conversion, time_limit_s: int | None, lead_s: int,
                       step_s: float) -> str | None:
    """A warning when the job's --time cannot fit the conversion and one step before the signal can come (lead +
    Slurm's early minute; the save after it is inside the lead): that job would end without saving progress (the
    converted copy is kept, so the start after it does not convert again). None when it fits or is unknown."""
    if time_limit_s is None or conversion.seconds is None:
        return None
    needed_s = conversion.seconds + step_s
    available_s = time_limit_s - lead_s - SLURM_SIGNAL_EARLY_S
    if needed_s <= available_s:
        return None
    return (f"--time {time_limit_s} s leaves {max(available_s, 0)} s before the signal (lead {lead_s} s + "
            f"{SLURM_SIGNAL_EARLY_S} s early), but the next start converts first: ~{conversion.seconds:.0f} s + one "
            f"step {step_s:.3g} s = {needed_s:.0f} s: that job would end without saving any progress. HINT: ask for "
            f"a longer --time, or resume on {conversion.written_by} ranks")
