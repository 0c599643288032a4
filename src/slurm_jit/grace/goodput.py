"""Goodput at scale, on paper: each system's expected share of the allocation that becomes kept training progress,
and the periodic save interval that maximises it (issue #36 item 4; docs/goodput.md).

The systems (:data:`SYSTEMS`): (a) a plain Trainer with periodic saves every K steps, (b) the same with upstream's
``enable_jit_checkpoint`` (warned stops are saved), (c) the JitTrainer (warned stops saved; the hang watchdog ends a
hang or a dead peer's collective; periodic snapshots may be asynchronous). What differs between them is which stops
save (:attr:`System.saves_when_warned`) and their costs (:func:`system_costs`); one model serves all three.

The model. The chain of jobs is a renewal process: every attempt (one allocation) starts from a complete checkpoint,
pays the restart, then runs cycles of K steps of compute and a periodic save, until the first of

* the time limit T: (a) is killed at T and keeps only its last complete save (a ``USR1`` trap that requeues saves
  nothing); (b) and (c) get the signal ``stop_s`` before T and keep everything (the stop's window is its cost);
* an unwarned failure (a crash, a lost node, an OOM; or a hang, share ``hang_fraction``) at a time X drawn from an
  exponential distribution, rate N / MTBF per GPU (or nodes / MTBF per node): every system keeps its last save that
  was complete at X; the allocation runs on for the detection time (a crash: until the job ends; a hang: (a), (b)
  until the time limit unless a collective timeout ends the job, (c) the watchdog's bound), capped at T, or for
  (b), (c) at T + ``limit_overrun_s``: their ranks catch SIGTERM to stop at a step boundary, so stuck ranks live
  on until Slurm's SIGKILL: slurmctld finds the job past its limit at its next time-limit check (every 30 s), then
  KillWait (30 s by default) (0: the job ends at T);
* a warned preemption (a rate per day of the job, independent of N): (a) is killed at once (GraceTime 0) and
  keeps its last save; (b) and (c) stop, save, and keep everything, in ``stop_s``.

Goodput = E[compute kept per attempt] / E[allocation time per attempt] (renewal-reward theorem), in [0, 1]: compute
counts step time only; restarts, blocked saves, redone work, detection and stops are the losses. Under these
assumptions the expectation is exact (closed forms below, checked against :mod:`~.goodput_replay` by simulation):

* failures are independent, exponential (constant rate), and the first one ends the attempt; one during a warned
  stop's window is not counted; a failure during the restart keeps the last save, as any other;
* costs are constant (the step time a typical step, a save's blocked and full time the same every time);
* an asynchronous save blocks ``save_blocked_s`` (staging), counts only once complete ``save_s`` after it began
  (a failure before then keeps the previous one), and the next one waits for it (the cycle is
  max(interval, background write) + blocked); the background write does not slow the steps;
* each attempt starts its save cycle afresh (exact for (a), which resumes from a save; (b) and (c) resume from a
  warned stop's step, one cycle's phase off); the work done in the step a warned stop lands in counts;
* the restart ``restart_s`` is the same after every end (the queue wait counts where it is included in it).

The advice (:func:`young_interval_s`): Young's first-order optimum (J. W. Young, "A first order approximation to
the optimum checkpoint interval", CACM 17(9), 1974), interval = sqrt(2 x blocked save x MTBF of the failures that
need a periodic save), at least the background write for an async save; Daly's higher-order form (J. T. Daly, FGCS
22(3), 2006) differs by under sqrt(c / 2M) / 3, a few percent where the save is seconds and the MTBF hours.

Pure: no torch, no I/O, no clock, no Slurm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slurm_jit.grace.rules import DEFAULT_KILL_WAIT_S, GraceError

# "The Llama 3 Herd of Models" (Meta, 2024, arXiv:2407.21783), sec. 3.3.4: "During a 54-day snapshot period of
# pre-training, we experienced a total of 466 job interruptions. Of these, 47 were planned interruptions [...] and
# 419 were unexpected interruptions", on 16K H100 GPUs: one unexpected interruption every ~3.1 h.
LLAMA3_UNEXPECTED = 419
LLAMA3_PLANNED = 47
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_MTBF_GPU_H = LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_UNEXPECTED  # ~50,677 GPU-hours
DEFAULT_GPUS_PER_NODE = 8  # an HGX / DGX node
# torch.distributed.init_process_group: "Default value is 10 minutes for NCCL": survivors of a dead rank wait in
# their collective that long before the NCCL watchdog aborts them and the job ends.
NCCL_TIMEOUT_S = 600.0
# train/watchdog.py (tests/grace/test_goodput.py checks they agree): the "auto" hang bound is max(10 x the
# longest step, 300 s); a firing watchdog takes up to FIRING_MAX_S more before the ranks exit.
WATCHDOG_STEP_FACTOR = 10
WATCHDOG_MIN_S = 300.0
WATCHDOG_FIRING_S = 14.0
HOUR_S = 3600.0
DAY_S = 86_400.0


@dataclass(frozen=True, kw_only=True)
class System:
    """One way to train: which stops it saves."""

    key: str  # "a", "b", "c"
    label: str
    saves_when_warned: bool  # a warned stop (time limit signal, preemption) saves: nothing to redo


PLAIN = System(key="a", label="Trainer, periodic saves", saves_when_warned=False)
UPSTREAM_JIT = System(key="b", label="Trainer + enable_jit_checkpoint", saves_when_warned=True)
JIT_TRAINER = System(key="c", label="JitTrainer", saves_when_warned=True)
SYSTEMS = (PLAIN, UPSTREAM_JIT, JIT_TRAINER)


def _check(name: str, value: float, *, zero_ok: bool = True, inf_ok: bool = False) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    ok = number and not math.isnan(value) and (math.isfinite(value) or inf_ok) and (value > 0 or zero_ok and value == 0)
    if not ok:
        raise GraceError(f"{name} {value!r}: must be a number {'>= 0' if zero_ok else '> 0'}"
                         f"{'' if inf_ok else ', finite'}. HINT: give a measured time in seconds")


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What one system pays, every time in seconds (measured: the timing log, tools/goodput)."""

    step_s: float  # a typical training step
    save_steps: int  # a periodic save every this many steps
    save_blocked_s: float  # training blocked per periodic save (sync: the whole save; async: the staging)
    save_s: float  # a periodic save from its start until complete (sync: = save_blocked_s)
    restart_s: float  # requeue delay, process start and imports, engine and load, first step
    stop_s: float  # a warned stop: signal to the job's end (kill wait, a step, the JIT save, teardown)
    crash_detect_s: float  # an unwarned crash until the job ends
    hang_detect_s: float  # a hang until the job ends; math.inf: until the time limit
    time_limit_s: float  # the job's --time
    # a job whose ranks catch SIGTERM (a system that saves when warned) and are stuck at the time limit (a hang, a
    # dead peer's collective) holds its allocation this long past it, until Slurm's SIGKILL: slurmctld's next
    # time-limit check (every 30 s), then KillWait (30 s by default); 0: the job ends at the limit
    limit_overrun_s: float = 0.0

    def __post_init__(self) -> None:
        _check("step time", self.step_s, zero_ok=False)
        _check("time limit", self.time_limit_s, zero_ok=False)
        for name in ("save_blocked_s", "save_s", "restart_s", "stop_s", "crash_detect_s", "limit_overrun_s"):
            _check(name.removesuffix("_s").replace("_", " "), getattr(self, name))
        _check("hang detection", self.hang_detect_s, inf_ok=True)
        if isinstance(self.save_steps, bool) or not isinstance(self.save_steps, int) or self.save_steps < 1:
            raise GraceError(f"save_steps {self.save_steps!r}: must be a whole number >= 1. HINT: e.g. 500")
        if self.save_s < self.save_blocked_s:
            raise GraceError(f"save time {self.save_s:g} s < its blocked time {self.save_blocked_s:g} s. HINT: the "
                             "full time of an async save includes its staging")
        if self.stop_s >= self.time_limit_s:
            raise GraceError(f"a warned stop of {self.stop_s:g} s does not fit in the time limit "
                             f"{self.time_limit_s:g} s. HINT: a longer --time")

    def stuck_end_s(self, system: System) -> float:
        """When a job stuck at the time limit ends, from its start: the limit, or KillWait after it for a system
        whose ranks catch SIGTERM."""
        return self.time_limit_s + (self.limit_overrun_s if system.saves_when_warned else 0.0)

    @property
    def interval_s(self) -> float:
        """Compute between two periodic saves."""
        return self.save_steps * self.step_s

    @property
    def background_s(self) -> float:
        """An async save's write after its staging (0: synchronous)."""
        return self.save_s - self.save_blocked_s

    @property
    def cycle_s(self) -> float:
        """One save cycle in steady state: the interval (or the previous write, if longer), then the blocked part."""
        return max(self.interval_s, self.background_s) + self.save_blocked_s


@dataclass(frozen=True, kw_only=True)
class Failures:
    """The failure model: unwarned failures per GPU (or node), their share of hangs, warned preemptions."""

    gpus: int
    mtbf_gpu_h: float = LLAMA3_MTBF_GPU_H  # mean time between unwarned failures of one GPU, hours
    mtbf_node_h: float | None = None  # instead: of one node, hours (nodes = ceil(gpus / gpus_per_node))
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    hang_fraction: float = 0.0  # of unwarned failures, the share that hangs instead of crashing
    preemptions_per_day: float = 0.0  # warned stops of the job (an urgent partition, planned maintenance)

    def __post_init__(self) -> None:
        for name, value in (("gpus", self.gpus), ("gpus per node", self.gpus_per_node)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GraceError(f"{name} {value!r}: must be a whole number >= 1. HINT: e.g. --gpus 1024")
        _check("MTBF per GPU (hours)", self.mtbf_gpu_h, zero_ok=False, inf_ok=True)
        if self.mtbf_node_h is not None:
            _check("MTBF per node (hours)", self.mtbf_node_h, zero_ok=False, inf_ok=True)
        _check("preemptions per day", self.preemptions_per_day)
        _check("hang fraction", self.hang_fraction)
        if self.hang_fraction > 1:
            raise GraceError(f"hang fraction {self.hang_fraction!r}: a share, 0 to 1. HINT: e.g. 0.1")

    @property
    def unwarned_per_s(self) -> float:
        if self.mtbf_node_h is not None:
            return math.ceil(self.gpus / self.gpus_per_node) / (self.mtbf_node_h * HOUR_S)
        return self.gpus / (self.mtbf_gpu_h * HOUR_S)

    @property
    def warned_per_s(self) -> float:
        return self.preemptions_per_day / DAY_S


def watchdog_detect_s(step_s: float, hang_timeout_s: float | None = None) -> float:
    """How long the JitTrainer's watchdog takes to end a hang: its bound ("auto": None) and its firing."""
    bound = hang_timeout_s if hang_timeout_s is not None else max(WATCHDOG_STEP_FACTOR * step_s, WATCHDOG_MIN_S)
    return bound + WATCHDOG_FIRING_S


def default_stop_s(step_s: float, save_s: float, kill_wait_s: float = DEFAULT_KILL_WAIT_S) -> float:
    """A warned stop without its measurement: kill wait, the step in flight, the JIT save (grace-calc's terms)."""
    return kill_wait_s + step_s + save_s


def system_costs(
    *, step_s: float, save_s: float, restart_s: float, time_limit_s: float, save_steps: int,
    snapshot_steps: int | None = None, stop_s: float | None = None, crash_detect_s: float = NCCL_TIMEOUT_S,
    plain_hang_detect_s: float = math.inf, hang_timeout_s: float | None = None,
    async_blocked_s: float | None = None, async_save_s: float | None = None,
) -> dict[str, Costs]:
    """Each system's costs from the common measurements: (a) and (b) save synchronously and wait out a hang
    (``plain_hang_detect_s``, default until the time limit); (c) snapshots every ``snapshot_steps`` (default
    ``save_steps``), asynchronously where ``async_blocked_s`` is given, and its watchdog ends a hang, and a dead
    peer's collective, within :func:`watchdog_detect_s`."""
    stop = default_stop_s(step_s, save_s) if stop_s is None else stop_s
    common = {"step_s": step_s, "restart_s": restart_s, "stop_s": stop, "time_limit_s": time_limit_s}
    plain = Costs(save_steps=save_steps, save_blocked_s=save_s, save_s=save_s, crash_detect_s=crash_detect_s,
                  hang_detect_s=plain_hang_detect_s, **common)
    watchdog_s = watchdog_detect_s(step_s, hang_timeout_s)
    jit = Costs(
        save_steps=snapshot_steps or save_steps,
        save_blocked_s=save_s if async_blocked_s is None else async_blocked_s,
        save_s=(save_s if async_blocked_s is None else async_blocked_s) if async_save_s is None else async_save_s,
        crash_detect_s=min(crash_detect_s, watchdog_s), hang_detect_s=watchdog_s, **common,
    )
    return {PLAIN.key: plain, UPSTREAM_JIT.key: plain, JIT_TRAINER.key: jit}


# --- the expectation ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Expectation:
    """One system's expected attempt (one allocation) and its goodput."""

    goodput: float  # kept_s / attempt_s, in [0, 1]
    attempt_s: float  # expected allocation time of one attempt
    kept_s: float  # expected compute kept by one attempt
    reaches_limit: float  # the share of attempts that end at the time limit (no failure before it)


def _first_save_s(c: Costs) -> float:
    """When the first periodic save's blocked part ends (it waits for no earlier write)."""
    return c.restart_s + c.interval_s + c.save_blocked_s


def done_s(c: Costs, x: float) -> float:
    """Compute done by ``x`` seconds into an attempt: compute phases [R, R+tau) and [e_i, e_i+tau)."""
    if x <= c.restart_s:
        return 0.0
    first = _first_save_s(c)
    if x < first:
        return min(c.interval_s, x - c.restart_s)
    m = math.floor((x - first) / c.cycle_s) + 1  # saves whose blocked part ended by x
    return m * c.interval_s + min(c.interval_s, x - first - (m - 1) * c.cycle_s)


def saves_complete(c: Costs, x: float) -> int:
    """Periodic saves complete (written, and committed where async) by ``x`` seconds into an attempt."""
    first = _first_save_s(c) + c.background_s
    return 0 if x < first else math.floor((x - first) / c.cycle_s) + 1


def _geometric(rate: float, step: float, n: int) -> float:
    """sum_{i<n} exp(-rate step i), accurate for small rate x step."""
    if n <= 0:
        return 0.0
    if rate * step == 0:
        return float(n)
    return math.expm1(-rate * step * n) / math.expm1(-rate * step)


def _span(rate: float, a: float, b: float) -> float:
    """integral_a^b exp(-rate t) dt."""
    if b <= a:
        return 0.0
    return math.exp(-rate * a) * (b - a if rate == 0 else -math.expm1(-rate * (b - a)) / rate)


def _kept_saves(c: Costs, rate: float, u: float) -> float:
    """E[compute of the saves complete at X; X < u], X ~ exponential(rate): sum_i P(d_i <= X < u) x tau."""
    n = saves_complete(c, u)
    first = _first_save_s(c) + c.background_s
    return c.interval_s * (math.exp(-rate * first) * _geometric(rate, c.cycle_s, n) - n * math.exp(-rate * u))


def _kept_done(c: Costs, rate: float, u: float) -> float:
    """E[compute done by X; X < u] = integral_0^u g(t) (e^-rate t - e^-rate u) dt, g = 1 in a compute phase."""
    first = _first_save_s(c)
    weighted = _span(rate, c.restart_s, min(u, c.restart_s + c.interval_s))
    if u > first:
        m = math.floor((u - first) / c.cycle_s) + 1  # compute phases that start at e_1 .. e_m < u
        full = _span(rate, 0.0, c.interval_s) * math.exp(-rate * first) * _geometric(rate, c.cycle_s, m - 1)
        last = first + (m - 1) * c.cycle_s
        weighted += full + _span(rate, last, min(u, last + c.interval_s))
    return weighted - math.exp(-rate * u) * done_s(c, u)


def _wall(rate: float, u: float, delay: float, limit: float) -> float:
    """E[min(X + delay, limit); X < u]: a failure at X ends the attempt ``delay`` later, or at the limit."""
    x0 = min(max(limit - delay, 0.0), u)
    early = 0.0
    if x0 > 0:
        early = delay * -math.expm1(-rate * x0) - x0 * math.exp(-rate * x0) + _span(rate, 0.0, x0)
    return early + limit * (math.exp(-rate * x0) - math.exp(-rate * u))


def expected(costs: Costs, system: System, failures: Failures) -> Expectation:
    """The expected attempt of ``system`` under ``failures``; its goodput (the model: the module docstring)."""
    c, limit = costs, costs.time_limit_s
    unwarned, warned = failures.unwarned_per_s, failures.warned_per_s
    rate = unwarned + warned
    u = limit - c.stop_s if system.saves_when_warned else limit  # failures after u: inside the stop's window
    end_kept = done_s(c, u) if system.saves_when_warned else c.interval_s * saves_complete(c, limit)
    survive = math.exp(-rate * u)
    attempt, kept = limit * survive, end_kept * survive
    if rate > 0:
        crash, hang = unwarned * (1 - failures.hang_fraction) / rate, unwarned * failures.hang_fraction / rate
        preempt = warned / rate
        stuck = c.stuck_end_s(system)
        attempt += crash * _wall(rate, u, c.crash_detect_s, stuck) + hang * _wall(rate, u, c.hang_detect_s, stuck)
        attempt += preempt * _wall(rate, u, c.stop_s if system.saves_when_warned else 0.0, limit)
        by_saves = _kept_saves(c, rate, u)
        kept += unwarned / rate * by_saves + preempt * (_kept_done(c, rate, u) if system.saves_when_warned
                                                        else by_saves)
    return Expectation(goodput=min(1.0, max(0.0, kept / attempt)), attempt_s=attempt, kept_s=kept,
                       reaches_limit=survive)


def young_interval_s(costs: Costs, system: System, failures: Failures) -> float | None:
    """Young's interval sqrt(2 x blocked save x MTBF), MTBF that of the ends a periodic save must cover: the
    unwarned failures, and for (a) the warned ones and the time limit (one end per allocation, at most its
    length apart); at least an async save's background write (a shorter one would wait for it). None where no
    failure is modelled for a system that saves its warned stops: periodic saves are then insurance only."""
    rate = failures.unwarned_per_s
    if not system.saves_when_warned:
        rate += failures.warned_per_s + 1 / costs.time_limit_s
    if rate == 0:
        return None
    return max(math.sqrt(2 * costs.save_blocked_s / rate), costs.background_s)


def advised_save_steps(costs: Costs, system: System, failures: Failures) -> int | None:
    """Young's interval in steps (``save_steps``), at least 1; None as :func:`young_interval_s`."""
    interval = young_interval_s(costs, system, failures)
    return None if interval is None else max(1, round(interval / costs.step_s))
