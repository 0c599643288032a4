"""``tools/goodput``: each system's goodput under one seeded fault schedule on the local Slurm (issue #36).

    tools/goodput                         # systems a, b, c; ~4-minute training; ~45 min on 2 cores
    tools/goodput --quick                 # system c only, a ~1-minute training (the suite's run, ~6 min)
    tools/goodput --seed 7 --kill-at-step 500 --systems a,c --out DIR

For each system: its uninterrupted run (a limit it never meets, no faults), then its chain under the schedule.
Results in --out: results.json, results.md (the tables), timeline-<system>.svg; results.md is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from slurm_jit import slurm, timing
from slurm_jit.goodput import chain as chains
from slurm_jit.goodput import predict, render, report, systems
from slurm_jit.goodput.probe import events_path
from slurm_jit.goodput.schedule import Schedule, ScheduleError, make_schedule
from slurm_jit.grace.rules import SLURM_KILL_WAIT_DEFAULT_S

PROG = "tools/goodput"
STARTUP_ALLOWANCE_S = 120.0  # a reference run's budget beyond its steps: starts on a loaded 2-core host
BUDGET_FACTOR = 4.0  # a chain may take this many times its uninterrupted run (then stopped: what it achieved)
MIN_BUDGET_S = 600.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{PROG}: {message}. HINT: {PROG} --help", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="system c only, a ~1-minute training")
    p.add_argument("--seed", type=int, default=1, help="draws the fault steps and ranks (default 1)")
    p.add_argument("--kill-at-step", type=int, default=None, help="the SIGKILL's step (default: from the seed)")
    p.add_argument("--systems", default=None, help="comma-separated of a, b, c (default: a,b,c; --quick: c)")
    p.add_argument("--out", default=None, help="results folder (default: goodput-results/run-<time>)")
    return p.parse_args(argv)


def _systems(text: str | None, quick: bool) -> list[str]:
    keys = [k.strip() for k in (text if text is not None else ("c" if quick else "a,b,c")).split(",") if k.strip()]
    bad = [k for k in keys if k not in systems.SYSTEMS]
    if bad or not keys:
        raise ScheduleError(f"--systems {text!r}: unknown {', '.join(bad) or 'none given'}. HINT: e.g. --systems a,c")
    if len(set(keys)) < len(keys):  # a second run of one system would write into the first's folders
        raise ScheduleError(f"--systems {text!r}: a system named twice. HINT: each once, e.g. --systems a,c")
    return keys


def _events(paths: systems.Paths, world_size: int) -> list[dict[str, Any]]:
    records = []
    for rank in range(world_size):
        path = events_path(paths.events, rank)
        if path.is_file():
            records += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return records


def _digest(paths: systems.Paths, work_steps: int) -> str | None:
    """The final weights' digest, only where the training reached its end (a chain cut after a JIT stop: none)."""
    state = systems.final_state(paths, work_steps)
    digest = state.get("weights_sha256") if state is not None else None
    return digest if isinstance(digest, str) else None


def _background_s(paths: systems.Paths) -> float:
    """(c)'s async snapshot write after its staging, median (0: none recorded)."""
    try:
        records = timing.read_records(paths.out)
    except (OSError, ValueError):
        return 0.0
    writes = [float(r["dur_s"]) for r in records if r.get("event") == "save_background" and r.get("rank") == 0]
    return statistics.median(writes) if writes else 0.0


def kill_wait_s() -> float:
    """The cluster's KillWait (slurm.conf's default where scontrol does not say)."""
    try:
        value = slurm.seconds(slurm.show_config().get("KillWait", ""))
    except (slurm.SlurmError, ValueError):
        value = None
    return float(SLURM_KILL_WAIT_DEFAULT_S if value is None else value)


def _reference_facts(ref_paths: systems.Paths, world_size: int) -> report.RunFacts | None:
    """The uninterrupted run's facts (its chain.json and events), None where they are missing."""
    path = ref_paths.out.parent / "chain.json"
    if not path.is_file():
        return None
    ref = chains.load(path)
    return report.run_facts(ref.runs[0], _events(ref_paths, world_size)) if ref.runs else None


def run_system(key: str, schedule: Schedule, root: Path, log: Any,
               kill_wait: float = SLURM_KILL_WAIT_DEFAULT_S) -> dict[str, Any]:
    """The uninterrupted run, then the chain, then their report."""
    expected_s = schedule.work_steps * (schedule.step_sleep_s + 0.05) + STARTUP_ALLOWANCE_S
    ref_paths, paths = systems.Paths.under(root, key, True), systems.Paths.under(root, key, False)
    systems.prepare(ref_paths, schedule, reference=True)
    print(f"{PROG}: ({key}) the uninterrupted run", file=log, flush=True)
    ref = chains.watch(key, schedule, ref_paths, reference=True, budget_s=3 * expected_s)
    chains.save(ref, ref_paths.out.parent / "chain.json")
    if not ref.finished or not ref.runs or ref.runs[0].end is None:
        raise RuntimeError(f"({key}) the uninterrupted run did not finish ({ref.outcome}). HINT: see "
                           f"{ref_paths.out.parent}/slurm-*.out")
    uninterrupted = sum((r.end or r.start) - r.start for r in ref.runs)
    systems.prepare(paths, schedule, reference=False)
    print(f"{PROG}: ({key}) the chain under the schedule (uninterrupted: {uninterrupted:.0f} s)", file=log,
          flush=True)
    chain = chains.watch(key, schedule, paths, reference=False,
                         budget_s=max(BUDGET_FACTOR * uninterrupted, uninterrupted + MIN_BUDGET_S))
    chains.save(chain, paths.out.parent / "chain.json")
    return report_system(key, schedule, root, uninterrupted, chain, kill_wait)


def report_system(key: str, schedule: Schedule, root: Path, uninterrupted: float, chain: chains.Chain,
                  kill_wait: float = SLURM_KILL_WAIT_DEFAULT_S) -> dict[str, Any]:
    """The report of a system's chain from its records in ``root`` (also for records saved by an earlier run)."""
    ref_paths, paths = systems.Paths.under(root, key, True), systems.Paths.under(root, key, False)
    events = _events(paths, schedule.world_size)
    digest, ref_digest = _digest(paths, schedule.work_steps), _digest(ref_paths, schedule.work_steps)
    limit_s, lead_s = schedule.time_limit_min * 60.0, float(schedule.signal_lead_s)
    rep = report.analyse(chain, events, uninterrupted_s=uninterrupted, work_steps=schedule.work_steps,
                         limit_s=limit_s, lead_s=lead_s, weights_equal=None if digest is None else digest == ref_digest,
                         reference=_reference_facts(ref_paths, schedule.world_size),
                         kept_steps=None if chain.finished else systems.resume_step(key, paths))
    runs = [report.run_facts(r, events) for r in chain.runs if r.end is not None]
    save_steps = schedule.snapshot_steps if key == "c" else schedule.save_steps
    pred = predict.predict(rep, runs, save_steps=save_steps, limit_s=limit_s,
                           preempt_t=chain.preempt[0] if chain.preempt else None,
                           background_s=_background_s(paths) if key == "c" else 0.0,
                           overrun_s=predict.default_overrun_s(kill_wait))
    scale = {(mix, gpus): predict.at_scale(pred.costs, key, gpus, hangs_and_preemptions=mixed)
             for mix, mixed in (("crashes only", False), ("10 % hangs, 0.87 preemptions/day", True))
             for gpus in predict.SCALES}
    (root / f"timeline-{key}.svg").write_text(render.timeline_svg(rep, runs, chain, schedule.work_steps),
                                              encoding="utf-8")
    return {"report": rep, "prediction": pred, "scale": scale, "chain": chain}


def _markdown(schedule: Schedule, results: dict[str, dict[str, Any]], preemption: str) -> str:
    reps = [r["report"] for r in results.values()]
    lines = [f"Schedule: {schedule.describe()}. Preemption: {preemption}.", "",
             render.summary_table(reps, {k: r["prediction"] for k, r in results.items()}), ""]
    for key, r in results.items():
        c = r["prediction"].costs
        lines += [f"### {systems.SYSTEMS[key].label}", "", render.costs_table(r["report"]), "",
                  f"Fed to the calculator: step {c.step_s:.3f} s, save every {c.save_steps} steps blocking "
                  f"{c.save_blocked_s:.3f} s (complete after {c.save_s:.3f} s), restart {c.restart_s:.1f} s, warned "
                  f"stop {c.stop_s:.1f} s, crash detection {c.crash_detect_s:.1f} s, hang detection "
                  f"{c.hang_detect_s:.1f} s, time limit {c.time_limit_s:.0f} s, a stuck job past it "
                  f"{c.limit_overrun_s:.1f} s.", f"![timeline](timeline-{key}.svg)",
                  ""]
    lines += ["At scale (the measured costs, a 24-hour limit, Llama 3's failure rate; advised save_steps in "
              "brackets):", "", render.scale_table({k: r["scale"] for k, r in results.items()}), ""]
    return "\n".join(lines)


def _json(schedule: Schedule, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"schedule": json.loads(schedule.to_json()), "systems": {}}
    for key, r in results.items():
        rep, pred = r["report"], r["prediction"]
        out["systems"][key] = {
            **{k: v for k, v in asdict(rep).items() if k != "ends"}, "goodput": rep.goodput, "loss_s": rep.loss_s,
            "split_s": rep.split_s, "matched_loss_s": rep.matched_loss_s, "paced_goodput": rep.paced_goodput,
            "ends": [{**asdict(e), "restart_s": e.restart_s, "total_s": e.total_s} for e in rep.ends],
            "predicted_goodput": pred.predicted, "costs": asdict(pred.costs),
            "preempt": r["chain"].preempt, "at_scale": [[m, g, v[0], v[1]] for (m, g), v in r["scale"].items()]}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        keys = _systems(args.systems, args.quick)
        schedule = make_schedule(args.seed, quick=args.quick, kill_at_step=args.kill_at_step)
    except ScheduleError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.out is not None and not args.out.strip():
        print(f"{PROG}: --out is empty. HINT: a folder (new or empty) for the results", file=sys.stderr)
        return 2
    root = Path(args.out or f"goodput-results/run-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if root.exists() and not root.is_dir():
        print(f"{PROG}: --out {root} is a file. HINT: a folder (new or empty) for the results", file=sys.stderr)
        return 2
    if root.exists() and any(root.iterdir()):
        print(f"{PROG}: --out {root} is not empty. HINT: another folder (each run needs fresh output "
              "directories)", file=sys.stderr)
        return 2
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"{PROG}: --out {root}: {exc.strerror or exc}. HINT: a folder that can be created", file=sys.stderr)
        return 2
    if not slurm.available():
        print(f"{PROG}: no Slurm controller answers. HINT: tools/local-slurm up", file=sys.stderr)
        return 2
    preemption = ("a job of the urgent partition (PreemptMode=REQUEUE, GraceTime 20 s)"
                  if systems.has_urgent_partition() else
                  "no urgent partition here: scontrol requeue of the job stands in")
    print(f"{PROG}: {schedule.describe()}; systems {','.join(keys)}; results in {root}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    kill_wait = kill_wait_s()
    for key in keys:
        try:
            results[key] = run_system(key, schedule, root, sys.stdout, kill_wait)
        except (RuntimeError, systems.SubmitError, slurm.SlurmError) as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 1
    (root / "results.json").write_text(json.dumps(_json(schedule, results), indent=1), encoding="utf-8")
    text = _markdown(schedule, results, preemption)
    (root / "results.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
