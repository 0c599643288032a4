"""Issue 20 item 5: what the hang watchdog costs. The same training with ``hang_timeout_s=None`` (no watchdog)
and with the default (``"auto"``), runs interleaved so that a change in the machine's load hits both alike, as a
ratio of median step times; and how often the watchdog's thread wakes, counted on the real thread."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from slurm_jit.bench import overhead, runs
from slurm_jit.bench.rows import NO_TARGET, Row, failed, measured
from slurm_jit.train import watchdog

MEDIAN_TARGET = "<= 1.001"  # issue 20: the watchdog costs at most 0.1 % of a step
WAKE_WINDOW_S = 32.0  # the thread wakes every 5 s at most often for real bounds: 6 wake-ups, counted
FEED_EVERY_S = 0.05  # a step boundary as often as the overhead runs' steps


def wakeups_per_min(window_s: float = WAKE_WINDOW_S) -> tuple[float, int, float]:
    """The real watchdog thread (``"auto"``, past warm-up), fed every 50 ms for ``window_s``: its wake-ups per
    minute, how many it made, and the median seconds one feed (``step_done``, what a step pays) took."""
    dog = watchdog.Watchdog("auto", rank=0, on_hang=lambda hang: None, exit_fn=lambda code: None)
    dog.start(step=0)
    started = time.monotonic()
    step, feeds = 0, []
    while time.monotonic() - started < window_s:
        time.sleep(FEED_EVERY_S)
        step += 1
        before = time.perf_counter()
        dog.step_done(FEED_EVERY_S, step)
        feeds.append(time.perf_counter() - before)
    elapsed = time.monotonic() - started
    dog.stop()
    return dog.wakeups / elapsed * 60, dog.wakeups, statistics.median(feeds)


def rows(base: Path, steps: int, repeats: int) -> list[Row]:
    compares = (f"step time with the hang watchdog (hang_timeout_s='auto') over without (None), JitTrainer, ZeRO-2, "
                f"2 ranks, {overhead.STEP_SLEEP_S * 1000:.0f} ms steps, {steps} steps x {repeats} interleaved runs "
                "each")
    samples: dict[str, list[float]] = {"none": [], "auto": []}
    medians: dict[str, list[float]] = {"none": [], "auto": []}
    for i in range(repeats):
        for hang in (("none", "auto") if i % 2 == 0 else ("auto", "none")):  # alternate which goes first
            out = base / f"{hang}-{i}"
            outcome = runs.run(out, ["--trainer", "jit", "--hang-timeout", hang, "--max-steps", str(steps),
                                     "--step-sleep", str(overhead.STEP_SLEEP_S), *overhead.TINY.args()], plan=None)
            if not outcome.clean:
                return [failed("watchdog_overhead_median", "ratio", MEDIAN_TARGET, compares,
                               f"hang_timeout {hang} run ended {outcome.codes}")]
            gaps = overhead._intervals(out)
            samples[hang].extend(gaps)
            medians[hang].append(statistics.median(gaps))
    auto, none = samples["auto"], samples["none"]
    per_pair = [a / n for a, n in zip(medians["auto"], medians["none"], strict=True)]
    per_min, count, feed_s = wakeups_per_min()
    return [
        measured("watchdog_overhead_median", statistics.median(auto) / statistics.median(none), "ratio",
                 MEDIAN_TARGET, compares, note=f"per interleaved pair: {', '.join(f'{r:.4f}' for r in per_pair)}",
                 auto_median_s=round(statistics.median(auto), 5), none_median_s=round(statistics.median(none), 5),
                 pair_ratios=[round(r, 5) for r in per_pair], samples=len(auto)),
        measured("watchdog_wakeups_per_min", per_min, "count", NO_TARGET,
                 f"the watchdog thread's wake-ups per minute, hang_timeout_s='auto' past warm-up, fed every "
                 f"{FEED_EVERY_S * 1000:.0f} ms for {WAKE_WINDOW_S:.0f} s",
                 note=f"one feed (step_done, what each step pays) takes {feed_s * 1e6:.1f} us (median)",
                 wakeups=count, feed_median_s=feed_s),
    ]
