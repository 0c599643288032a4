"""``grace-calc``: size ``#SBATCH --signal=TERM@N`` from given or measured times, and check scripts and jobs.

    grace-calc --step-time 2m --save-time 2m --margin 0        # the transformers docs' example: TERM@243
    grace-calc --from OUT_DIR                                    # from the JitTrainer's timing log
    grace-calc --step-time 30s --params 7B --zero-stage 2 --world-size 8 --probe /scratch/me
    grace-calc check train.sbatch --from OUT_DIR                 # exit 0 enough, 1 not enough, 2 error
    grace-calc check --job 12345 --step-time 2m --save-time 2m
    grace-calc goodput --from OUT_DIR --gpus 1024 --time-limit 24h --restart 5m   # goodput at scale (goodput.md)

Exit codes: 0 fine; 1 (check) the lead is too short or the signal cannot reach the training; 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NoReturn

from slurm_jit import slurm, timing
from slurm_jit.grace import calc as grace
from slurm_jit.grace import goodput_cli
from slurm_jit.grace.calc import ClusterFacts, GraceError, GraceInputs, GraceResult
from slurm_jit.grace.sbatch_script import SbatchScript, parse_script, read_script
from slurm_jit.grace.script_check import CheckReport, Finding, check_script

PROG = "grace-calc"
EXIT_OK, EXIT_NOT_ENOUGH, EXIT_ERROR = 0, 1, 2
# Environment variables that give the world size of the job being sized (torchrun's, then Slurm's).
WORLD_SIZE_ENV = ("WORLD_SIZE", "SLURM_NTASKS")
# fsync latency (a few ms) stays around 1 % of the probe time on a 1 GB/s filesystem.
PROBE_SIZE_DEFAULT_BYTES = 256 * 2**20
PROBE_CHUNK_BYTES = 8 * 2**20


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), like every other error of grace-calc."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{PROG}: error: {message}. HINT: see {self.prog} --help\n")


def _add_sizing(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("given times (90s, 2m, 1h30m or plain seconds)")
    g.add_argument("--step-time", help="the longest training step")
    g.add_argument("--save-time", help="the checkpoint save time")
    g.add_argument("--eval-time", help="an evaluation that can be running when the signal arrives")
    g.add_argument("--kill-wait",
                   help="the trainer's wait before the checkpoint (default: as --from's timing log recorded it, "
                   f"else {grace.DEFAULT_KILL_WAIT_S:g} s)")
    # argparse %-formats help strings: the percentage's sign is doubled.
    g.add_argument("--margin", help=f"safety margin, a duration or a percentage of step+eval+save (default "
                   f"{grace.DEFAULT_MARGIN_FRACTION:.0%}%, at least {grace.DEFAULT_MARGIN_FLOOR_S:g} s; 0: "
                   "the docs' formula)")
    m = p.add_argument_group("measured times")
    m.add_argument("--from", dest="from_dir", metavar="OUT_DIR",
                   help="read OUT_DIR/slurm-jit/timing-rank*.jsonl")
    m.add_argument("--step-stat", choices=("max", "p99"), default="max", help="which step time (default max)")
    m.add_argument("--no-eval", action="store_true", help="no evaluation can be running at the signal")
    m.add_argument("--world-size", type=int, help="the job's world size (default $WORLD_SIZE)")
    e = p.add_argument_group("estimated save time: checkpoint bytes / write bandwidth")
    e.add_argument("--ckpt-bytes", help="checkpoint size, e.g. 14GB or 3.5GiB")
    e.add_argument("--ckpt-dir", help="use the size of the newest complete checkpoint here (default --from)")
    e.add_argument("--params", help="parameter count, e.g. 7B or 350M")
    e.add_argument("--dtype", choices=sorted(grace.DTYPE_BYTES), default="bf16")
    e.add_argument("--optimizer", choices=sorted(grace.OPTIMIZER_STATE_BYTES), default="adamw")
    e.add_argument("--zero-stage", type=int, choices=range(4), default=0)
    e.add_argument("--nodes", type=int, default=1, help="nodes the ranks are spread over (default 1)")
    e.add_argument("--probe", metavar="DIR", help="measure write+fsync bandwidth in DIR (output filesystem)")
    e.add_argument("--probe-size", default=str(PROBE_SIZE_DEFAULT_BYTES), help="bytes the probe writes")
    e.add_argument("--write-bandwidth", help="instead of --probe: bytes per second, e.g. 800MB/s")
    s = p.add_argument_group("cluster and output")
    s.add_argument("--partition", help="read GraceTime of this partition (default: the script's, or Slurm's)")
    s.add_argument("--no-slurm", action="store_true", help="do not query Slurm; use its documented defaults")
    s.add_argument("--json", action="store_true", help="print one JSON object")


def build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """grace-calc's, grace-calc check's and grace-calc goodput's parsers."""
    calc = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_sizing(calc)
    check = _Parser(prog=f"{PROG} check", description="Check an sbatch script or a submitted job's --signal.")
    target = check.add_mutually_exclusive_group(required=True)
    target.add_argument("script", nargs="?", help="the sbatch script")
    target.add_argument("--job", help="a submitted job's id (its batch script, time limit and partition)")
    _add_sizing(check)
    return calc, check, goodput_cli.build_parser(_Parser)


# --- gathering the terms --------------------------------------------------------------------------------


def _world_size(args: argparse.Namespace, env: Mapping[str, str]) -> int | None:
    if args.world_size is not None:
        if args.world_size < 1:
            raise GraceError(f"--world-size {args.world_size}: must be 1 or more. HINT: the number of ranks")
        return int(args.world_size)
    for name in WORLD_SIZE_ENV:
        if env.get(name, "").isdigit() and int(env[name]) > 0:
            return int(env[name])
    return None


def _checkpoint_bytes(args: argparse.Namespace, world_size: int | None) -> tuple[int, str] | None:
    if args.ckpt_bytes is not None:
        return grace.parse_size(args.ckpt_bytes, what="--ckpt-bytes"), "--ckpt-bytes"
    ckpt_dir = args.ckpt_dir or args.from_dir
    if ckpt_dir:
        try:
            found = newest_checkpoint_bytes(ckpt_dir)
        except OSError as exc:
            raise GraceError(f"cannot read checkpoints in {ckpt_dir}: {exc.strerror}. HINT: check the "
                             "path") from None
        if found is not None:
            return found
    if args.params is not None:
        ranks = world_size or 1
        nbytes = grace.checkpoint_bytes_per_node(
            params=grace.parse_params(args.params), dtype=args.dtype, optimizer=args.optimizer,
            zero_stage=args.zero_stage, world_size=ranks, nodes=args.nodes,
        )
        return nbytes, (f"--params {args.params}, {args.dtype}, {args.optimizer}, ZeRO-{args.zero_stage}, "
                        f"{ranks} ranks on {args.nodes} node(s): rank 0's node")
    return None


def _estimated_save(args: argparse.Namespace, world_size: int | None) -> tuple[float, str] | None:
    size = _checkpoint_bytes(args, world_size)
    if size is None:
        if args.probe is not None or args.write_bandwidth is not None:
            raise GraceError("a write bandwidth but no checkpoint size. HINT: add --ckpt-bytes, --ckpt-dir "
                             "or --params")
        return None
    nbytes, what = size
    bandwidth: float
    if args.write_bandwidth is not None:
        bandwidth, how = grace.parse_size(args.write_bandwidth, what="--write-bandwidth"), "--write-bandwidth"
    elif args.probe is not None:
        probe_bytes = grace.parse_size(args.probe_size, what="--probe-size")
        bandwidth = probe_write_bandwidth(args.probe, size_bytes=probe_bytes)
        how = f"--probe {args.probe}: {grace.format_bytes(probe_bytes)} written and fsynced"
    else:
        raise GraceError(f"a checkpoint of {grace.format_bytes(nbytes)} but no write bandwidth. HINT: add "
                         "--probe DIR (a directory on the checkpoint filesystem) or --write-bandwidth "
                         "500MB/s")
    save_s = grace.estimate_save_s(nbytes, bandwidth)
    nbytes_text, rate_text = grace.format_bytes(nbytes), grace.format_bytes(bandwidth)
    return save_s, f"estimate: {nbytes_text} ({what}) / {rate_text}/s ({how})"


NO_SAVE_HINT = "give --save-time, --from a run that saved a checkpoint, or --ckpt-bytes / --params with --probe DIR"
_Term = tuple[float, str]  # seconds, and where the number came from


def _measured(args: argparse.Namespace, world_size: int | None) -> tuple[grace.Measured | None, dict[str, Any]]:
    """The terms of --from's timing log, and its sample counts; (None, {}) without --from."""
    if args.from_dir is None:
        return None, {}
    try:
        records = timing.read_records(args.from_dir)
        selected = grace.select_world_size(records, world_size)
    except (GraceError, timing.TimingLogError):
        shrunk = _shrunk(args, world_size)
        if shrunk is not None:
            return shrunk
        if args.step_time is None or args.save_time is None:
            raise
        # another world size's log (an elastic resume's new job), or none (checkpoints copied to a new OUT_DIR):
        # the given times stand alone; --from still says what the next start converts
        return None, {}
    summary = timing.summarize(selected)
    measured = grace.measured_terms(summary, step_stat=args.step_stat)
    if measured.save_s is None and world_size is not None:
        measured = _save_of_more_ranks(records, measured, world_size, args.step_stat)
    return measured, _samples(summary)


def _save_of_more_ranks(records: list[dict[str, Any]], measured: grace.Measured, world_size: int,
                        step_stat: str) -> grace.Measured:
    """A log with steps but no save at ``world_size`` (a shrunk run that ended or was stopped before it saved):
    the save of the nearest larger world size that has one, scaled as after a shrink (grace.shrunk_terms); else
    ``measured`` as it is."""
    for size in sorted({r["world_size"] for r in records if isinstance(r.get("world_size"), int)}):
        if size <= world_size:
            continue
        larger = grace.measured_terms(timing.summarize(grace.select_world_size(records, size)), step_stat=step_stat)
        if larger.save_s is not None:
            scaled = grace.shrunk_terms(larger, size, world_size)
            return replace(measured, save_s=scaled.save_s, save_source=scaled.save_source, warnings=(
                *measured.warnings, f"the timing log has no save at world size {world_size}: world size {size}'s "
                "is scaled, an estimate. HINT: size again once a run on this many ranks has saved"))
    return measured


def _samples(summary: timing.TimingSummary) -> dict[str, Any]:
    return {"steps": summary.n_steps, "runs": summary.n_runs, "evals": summary.n_evals,
            "saves": {k: v.count for k, v in summary.saves.items()},
            "world_sizes": sorted(summary.world_sizes), "stops": summary.n_stops,
            "agreement_modes": sorted(summary.steps_by_mode),
            "async_saves": asdict(summary.async_saves) if summary.async_saves else None}


def _shrunk(args: argparse.Namespace, world_size: int | None) -> tuple[grace.Measured, dict[str, Any]] | None:
    """A job on fewer ranks than every run in --from's timing log (an elastic resume after a shrink): the terms of
    the nearest larger world size, scaled (grace.shrunk_terms); None otherwise (a growth, or no log)."""
    try:
        records = timing.read_records(args.from_dir)
    except timing.TimingLogError:
        return None
    sizes = sorted({r["world_size"] for r in records if isinstance(r.get("world_size"), int)})
    if world_size is None or not sizes or sizes[0] <= world_size:
        return None
    summary = timing.summarize(grace.select_world_size(records, sizes[0]))
    measured = grace.measured_terms(summary, step_stat=args.step_stat)
    return grace.shrunk_terms(measured, sizes[0], world_size), {**_samples(summary), "scaled_from_world_size": sizes[0]}


def _term(value: float | None, source: str) -> _Term | None:
    return (value, source) if value is not None else None


def gather_inputs(
    args: argparse.Namespace, env: Mapping[str, str]
) -> tuple[GraceInputs, list[str], dict[str, Any]]:
    """The terms from the options (given, then measured, then estimated), with warnings and sample counts."""
    world_size = _world_size(args, env)
    measured, samples = _measured(args, world_size)
    step = save = evaluation = kill_wait_measured = teardown = None
    async_save = (0.0, "")
    latency: tuple[int | None, str] = (None, "")
    warnings: list[str] = []
    if measured is not None:
        step, save = _term(measured.step_s, measured.step_source), _term(measured.save_s, measured.save_source)
        evaluation = _term(measured.eval_s, measured.eval_source)
        kill_wait_measured = _term(measured.kill_wait_s, "recorded by the trainer in the timing log")
        teardown = (measured.teardown_s or 0.0, measured.teardown_source)
        async_save = (measured.async_save_s, measured.async_save_source)
        latency = (measured.latency_steps, measured.latency_source)
        warnings = list(measured.warnings)
    if args.step_time is not None:
        step = (grace.parse_duration(args.step_time, what="--step-time"), "--step-time")
        latency = (None, "")  # the trainer's rule for the given step time
    if args.save_time is not None:
        save = (grace.parse_duration(args.save_time, what="--save-time"), "--save-time")
    if args.eval_time is not None:
        evaluation = (grace.parse_duration(args.eval_time, what="--eval-time"), "--eval-time")
    elif args.no_eval:
        evaluation = (0.0, getattr(args, "no_eval_source", "--no-eval"))
    if step is None:
        raise GraceError("no step time. HINT: give --step-time, or --from OUT_DIR of a run with a timing log")
    if save is None:
        save = _estimated_save(args, world_size)
    elif args.probe is not None:
        warnings.append(f"--probe not used: the save time comes from {save[1]}")
    if save is None:
        raise GraceError("no save time. HINT: " + getattr(args, "no_save_hint", NO_SAVE_HINT))
    kill_wait = kill_wait_measured or (grace.DEFAULT_KILL_WAIT_S, "default (transformers docs)")
    if args.kill_wait is not None:
        kill_wait = (grace.parse_duration(args.kill_wait, what="--kill-wait", allow_zero=True), "--kill-wait")
    margin = grace.Margin() if args.margin is None else grace.parse_margin(args.margin)
    inputs = GraceInputs(
        step_s=step[0], save_s=save[0], eval_s=evaluation[0] if evaluation else 0.0, kill_wait_s=kill_wait[0],
        latency_steps=latency[0], teardown_s=teardown[0] if teardown else 0.0, margin=margin,
        async_save_s=async_save[0],
        sources={"step": step[1], "save": save[1], "kill_wait": kill_wait[1], "async_save": async_save[1],
                 **({"latency": latency[1]} if latency[1] else {}),
                 **({"teardown": teardown[1]} if teardown else {}),
                 **({"eval": evaluation[1]} if evaluation else {})},
    )
    return inputs, warnings, samples


def cluster_facts(args: argparse.Namespace, partition: str | None) -> ClusterFacts:
    """KillWait and GraceTime from the real cluster when it answers, else Slurm's documented defaults."""
    if args.no_slurm:
        return ClusterFacts(kill_wait_source="Slurm default (--no-slurm)")
    if not slurm.available():
        return ClusterFacts()
    try:
        return grace.read_cluster_facts(
            args.partition or partition, show_config=slurm.show_config, show_partition=slurm.show_partition,
            default_partition=slurm.default_partition, seconds=slurm.seconds,
        )
    except slurm.SlurmError as exc:
        raise GraceError(f"{exc}. HINT: check the partition name (--partition, or the script's)") from None


# --- measuring -----------------------------------------------------------------------------------------


def probe_write_bandwidth(
    directory: str | os.PathLike[str], *, size_bytes: int = PROBE_SIZE_DEFAULT_BYTES,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Bytes per second of writing and fsyncing a test file in ``directory`` (removed afterwards)."""
    path = Path(directory) / f".grace-calc-probe-{os.getpid()}.tmp"
    chunk = os.urandom(min(size_bytes, PROBE_CHUNK_BYTES))  # random: no compression or dedup shortcut
    try:
        start = clock()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left = size_bytes
            while left > 0:
                left -= os.write(fd, chunk[: min(left, len(chunk))])
            os.fsync(fd)
        finally:
            os.close(fd)
        elapsed = clock() - start
    except OSError as exc:
        raise GraceError(f"--probe {os.fspath(directory)}: {exc.strerror}. HINT: give a writable directory "
                         "on the filesystem the checkpoints go to") from None
    finally:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # DIR was not a directory: nothing was written
    return size_bytes / max(elapsed, 1e-9)


def newest_checkpoint_bytes(output_dir: str | os.PathLike[str]) -> tuple[int, str] | None:
    """(size, description) of the newest complete checkpoint under ``output_dir``, None if there is none."""
    from slurm_jit.checkpoint import protocol  # lazily: the grace calculator must work without the trainer's modules

    found = protocol.find_resumable(output_dir, strict=False)
    ckpt = getattr(found, "checkpoint", None)
    if ckpt is None or ckpt.size_bytes is None:  # size unknown: no estimate from it
        return None
    status = getattr(ckpt.status, "value", ckpt.status)
    return int(ckpt.size_bytes), f"newest resumable checkpoint {ckpt.path}, step {ckpt.step}, {status}"


def next_conversion(output_dir: str | os.PathLike[str], world_size: int | None) -> grace.Conversion | None:
    """The conversion the next start on ``world_size`` ranks does before its first step (its newest resumable
    checkpoint written by another number of ranks, not converted yet), estimated from the timing log's
    conversions; None when it converts nothing (or the world size is unknown)."""
    from slurm_jit.checkpoint import elastic_plan, protocol  # lazily, as newest_checkpoint_bytes

    ckpt = getattr(protocol.find_resumable(output_dir, strict=False), "checkpoint", None)
    if ckpt is None or world_size is None:
        return None
    decided = elastic_plan.plan(ckpt.path, world_size)
    if decided.action != elastic_plan.CONVERT or decided.written_by is None:
        return None
    try:
        converts = timing.conversions(timing.read_records(output_dir))
    except timing.TimingLogError:
        converts = []
    seconds, source = grace.conversion_estimate(converts, ckpt.size_bytes)
    return grace.Conversion(written_by=decided.written_by, world_size=world_size, checkpoint=str(ckpt.path),
                            seconds=seconds, source=source)


def staging_note(output_dir: str | os.PathLike[str], ranks_per_node: int) -> str | None:
    """The staging buffers' size for the launcher's plan, from the timing log's async saves; None: not knowable."""
    try:
        return grace.staging_line(timing.load_summary(output_dir).async_saves, ranks_per_node)
    except timing.TimingLogError:
        return None


# --- output ---------------------------------------------------------------------------------------------


def _table(result: GraceResult) -> list[str]:
    rows = [(t.name, f"{t.seconds:.2f}", t.source) for t in result.terms]
    rows.append(("needed", f"{result.needed_s:.2f}", f"--signal lead N = {result.lead_s} s (rounded up)"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'term':<{width}}  {'seconds':>9}  source"]
    lines += [f"{name:<{width}}  {secs:>9}  {src}" for name, secs, src in rows]
    return lines


def render_text(
    result: GraceResult, notes: list[str], warnings: list[str], report: CheckReport | None
) -> str:
    lines = [result.option, result.sbatch_line, result.export_line, "", *_table(result)]
    if notes:
        lines += ["", "notes:", *(f"  - {n}" for n in notes)]
    if warnings:
        lines += ["", "warnings:", *(f"  - {w}" for w in warnings)]
    if report is not None:
        verdict = "ENOUGH" if report.exit_code == EXIT_OK else "NOT ENOUGH"
        lines += ["", f"check {report.script.path}: {verdict}"]
        lines += [f"  {f.level.upper():<4}  {f.message}" for f in report.findings]
    return "\n".join(lines)


def render_json(result: GraceResult, facts: ClusterFacts, notes: list[str], warnings: list[str],
                samples: dict[str, Any], report: CheckReport | None,
                conversion: grace.Conversion | None = None) -> str:
    out: dict[str, Any] = {
        "signal_lead_s": result.lead_s, "option": result.option, "sbatch_line": result.sbatch_line,
        "export_line": result.export_line, "needed_s": result.needed_s,
        "terms": [asdict(t) for t in result.terms], "cluster": asdict(facts),
        "samples": samples, "notes": notes, "warnings": warnings,
        "conversion": asdict(conversion) if conversion is not None else None,
    }
    if report is not None:
        out["check"] = {"script": report.script.path, "exit_code": report.exit_code,
                        "findings": [asdict(f) for f in report.findings]}
    return json.dumps(out, indent=2)


# --- main -----------------------------------------------------------------------------------------------


def _job_script(job_id: str) -> tuple[SbatchScript, list[str]]:
    """A submitted job's batch script, with the job's real time limit and partition."""
    info = slurm.show_job(job_id)
    script = parse_script(slurm.job_script(job_id), path=f"job {job_id}")
    limit_s = slurm.seconds(info.get("TimeLimit", "")) if info.get("TimeLimit") else script.time_limit_s
    script = replace(script, time_limit_s=limit_s, partition=info.get("Partition") or script.partition)
    note = (f"job {job_id} ({info.get('JobState', '?')}): --signal read from its batch script; one given on "
            "the sbatch command line does not show in scontrol")
    return script, [note]


def run(argv: Sequence[str], env: Mapping[str, str]) -> tuple[int, str]:
    """(exit code, what to print) for one command line; raises GraceError and friends on bad input."""
    calc, check, goodput = build_parsers()
    if argv and argv[0] == "goodput":
        return EXIT_OK, goodput_cli.run(goodput.parse_args(list(argv[1:])), env)
    checking = bool(argv) and argv[0] == "check"
    args = (check if checking else calc).parse_args(list(argv[1:] if checking else argv))
    inputs, warnings, samples = gather_inputs(args, env)
    result = grace.compute_grace(inputs)
    report: CheckReport | None = None
    notes: list[str] = []
    conversion = next_conversion(args.from_dir, _world_size(args, env)) if args.from_dir else None
    if checking:
        script, notes = _job_script(args.job) if args.job else (read_script(args.script), [])
        facts = cluster_facts(args, script.partition)
        report = check_script(script, result, facts)
        lead_s = script.signal.lead_s if script.signal is not None else result.lead_s
        late = conversion and grace.conversion_finding(conversion, script.time_limit_s, lead_s, inputs.step_s)
        if late:
            report = replace(report, findings=(*report.findings, Finding(level="warn", message=late)))
    else:
        facts = cluster_facts(args, None)
        warnings += grace.cluster_notes(result, facts)[1]
    notes += grace.cluster_notes(result, facts)[0]
    if conversion is not None:
        notes.append(grace.conversion_note(conversion))
    if samples.get("async_saves"):
        notes.append(grace.async_note(samples["async_saves"]))
    if args.json:
        text = render_json(result, facts, notes, warnings, samples, report, conversion)
    else:
        text = render_text(result, notes, warnings, report)
    return (report.exit_code if report is not None else EXIT_OK), text


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code, text = run(sys.argv[1:] if argv is None else argv, os.environ)
    except (GraceError, timing.TimingLogError, slurm.SlurmError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130  # 128 + SIGINT, as a shell reports it
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `grace-calc ... | head -n1`: the reader left early; keep the exit code
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


if __name__ == "__main__":
    sys.exit(main())
