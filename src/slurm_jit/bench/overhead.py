"""Row 4: the agreement's cost per step: JitTrainer against plain transformers.Trainer, same model and ranks,
short steps, runs interleaved so that a change in the machine's load hits both alike."""

from __future__ import annotations

import statistics
from pathlib import Path

from slurm_jit import timing
from slurm_jit.bench import runs
from slurm_jit.bench.rows import NO_TARGET, Row, failed, measured

STEP_SLEEP_S = 0.05  # issue 10: short steps, about 50 ms (the tiny model's compute adds a few ms)
MEDIAN_TARGET = "<= 1.01"  # issue 10: at most 1 % on the median
TINY = runs.Model(width=64, layers=2, heads=2)


def _intervals(out: Path) -> list[float]:
    times = runs.step_times(out)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return gaps[timing.WARMUP_STEPS:]


def _p99(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.99 * len(values)) - 1)]


def rows(base: Path, steps: int, repeats: int) -> list[Row]:
    compares = (f"step time of JitTrainer over plain Trainer, ZeRO-2, 2 ranks, {STEP_SLEEP_S * 1000:.0f} ms steps, "
                f"{steps} steps x {repeats} interleaved runs each")
    samples: dict[str, list[float]] = {"jit": [], "plain": []}
    for i in range(repeats):
        for trainer in ("plain", "jit"):
            out = base / f"{trainer}-{i}"
            outcome = runs.run(out, ["--trainer", trainer, "--max-steps", str(steps), "--step-sleep",
                                     str(STEP_SLEEP_S), *TINY.args()], plan=None)
            if not outcome.clean:
                return [failed("agreement_overhead_median", "ratio", MEDIAN_TARGET, compares,
                               f"{trainer} run ended {outcome.codes}")]
            samples[trainer].extend(_intervals(out))
    jit, plain = samples["jit"], samples["plain"]
    return [
        measured("agreement_overhead_median", statistics.median(jit) / statistics.median(plain), "ratio",
                 MEDIAN_TARGET, compares, jit_median_s=round(statistics.median(jit), 5),
                 plain_median_s=round(statistics.median(plain), 5), samples=len(jit)),
        measured("agreement_overhead_p99", _p99(jit) / _p99(plain), "ratio", NO_TARGET,
                 compares.replace("step time", "p99 step time"), jit_p99_s=round(_p99(jit), 5),
                 plain_p99_s=round(_p99(plain), 5), jit_hist=jit, plain_hist=plain),
    ]
