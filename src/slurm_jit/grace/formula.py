"""The formula: the terms of the grace period (step x latency, evaluation, save, kill wait, teardown, an
async periodic save in flight, margin), their
sum and the ``--signal`` lead N that covers it (:func:`compute_grace`). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from slurm_jit.grace.rules import (
    DEFAULT_KILL_WAIT_S,
    DEFAULT_MARGIN_FLOOR_S,
    DEFAULT_MARGIN_FRACTION,
    LATENCY_STEPS,
    LEAD_ENV_VAR,
    SLURM_SIGNAL_LEAD_MAX_S,
    SLURM_SIGNAL_LEAD_MIN_S,
    GraceError,
    agreement_mode,
    latency_reason,
)


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
    async_save_s: float = 0.0  # the JIT stop's wait for an async periodic save in flight (0: no async saves)
    margin: Margin = field(default_factory=Margin)  # safety margin on top
    sources: Mapping[str, str] = field(default_factory=dict)  # term name -> where its number came from

    def __post_init__(self) -> None:
        for name, value, zero_ok in (
            ("step", self.step_s, False), ("save", self.save_s, False),
            ("eval", self.eval_s, True), ("kill_wait", self.kill_wait_s, True), ("teardown", self.teardown_s, True),
            ("async_save", self.async_save_s, True),
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
    timed_s = step_term_s + inputs.eval_s + inputs.save_s + inputs.teardown_s + inputs.async_save_s
    src = inputs.sources
    latency = src.get("latency", latency_reason(steps))
    terms = (
        Term(name="step", seconds=step_term_s,
             source=f"{steps} x {inputs.step_s:.3g} s ({src.get('step', 'given')}): {latency}"),
        Term(name="eval", seconds=inputs.eval_s, source=src.get("eval", "none can be running")),
        Term(name="save", seconds=inputs.save_s, source=src.get("save", "given")),
        Term(name="kill_wait", seconds=inputs.kill_wait_s, source=src.get("kill_wait", "given")),
        Term(name="teardown", seconds=inputs.teardown_s, source=src.get("teardown", "not counted")),
        # only where the run saves in the background: a log without async saves keeps its terms as they were
        *([Term(name="async_save", seconds=inputs.async_save_s, source=src.get("async_save", "given"))]
          if inputs.async_save_s else []),
        Term(name="margin", seconds=inputs.margin.seconds(timed_s),
             source=inputs.margin.describe() + (" (+async_save)" if inputs.async_save_s else "")),
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

