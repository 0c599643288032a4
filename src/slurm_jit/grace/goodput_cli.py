"""``grace-calc goodput``: each system's expected goodput at N GPUs and the ``save_steps`` Young's interval advises.

    grace-calc goodput --gpus 16384 --time-limit 24h --restart 10m --step-time 10s --save-time 1m
    grace-calc goodput --from OUT_DIR --gpus 1024 --time-limit 24h --restart 5m --hang-fraction 0.1

The model is :mod:`slurm_jit.grace.goodput` (docs/goodput.md); this module reads the options and the timing log.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

from slurm_jit import timing
from slurm_jit.grace import goodput as gp
from slurm_jit.grace.estimates import select_world_size
from slurm_jit.grace.parsing import parse_duration
from slurm_jit.grace.rules import GraceError

PROG = "grace-calc goodput"
LLAMA3 = (f"Llama 3's {gp.LLAMA3_UNEXPECTED} unexpected interruptions in {gp.LLAMA3_DAYS} days on "
          f"{gp.LLAMA3_GPUS:,} GPUs")


def build_parser(parser_class: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = parser_class(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    j = p.add_argument_group("the job (durations: 90s, 2m, 1h30m or plain seconds)")
    j.add_argument("--gpus", required=True, help="GPUs of the training")
    j.add_argument("--time-limit", required=True, help="the job's --time, e.g. 24h")
    j.add_argument("--restart", required=True, help="a restart's cost: requeue delay, process start and imports, "
                   "engine and load, first step (the timing log does not hold it: tools/goodput measures it)")
    c = p.add_argument_group("measured costs (given, or from --from's timing log)")
    c.add_argument("--from", dest="from_dir", metavar="OUT_DIR", help="read OUT_DIR/slurm-jit/timing-rank*.jsonl")
    c.add_argument("--world-size", help="with --from: the world size whose records to use")
    c.add_argument("--step-time", help="a typical step (default: the timing log's median)")
    c.add_argument("--save-time", help="a synchronous save (default: the timing log's mean periodic save)")
    c.add_argument("--async-staging", help="(c) an async snapshot's blocked time, its staging (default: the timing "
                   "log's save_blocked mean; neither: (c) saves synchronously)")
    c.add_argument("--async-save-time", help="(c) an async snapshot from its start until committed (default: the "
                   "timing log's, else --save-time)")
    c.add_argument("--stop-time", help="(b), (c) a warned stop, signal to the job's end (default: the timing log's "
                   f"mean stop, else {gp.DEFAULT_KILL_WAIT_S:g} s kill wait + a step + a save)")
    c.add_argument("--crash-detect", help=f"an unwarned crash until the job ends (default {gp.NCCL_TIMEOUT_S:g} s: "
                   "NCCL's collective timeout)")
    c.add_argument("--hang-timeout", help="(c) JitConfig(hang_timeout_s=...) (default auto: max(10 x step, 300 s))")
    c.add_argument("--plain-hang-detect", help="(a), (b) a hang until the job ends (default: the time limit)")
    c.add_argument("--save-steps", help="(a), (b) the save interval to evaluate (default: each its advised one)")
    c.add_argument("--snapshot-steps", help="(c) the snapshot interval (default: --save-steps, else its advised)")
    f = p.add_argument_group("the failure model")
    f.add_argument("--mtbf-gpu-hours", help=f"unwarned failures: MTBF of one GPU (default {gp.LLAMA3_MTBF_GPU_H:,.0f} "
                   f"h, from {LLAMA3})")
    f.add_argument("--mtbf-node-hours", help="instead: MTBF of one node, hours")
    f.add_argument("--gpus-per-node", help=f"with --mtbf-node-hours (default {gp.DEFAULT_GPUS_PER_NODE})")
    f.add_argument("--hang-fraction", help="of unwarned failures, the share that hangs (default 0)")
    f.add_argument("--preemptions-per-day", help="warned preemptions of the job per day (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _number(text: str | None, what: str, *, whole: bool = False, zero_ok: bool = False) -> float | None:
    """A finite number > 0 (>= 0 with zero_ok; an integer with whole), or None when not given."""
    if text is None:
        return None
    try:
        value = int(text) if whole else float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 or zero_ok and value == 0)):
        kind = "a whole number" if whole else "a number"
        raise GraceError(f"{what}: cannot read {text!r}, {kind} {'>= 0' if zero_ok else '> 0'} is needed. HINT: "
                         f"e.g. {what} {'0.1' if zero_ok else '8'}")
    return value


def _duration(text: str | None, what: str, *, zero_ok: bool = False) -> float | None:
    return None if text is None else parse_duration(text, what=what, allow_zero=zero_ok)


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _per_event(records: list[dict[str, Any]], event: str, kinds: tuple[str, ...] | None = None) -> list[float]:
    """One duration per (run, step) of ``event``: the slowest rank's (an event ends when its last rank does)."""
    slowest: dict[tuple[str, Any], float] = {}
    for r in records:
        dur = r.get("dur_s")
        if r.get("event") != event or (kinds and r.get("kind") not in kinds) or not isinstance(dur, int | float):
            continue
        if isinstance(dur, bool) or not math.isfinite(dur) or dur < 0:
            continue
        key = (str(r.get("run_id")), r.get("step") if isinstance(r.get("step"), int) else id(r))
        slowest[key] = max(slowest.get(key, 0.0), float(dur))
    return list(slowest.values())


def log_costs(records: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, str]]:
    """The costs a timing log holds (seconds by option name) and where each came from."""
    got: dict[str, float] = {}
    src: dict[str, str] = {}
    summary = timing.summarize(records)
    if summary.step_median_s is not None:
        got["step"], src["step"] = summary.step_median_s, f"median of {summary.n_steps} steps in the timing log"
    periodic, any_sync = _per_event(records, "save", ("periodic",)), _per_event(records, "save")
    saves = periodic or any_sync  # a JIT or final save writes the same state where no periodic one was timed
    if saves:
        kind = "periodic" if periodic else "(JIT, final)"
        got["save"], src["save"] = _mean(saves) or 0.0, f"mean of {len(saves)} {kind} saves in the timing log"
    blocked = _per_event(records, "save_blocked")
    background = _per_event(records, "save_background")
    if blocked:
        got["staging"], src["staging"] = _mean(blocked) or 0.0, f"mean of {len(blocked)} async saves' blocked time"
        if background:
            got["async_save"] = got["staging"] + (_mean(background) or 0.0)
            src["async_save"] = f"blocked + mean of {len(background)} background writes in the timing log"
    stops, exits = _per_event(records, "stop"), _per_event(records, "exit")
    if stops:
        got["stop"] = (_mean(stops) or 0.0) + (_mean(exits) or 0.0)
        src["stop"] = f"mean of {len(stops)} JIT stops in the timing log{' + their exits' if exits else ''}"
    return got, src


def _from_log(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, str]]:
    if args.from_dir is None:
        return {}, {}
    records = timing.read_records(args.from_dir)  # TimingLogError (one line, with its HINT) without a log
    world_size = _number(args.world_size, "--world-size", whole=True)
    return log_costs(select_world_size(records, None if world_size is None else int(world_size)))


def _cost(args: argparse.Namespace, option: str, key: str, log: tuple[dict[str, float], dict[str, str]],
          *, zero_ok: bool = False) -> tuple[float | None, str]:
    """An option's seconds (given beats the log), and where they came from."""
    given = _duration(getattr(args, option.removeprefix("--").replace("-", "_")), option, zero_ok=zero_ok)
    if given is not None:
        return given, option
    return log[0].get(key), log[1].get(key, "")


def gather(args: argparse.Namespace) -> tuple[dict[str, gp.Costs], gp.Failures, dict[str, str]]:
    """Each system's costs (at its given or advised interval), the failure model, and where each cost came from."""
    log = _from_log(args)
    step, save = _cost(args, "--step-time", "step", log), _cost(args, "--save-time", "save", log)
    if step[0] is None or save[0] is None:
        missing = "--step-time" if step[0] is None else "--save-time"
        raise GraceError(f"no {missing[2:].replace('-', ' ')}. HINT: give {missing}, or --from OUT_DIR of a run "
                         "whose timing log has steps and saves")
    staging, async_save = _cost(args, "--async-staging", "staging", log), _cost(args, "--async-save-time",
                                                                                 "async_save", log)
    stop = _cost(args, "--stop-time", "stop", log)
    limit = _duration(args.time_limit, "--time-limit") or 0.0
    save_steps = _number(args.save_steps, "--save-steps", whole=True)
    snapshot_steps = _number(args.snapshot_steps, "--snapshot-steps", whole=True) or save_steps
    hang_timeout = _duration(args.hang_timeout, "--hang-timeout")
    costs = gp.system_costs(
        step_s=step[0], save_s=save[0], restart_s=_duration(args.restart, "--restart", zero_ok=True) or 0.0,
        time_limit_s=limit, save_steps=1, stop_s=stop[0],
        crash_detect_s=_given(_duration(args.crash_detect, "--crash-detect", zero_ok=True), gp.NCCL_TIMEOUT_S),
        plain_hang_detect_s=_given(_duration(args.plain_hang_detect, "--plain-hang-detect", zero_ok=True), math.inf),
        hang_timeout_s=hang_timeout, async_blocked_s=staging[0],
        async_save_s=async_save[0] if staging[0] is not None else None,
    )
    failures = _failures(args)
    chosen = {"a": save_steps, "b": save_steps, "c": snapshot_steps}
    for system in gp.SYSTEMS:
        steps = chosen[system.key] or gp.advised_save_steps(costs[system.key], system, failures) or 1
        costs[system.key] = replace(costs[system.key], save_steps=int(steps))
    sources = {"step": step[1], "save": save[1], "stop": stop[1] or "kill wait + a step + a save",
               **({"async staging": staging[1], "async save": async_save[1] or save[1]} if staging[0] else {})}
    return costs, failures, sources


def _failures(args: argparse.Namespace) -> gp.Failures:
    gpus = _number(args.gpus, "--gpus", whole=True)
    per_node = _number(args.gpus_per_node, "--gpus-per-node", whole=True)
    return gp.Failures(
        gpus=int(gpus or 0), mtbf_gpu_h=_number(args.mtbf_gpu_hours, "--mtbf-gpu-hours") or gp.LLAMA3_MTBF_GPU_H,
        mtbf_node_h=_number(args.mtbf_node_hours, "--mtbf-node-hours"),
        gpus_per_node=int(per_node or gp.DEFAULT_GPUS_PER_NODE),
        hang_fraction=_number(args.hang_fraction, "--hang-fraction", zero_ok=True) or 0.0,
        preemptions_per_day=_number(args.preemptions_per_day, "--preemptions-per-day", zero_ok=True) or 0.0,
    )


def rows(costs: Mapping[str, gp.Costs], failures: gp.Failures) -> list[dict[str, Any]]:
    """One row per system: its interval, its goodput there, Young's advice."""
    out = []
    for system in gp.SYSTEMS:
        c = costs[system.key]
        young = gp.young_interval_s(c, system, failures)
        out.append({"system": system.key, "label": system.label, "save_steps": c.save_steps,
                    "goodput": gp.expected(c, system, failures).goodput,
                    "advised_save_steps": gp.advised_save_steps(c, system, failures), "young_interval_s": young,
                    "costs": {k: (v if v != math.inf else None) for k, v in asdict(c).items()}})
    return out


def _failure_line(failures: gp.Failures) -> str:
    rate = failures.unwarned_per_s
    every = f"one every {1 / rate / gp.HOUR_S:.3g} h" if rate else "none"
    mtbf = (f"MTBF {failures.mtbf_node_h:g} h per node of {failures.gpus_per_node} GPUs" if failures.mtbf_node_h
            else f"MTBF {failures.mtbf_gpu_h:,.0f} h per GPU"
            + (f", from {LLAMA3}" if failures.mtbf_gpu_h == gp.LLAMA3_MTBF_GPU_H else ""))
    return (f"unwarned failures at {failures.gpus:,} GPUs: {every} ({mtbf}), {failures.hang_fraction:.0%} of them "
            f"hangs; {failures.preemptions_per_day:g} warned preemptions per day")


def render_text(table: list[dict[str, Any]], failures: gp.Failures, sources: Mapping[str, str]) -> str:
    lines = [_failure_line(failures), "",
             f"{'system':<38} {'save_steps':>10} {'goodput':>8}  advised save_steps (Young)"]
    for r in table:
        advised = r["advised_save_steps"]
        why = "any: no failure to cover" if advised is None else f"{advised} ({r['young_interval_s']:.0f} s)"
        lines.append(f"({r['system']}) {r['label']:<34} {r['save_steps']:>10} {r['goodput']:>8.1%}  {why}")
    lines += ["", "costs:", *(f"  {k}: {v}" for k, v in sources.items())]
    return "\n".join(lines)


def run(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """What ``grace-calc goodput`` prints for parsed ``args``; GraceError / TimingLogError on bad input."""
    del env  # nothing read from the environment; the signature matches grace-calc's
    costs, failures, sources = gather(args)
    table = rows(costs, failures)
    if args.json:
        return json.dumps({"failures": asdict(failures), "unwarned_per_h": failures.unwarned_per_s * gp.HOUR_S,
                           "systems": table, "sources": dict(sources)}, indent=2)
    return render_text(table, failures, sources)
