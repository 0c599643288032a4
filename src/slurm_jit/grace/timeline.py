"""The cluster around a grace period: the Slurm settings that bound it (:class:`ClusterFacts`, read through
queries the caller passes in), worst-case replays of a time-limit ending and of a preemption (:class:`Timeline`),
and the notes and warnings grace-calc prints about them. Pure: no I/O of its own, times on the caller's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from slurm_jit.grace.formula import GraceResult
from slurm_jit.grace.rules import (
    LAUNCHER_KILL_AFTER_S,
    SLURM_GRACE_TIME_DEFAULT_S,
    SLURM_KILL_WAIT_DEFAULT_S,
    SLURM_SIGNAL_EARLY_S,
)


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
