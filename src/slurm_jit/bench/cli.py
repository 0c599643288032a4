"""``tools/bench``: every benchmark row in one run; a table on stdout, results.json and results.md in --out."""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from slurm_jit.bench import (
    async_saves,
    ckpt_check_speed,
    disk,
    floor_rows,
    gpu,
    gpu_check,
    lora,
    overhead,
    report,
    resume,
    runs,
    save,
    signal_exit,
    staggered,
    watchdog_cost,
)
from slurm_jit.bench.rows import Row, failed, skipped

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Profile:
    """How big and how many: --quick (CI smoke run), the default (~11 min at load 4-5), --full (issue sizes)."""

    flag: str  # "--quick", "" or "--full"
    model: runs.Model  # the model of the save, memory, verify and resume rows
    zero3: bool  # run the ZeRO-3 gather on/off pair
    overhead_steps: int  # steps per run of the agreement-overhead pair (0: not run)
    overhead_repeats: int  # interleaved plain/jit pairs
    trials_per_delay: int  # staggered-signal trials per delay and trainer (0: not run)
    extra_signal_trials: int  # more JitTrainer trials with simultaneous signals, for row 5's count
    ckpt_count: int  # checkpoints ckpt-check's quick mode reads
    # the async-vs-sync pair's save_steps and wall time (issue #23); None: not in this profile unless --only async
    async_saves: async_saves.Settings | None
    floors: bool  # the floor rows (issue #34: three more 2-rank runs, on tmpfs); False: only with --only save/resume


QUICK = Profile(flag="--quick", model=runs.Model(width=128, layers=2, heads=2), zero3=False, overhead_steps=0,
                overhead_repeats=0, trials_per_delay=0, extra_signal_trials=0, ckpt_count=10,
                # not in CI's smoke run (two more 2-rank runs under a 90-minute budget); --quick --only async runs
                # them: ~50 s of two 12 s runs plus their starts, async saves every 3 steps, synchronous every 30
                async_saves=None,
                floors=False)  # not in CI's smoke run either; --quick --only save,resume runs them (~1 min idle)
QUICK_ASYNC = async_saves.Settings(save_steps=30, wall_s=12.0)
# The reference model (GPT-2 width 512, 8 layers: ~300 MB of resumable state, ~405 MB written).
DEFAULT = Profile(flag="", model=runs.Model(width=512, layers=8), zero3=True, overhead_steps=150,
                  overhead_repeats=1, trials_per_delay=2, extra_signal_trials=0, ckpt_count=100,
                  async_saves=async_saves.Settings(save_steps=50, wall_s=120.0), floors=True)
# Width 768, 13 layers: 92 M parameters, 1.1 GB (1.03 GiB) of fp32 master weights + Adam moments; 20 signal trials.
FULL = Profile(flag="--full", model=runs.Model(width=768, layers=13, heads=12), zero3=True, overhead_steps=300,
               overhead_repeats=2, trials_per_delay=5, extra_signal_trials=4, ckpt_count=100,
               async_saves=async_saves.Settings(save_steps=50, wall_s=240.0), floors=True)

# Every row of every profile, in order: a row a profile does not run is reported skipped.
ROW_NAMES = (
    "disk_write", "disk_read", "save_bw_over_disk_zero2", floor_rows.ZERO2_SAVE_ROW, floor_rows.DISK_SAVE_ROW,
    "bytes_over_needed_zero2", "save_vs_upstream_plus_sync",
    "upstream_bytes_over_needed", "bytes_over_needed_lora", "lora_save_over_full", "save_bw_over_disk_zero3",
    floor_rows.ZERO3_SAVE_ROW, "bytes_over_needed_zero3", "zero3_gather_on_over_off",
    "memory_peak_over_steady", "agreement_overhead_median", "agreement_overhead_p99",
    "watchdog_overhead_median", "watchdog_wakeups_per_min", "signal_exit_prediction_min",
    "signal_exit_prediction_max", "staggered_ours_completed", "staggered_upstream_completed", "ckpt_check_quick_s",
    "ckpt_check_deep_over_disk_read", "ckpt_check_deep_over_sha256sum", floor_rows.DEEP_ROW,
    "resume_over_fresh_start", "resume_load_over_disk_read", floor_rows.RESUME_ROW,
    *async_saves.ROW_NAMES, *gpu.GPU_ROWS,
)
# --only A,B: these groups of rows alone, in this order (the others reported skipped)
ONLY = {
    "save": "the JIT save over the raw write floor on tmpfs (ZeRO-2, ZeRO-3) and on the disk, with the disk's "
            "references and the ZeRO-2 save's bytes and memory (issue #34; with resume: ~65 s at a load of 3 here)",
    "resume": "a resume and ckpt-check --deep over the raw read floor on tmpfs (issue #34)",
    "async": "async periodic saves against synchronous ones (issue #23)",
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), like the other commands' errors."""

    def error(self, message: str) -> NoReturn:
        hint = "" if "HINT:" in message else ". HINT: see tools/bench --help"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def parse_only(text: str) -> frozenset[str]:
    """``--only``'s value: groups of ONLY, comma-separated."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in ONLY]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown group {', '.join(repr(n) for n in unknown)} in --only {text!r}. HINT: name groups of "
            f"{', '.join(ONLY)}, comma-separated, e.g. --only save,resume")
    return frozenset(names)


def only_text(groups: frozenset[str]) -> str:
    """The groups as --only takes them, in ONLY's order."""
    return ",".join(name for name in ONLY if name in groups)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tools/bench", description=__doc__)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smoke run (CI): tiny model, few runs, under ~2 min")
    size.add_argument("--full", action="store_true", help="the issue's sizes: a >= 1 GiB state, 20 signal trials")
    p.add_argument("--out", default="bench-results", help="results.json and results.md go here")
    p.add_argument("--work-dir", default=None, help="where the runs write (default: OUT/work, removed after)")
    p.add_argument("--keep-work", action="store_true", help="keep the runs' output directories")
    p.add_argument("--only", type=parse_only, metavar="GROUP[,GROUP]",
                   help="run these groups of rows alone: " + "; ".join(f"{k}: {v}" for k, v in ONLY.items()))
    return p


def _section(rows: list[Row], name: str, fn: Callable[[], list[Row]]) -> None:
    """Run one section; a section that breaks gives a 'not measured' row instead of ending the run."""
    logger.info("bench: %s", name)
    started, before = time.monotonic(), len(rows)
    try:
        rows.extend(fn())
    except Exception as exc:  # noqa: BLE001 - reported in the results, and the exit code says so
        logger.exception("bench: %s failed", name)
        rows.append(failed(f"{name}_error", "-", "-", name, f"{type(exc).__name__}: {exc}"))
    logger.info("bench: %s took %.0f s", name, time.monotonic() - started)
    if rows[before:]:  # as it goes, so that a run cut short still shows what it measured
        logger.info("bench: %s rows:\n%s", name, report.text_table(rows[before:]))


def measure(profile: Profile, work: Path, only: frozenset[str] | None = None) -> list[Row]:
    """Every row of ``profile``; with ``only``, those groups' rows alone."""
    if only is not None:
        return _measure_only(profile, work, only)
    rows: list[Row] = []
    z2 = _zero2_on_disk(rows, profile, work, profile.floors)
    if z2 is None:
        return rows
    ours, limit = z2
    _section(rows, "upstream", lambda: save.upstream_rows(work / "upstream", profile.model, ours))
    _section(rows, "save_lora", lambda: lora.rows(work / "lora", profile.model, ours))
    _section(rows, "ckpt_check_deep", lambda: ckpt_check_speed.deep_rows(ours.outcome.out, ours.ckpt, limit))
    _section(rows, "resume", lambda: resume.rows(ours, profile.model, limit))
    if profile.zero3:
        _section(rows, "save_zero3", lambda: save.zero3_rows(work, profile.model, limit))
    if profile.floors:
        _floor_sections(rows, profile, save_rows=True, resume_rows=True)
    if profile.overhead_steps:
        _section(rows, "overhead", lambda: overhead.rows(work / "overhead", profile.overhead_steps,
                                                         profile.overhead_repeats))
        _section(rows, "watchdog", lambda: watchdog_cost.rows(work / "watchdog", profile.overhead_steps,
                                                              2 * profile.overhead_repeats))
    _section(rows, "signals", lambda: _signal_rows(profile, work, ours))
    _section(rows, "ckpt_check_quick", lambda: [ckpt_check_speed.quick_row(work / "ckpt-check", profile.ckpt_count)])
    if profile.async_saves is not None:
        _section(rows, "async_saves", lambda: _async_rows(profile, work))
    _section(rows, "gpu", gpu_check.bench_rows)
    return rows


def _measure_only(profile: Profile, work: Path, only: frozenset[str]) -> list[Row]:
    rows: list[Row] = []
    if "save" in only:
        _zero2_on_disk(rows, profile, work, True)
    if only & {"save", "resume"}:
        _floor_sections(rows, profile, save_rows="save" in only, resume_rows="resume" in only)
    if "async" in only:
        _section(rows, "async_saves", lambda: _async_rows(profile, work))
    return rows


def _zero2_on_disk(rows: list[Row], profile: Profile, work: Path,
                   floor: bool) -> tuple[save.JitSave, disk.DiskLimits] | None:
    """The ZeRO-2 JIT stop on the disk that most rows use, the disk's references beside it (and its write floor
    there when ``floor``); None when it broke."""
    z2: list[tuple[save.JitSave, disk.DiskLimits]] = []

    def zero2() -> list[Row]:
        ours = save.run_ours(work / "zero2", profile.model, 2)
        limit = disk.measure(work, ours.total_bytes)
        z2.append((ours, limit))
        return [*disk.rows(limit, work), save.bandwidth_row("save_bw_over_disk_zero2", ours, limit, "ZeRO-2"),
                save.bytes_row("bytes_over_needed_zero2", ours, "ZeRO-2"), save.memory_row(ours)]

    _section(rows, "save_zero2", zero2)
    if not z2:
        return None
    if floor:
        _section(rows, "write_floor_disk", lambda: [floor_rows.disk_row(z2[0][0], work)])
    return z2[0]


def _floor_sections(rows: list[Row], profile: Profile, *, save_rows: bool, resume_rows: bool) -> None:
    _section(rows, "floors_zero2_tmpfs",
             lambda: floor_rows.zero2_rows(profile.model, save_row=save_rows, resume_rows=resume_rows))
    if save_rows:
        _section(rows, "floors_zero3_tmpfs", lambda: floor_rows.zero3_rows(profile.model))


def _signal_rows(profile: Profile, work: Path, ours: save.JitSave) -> list[Row]:
    first = staggered.Trial(trainer="ours", delay_s=-1.0, outcome=ours.outcome, completed=True,
                            kill_wait_s=save.KILL_WAIT_S)  # the save run: simultaneous signals, not a stagger trial
    trials = [first]
    if profile.trials_per_delay:
        trials += staggered.run_trials(work / "staggered", profile.trials_per_delay)
    if profile.extra_signal_trials:
        trials += staggered.run_trials(work / "signal-exit", profile.extra_signal_trials, ("ours",), (0.0,))
    return [*signal_exit.rows(trials), *staggered.rows(trials)]


def _async_rows(profile: Profile, work: Path) -> list[Row]:
    return async_saves.rows(work / "async-saves", profile.model, profile.async_saves or QUICK_ASYNC)


def _complete(rows: list[Row], profile: Profile, only: frozenset[str] | None = None) -> list[Row]:
    """Every row of ROW_NAMES in order; one this profile did not run is skipped with the reason."""
    by_name = {r.name: r for r in rows}
    command = " ".join(part for part in ("tools/bench", profile.flag, f"--only {only_text(only)}" if only else "")
                       if part)
    why = f"not run by `{command}` (see --help)"
    ordered = [by_name.pop(n) if n in by_name else skipped(n, "-", "-", "-", why) for n in ROW_NAMES]
    return ordered + list(by_name.values())  # the errors of broken sections last


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    profile = QUICK if args.quick else FULL if args.full else DEFAULT
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    meta: dict[str, Any] = {
            "profile_flag": profile.flag + (f" --only {only_text(args.only)}" if args.only else ""),
            "machine": report.machine(work), "load_start": report.load_average(),
            "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "model": {"width": profile.model.width, "layers": profile.model.layers,
                      "params": profile.model.params()}}
    started = time.monotonic()
    try:
        rows = _complete(measure(profile, work, args.only), profile, args.only)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    meta.update(load_end=report.load_average(), wall_s=time.monotonic() - started)
    report.write(out, rows, meta)
    print(report.text_table(rows))
    print(f"results: {out / 'results.json'}, {out / 'results.md'}")
    broken = [r.name for r in rows if r.note.startswith("not measured")]
    if broken:
        print(f"tools/bench: not measured: {', '.join(broken)}. HINT: see the log above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
