"""``python launch/submit.py``: size ``--signal=TERM@N``, print the plan, run the ckpt-check gate, submit.

    python launch/submit.py --nodes 2 --ntasks-per-node 4 --time 4:00:00 --output-dir out/ -- python train.py
    python launch/submit.py --config job.toml --dry-run        # print the generated sbatch script and exit
    python launch/submit.py status out/                        # or: status JOBID

Option names are sbatch's where one exists. The training command follows ``--`` (a program and its arguments,
passed as data: no shell sees them), or ``--function module:function`` (its arguments after ``--``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import tomllib

from slurm_jit import slurm, timing
from slurm_jit.grace import cli as grace_cli
from slurm_jit.grace.calc import GraceError, GraceResult, Term, compute_grace
from slurm_jit.grace.sbatch_script import ScriptError, parse_time_limit
from slurm_jit.launch import gate, script
from slurm_jit.launch.status import status_main

PROG = "python launch/submit.py"
EXIT_OK, EXIT_REFUSED, EXIT_ERROR = 0, 1, 2
DEFAULT_MAX_REQUEUES = 5  # judgement: enough for a week-long job on 1-day limits, few enough to stop a bad loop
# Options a TOML config may set: the long option names (dashes or underscores).
CONFIG_KEYS = ("output-dir", "nodes", "ntasks-per-node", "cpus-per-task", "mem", "gpus-per-node", "partition",
               "account", "qos", "time", "job-name", "max-requeues", "retry-on-failure", "sbatch-arg",
               "signal-lead", "step-time", "save-time", "eval-time", "kill-wait", "margin", "quarantine",
               "python", "function", "command")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{PROG}: error: {message}. HINT: see {PROG} --help\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a TOML file with any of the long options below (command = [argv...])")
    p.add_argument("--output-dir", help="the training's output directory (checkpoints, stop record)")
    s = p.add_argument_group("sbatch options (same names)")
    s.add_argument("-N", "--nodes", type=int)
    s.add_argument("--ntasks-per-node", type=int, help="one task per rank")
    s.add_argument("-c", "--cpus-per-task", type=int)
    s.add_argument("--mem")
    s.add_argument("--gpus-per-node")
    s.add_argument("-p", "--partition")
    s.add_argument("-A", "--account")
    s.add_argument("-q", "--qos")
    s.add_argument("-t", "--time", help="minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S")
    s.add_argument("-J", "--job-name")
    s.add_argument("--sbatch-arg", action="append", help="an extra sbatch option, e.g. --sbatch-arg=--exclusive")
    r = p.add_argument_group("requeue policy")
    r.add_argument("--max-requeues", type=int, help=f"most requeues of the job (default {DEFAULT_MAX_REQUEUES})")
    r.add_argument("--retry-on-failure", type=int, help="requeues after crashes, counted separately (default 0)")
    r.add_argument("--quarantine", action="store_true", default=None,
                   help="rename non-resumable checkpoints aside instead of refusing to start")
    g = p.add_argument_group("grace (N of --signal=TERM@N; see grace-calc --help)")
    g.add_argument("--signal-lead", type=int, help="N itself, instead of computing it")
    g.add_argument("--step-time", help="the longest step (default: from OUT_DIR's timing log)")
    g.add_argument("--save-time", help="the checkpoint save time (default: from OUT_DIR's timing log)")
    g.add_argument("--eval-time")
    g.add_argument("--kill-wait")
    g.add_argument("--margin")
    p.add_argument("--function", help="module:function to call in each rank instead of a command")
    p.add_argument("--python", help="the interpreter of the batch script and tasks (default: this one)")
    p.add_argument("--dry-run", action="store_true", help="print the generated sbatch script and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command and its arguments")
    return p


def _fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    print(f"{PROG}: {message}", file=sys.stderr)
    sys.exit(code)


def _load_config(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        _fail(f"cannot read config {path}: {exc}. HINT: a TOML file, e.g. time = \"30\"")
    config = {key.replace("_", "-"): value for key, value in raw.items()}
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        _fail(f"config {path}: unknown key(s) {', '.join(unknown)}. HINT: use {', '.join(CONFIG_KEYS)}")
    return config


def _merged(args: argparse.Namespace) -> argparse.Namespace:
    """Command-line options over the config file's."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    args.command = command
    config = _load_config(args.config) if args.config else {}
    for key, value in config.items():
        attr = key.replace("-", "_")
        if key == "command":
            if not args.command:
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    _fail("config: command must be a list of strings. HINT: command = [\"python\", \"train.py\"]")
                args.command = list(value)
        elif key == "sbatch-arg":
            args.sbatch_arg = list(value) + list(args.sbatch_arg or [])
        elif getattr(args, attr, None) is None:
            setattr(args, attr, value)
    return args


def _grace(args: argparse.Namespace, world_size: int) -> GraceResult:
    """N from --signal-lead, or from the grace calculator (given times over the output dir's timing log)."""
    if args.signal_lead is not None:
        lead = int(args.signal_lead)
        if lead < 1:
            raise GraceError(f"--signal-lead {lead}: must be 1 or more. HINT: e.g. --signal-lead 300")
        return GraceResult(terms=(Term(name="given", seconds=lead, source="--signal-lead"),), needed_s=lead,
                           lead_s=lead)
    has_log = Path(args.output_dir, timing.TIMING_DIR).is_dir() and bool(timing.read_records(args.output_dir))
    sizing = argparse.Namespace(
        from_dir=args.output_dir if has_log else None, step_time=args.step_time, save_time=args.save_time,
        eval_time=args.eval_time, no_eval=args.eval_time is None, kill_wait=args.kill_wait, margin=args.margin,
        step_stat="max", world_size=world_size, ckpt_bytes=None, ckpt_dir=None, params=None, dtype="bf16",
        optimizer="adamw", zero_stage=0, nodes=args.nodes, probe=None, probe_size="0", write_bandwidth=None,
    )
    inputs, warnings, _ = grace_cli.gather_inputs(sizing, {})
    for warning in warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    return compute_grace(inputs)


def build_job(args: argparse.Namespace) -> tuple[script.JobSpec, GraceResult]:
    if not args.output_dir:
        raise ValueError("no --output-dir. HINT: the directory the training writes its checkpoints to")
    if not args.time:
        raise ValueError("no --time. HINT: the job's time limit, e.g. --time 4:00:00 (minutes alone work too)")
    limit_s = parse_time_limit(str(args.time))
    args.output_dir = os.path.abspath(args.output_dir)
    args.nodes = int(args.nodes or 1)
    world_size = args.nodes * int(args.ntasks_per_node or 1)
    result = _grace(args, world_size)
    if limit_s is not None and result.lead_s >= limit_s:
        raise ValueError(f"--signal lead {result.lead_s} s is not shorter than --time {args.time} ({limit_s} s). "
                         f"HINT: a longer --time, or a faster step/save")
    job = script.JobSpec(
        output_dir=args.output_dir, nodes=args.nodes, ntasks_per_node=int(args.ntasks_per_node or 1),
        cpus_per_task=args.cpus_per_task, mem=args.mem, gpus_per_node=args.gpus_per_node,
        partition=args.partition, account=args.account, qos=args.qos, time=str(args.time),
        job_name=args.job_name or "slurm-jit", signal_lead_s=result.lead_s,
        max_requeues=DEFAULT_MAX_REQUEUES if args.max_requeues is None else int(args.max_requeues),
        retry_on_failure=int(args.retry_on_failure or 0), quarantine=bool(args.quarantine),
        python=args.python or sys.executable, extra_sbatch=tuple(args.sbatch_arg or ()),
    )
    return job, result


def training_spec(args: argparse.Namespace) -> dict[str, Any]:
    if args.function:
        if ":" not in args.function:
            raise ValueError(f"--function {args.function!r}. HINT: module:function, e.g. mypkg.train:main")
        return {"function": args.function, "args": list(args.command)}
    if not args.command:
        raise ValueError("no training command. HINT: put it after --, e.g. -- python train.py --lr 3e-4")
    return {"argv": list(args.command)}


def plan_lines(job: script.JobSpec, result: GraceResult, entry: Mapping[str, Any],
               checked: gate.GateResult) -> list[str]:
    terms = " + ".join(f"{t.name} {t.seconds:g} s ({t.source})" for t in result.terms)
    what = (f"{entry['function']}({' '.join(entry['args'])})" if "function" in entry
            else " ".join(json.dumps(a) if not a.isprintable() or " " in a else a for a in entry["argv"]))
    requeue = (f"after a JIT stop, requeue the same job (scontrol requeue) up to {job.max_requeues} times, only "
               "while it is running (never after scancel), the checkpoint passes ckpt-check and the step advanced; "
               f"after a crash: {job.retry_on_failure} retries")
    return [
        f"plan: {job.nodes} node(s) x {job.ntasks_per_node} task(s) = {job.world_size} ranks, one srun task each; "
        f"--time={job.time}",
        f"  training: {what}",
        f"  grace:    {terms} = {result.needed_s:g} s",
        f"  signal:   #SBATCH --signal=TERM@{result.lead_s} (no B:, so it reaches the ranks); "
        f"export SLURM_JIT_SIGNAL_LEAD_S={result.lead_s}",
        f"  requeue:  {requeue}",
        f"  resume:   {checked.message.removeprefix('ckpt-check gate: ')}",
    ]


def _submit(job: script.JobSpec, entry: Mapping[str, Any]) -> str:
    state_dir = Path(job.output_dir, timing.TIMING_DIR)
    state_dir.mkdir(parents=True, exist_ok=True)
    Path(job.spec_path).write_text(json.dumps(entry, indent=1) + "\n", encoding="utf-8")
    script_path = state_dir / "submit.sbatch"
    script_path.write_text(script.render(job), encoding="utf-8")
    log_path = str(Path(job.output_dir, "slurm-%j.out"))
    out = slurm.run(script.sbatch_argv(job, str(script_path), log_path))
    return out.strip().split(";")[0]


def submit_main(argv: Sequence[str]) -> int:
    args = _merged(_parser().parse_args(argv))
    try:
        job, result = build_job(args)
        entry = training_spec(args)
        checked = gate.check(job.output_dir, quarantine=False)
    except (ValueError, GraceError, ScriptError) as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot read {args.output_dir}: {exc.strerror or exc}. HINT: check the path and permissions")
    if not checked.ok and not job.quarantine:
        print("\n".join(plan_lines(job, result, entry, checked)), file=sys.stderr)
        _fail(checked.message, EXIT_REFUSED)
    print("\n".join(plan_lines(job, result, entry, checked)), file=sys.stderr if args.dry_run else sys.stdout)
    if args.dry_run:
        sys.stdout.write(script.render(job))
        return EXIT_OK
    try:
        job_id = _submit(job, entry)
    except slurm.SlurmError as exc:
        _fail(f"{exc}. HINT: is Slurm up (tools/local-slurm up)? Try --dry-run to see the script")
    print(f"submitted job {job_id}; log {job.output_dir}/slurm-{job_id}.out; "
          f"status: {PROG} status {job.output_dir}", flush=True)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["status"]:
        sys.exit(status_main(args[1:]))
    sys.exit(submit_main(args))


if __name__ == "__main__":
    main()
