"""``python launch/submit.py``: size ``--signal=TERM@N``, print the plan, run the ckpt-check gate, submit.

    python launch/submit.py --nodes 2 --ntasks-per-node 4 --time 4:00:00 --output-dir out/ -- python train.py
    python launch/submit.py --nodes 1-2 ...                    # each start (and requeue) on 1 or 2 nodes
    python launch/submit.py --config job.toml --dry-run        # print the generated sbatch script and exit
    python launch/submit.py status out/                        # or: status JOBID

Option names are sbatch's where one exists. The training command follows ``--`` (a program and its arguments,
passed as data: no shell sees them), or ``--function module:function`` (its arguments after ``--``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import tomllib

from slurm_jit import slurm
from slurm_jit.grace import save_advice
from slurm_jit.grace.calc import GraceError, GraceResult
from slurm_jit.grace.sbatch_script import ScriptError
from slurm_jit.launch import entry, gate, node_range, output_claim, policy, sbatch_options, submitit_hooks, task
from slurm_jit.launch.command import Command
from slurm_jit.launch.executor import FailedSubmission, JitExecutor
from slurm_jit.launch.plan import LOG_FOLDER, Launch, log_folder, plan_lines, submitted_lines, task_logs
from slurm_jit.launch.status import status_main
from slurm_jit.timing import TIMING_DIR
from slurm_jit.train.refusals import command_output_dir, output_dir_refusal

PROG = "python launch/submit.py"
EXIT_OK, EXIT_REFUSED, EXIT_ERROR = 0, 1, 2
DEFAULT_MAX_REQUEUES = 5  # judgement: enough for a week-long job on 1-day limits, few enough to stop a bad loop
# Options a TOML config may set: the long option names (dashes or underscores).
CONFIG_KEYS = ("output-dir", "nodes", "ntasks-per-node", "cpus-per-task", "mem", "gpus-per-node", "partition",
               "account", "qos", "time", "job-name", "max-requeues", "retry-on-failure", "retry-on-hang",
               "exclude-hung-node", "sbatch-arg",
               "signal-lead", "step-time", "save-time", "eval-time", "kill-wait", "margin", "quarantine",
               "python", "function", "command", "setup", "from")


# The TOML type of each config key (a wrong type is refused: TOML "no" is a string, and bool("no") is True).
_STR, _INT, _BOOL, _STR_LIST, _STR_OR_NUMBER = "a string", "an integer", "true or false", "a list of strings", \
    "a string or a number"
_NODES = 'an integer or a "MIN-MAX" range'
CONFIG_TYPES = {"output-dir": _STR, "nodes": _NODES, "ntasks-per-node": _INT, "cpus-per-task": _INT,
                "mem": _STR, "gpus-per-node": _STR_OR_NUMBER, "partition": _STR, "account": _STR, "qos": _STR,
                "time": _STR_OR_NUMBER, "job-name": _STR, "max-requeues": _INT, "retry-on-failure": _INT,
                "retry-on-hang": _INT, "exclude-hung-node": _BOOL,
                "sbatch-arg": _STR_LIST, "signal-lead": _INT, "step-time": _STR_OR_NUMBER,
                "save-time": _STR_OR_NUMBER, "eval-time": _STR_OR_NUMBER, "kill-wait": _STR_OR_NUMBER,
                "margin": _STR_OR_NUMBER, "quarantine": _BOOL, "python": _STR, "function": _STR,
                "command": _STR_LIST, "setup": _STR_LIST, "from": _STR}


def _type_ok(value: object, kind: str) -> bool:
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _NODES:
        return _type_ok(value, _INT) or isinstance(value, str) and node_range.looks_like_range(value)
    if kind == _STR:
        return isinstance(value, str)
    if kind == _STR_LIST:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{PROG}: error: {message}. HINT: see {PROG} --help\n")


def _parser() -> argparse.ArgumentParser:
    # No abbreviations: sbatch's own options would be taken for longer ones here (--ntasks 4, the job's total, as
    # --ntasks-per-node 4; --gpus as --gpus-per-node; --exclude NODE as --exclude-hung-node)
    p = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                allow_abbrev=False)
    p.add_argument("--config", help="a TOML file with any of the long options below (command = [argv...])")
    p.add_argument("--output-dir", help="the training's output directory (checkpoints, stop record)")
    s = p.add_argument_group("sbatch options (same names)")
    s.add_argument("-N", "--nodes", metavar="N|MIN-MAX",
                   help="nodes; sbatch's range MIN-MAX lets each start (and requeue) run on fewer nodes, the "
                        "trainer keeping the global batch")
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
    r.add_argument("--retry-on-hang", type=int,
                   help=f"requeues after a hang or a lost peer, from the newest complete checkpoint, counted "
                        f"separately (default {policy.DEFAULT_RETRY_ON_HANG})")
    r.add_argument("--exclude-hung-node", action="store_true", default=None,
                   help="the requeued job excludes the node of the hung rank (or lost peer)")
    r.add_argument("--quarantine", action="store_true", default=None,
                   help="rename non-resumable checkpoints aside instead of refusing to start")
    g = p.add_argument_group("grace (N of --signal=TERM@N; see grace-calc --help)")
    g.add_argument("--signal-lead", type=int, help="N itself, instead of computing it")
    g.add_argument("--step-time", help="the longest step (default: from OUT_DIR's timing log)")
    g.add_argument("--save-time", help="the checkpoint save time (default: from OUT_DIR's timing log)")
    g.add_argument("--eval-time")
    g.add_argument("--kill-wait")
    g.add_argument("--margin")
    g.add_argument("--from", dest="from_dir", metavar="OUT_DIR",
                   help="the step, save and eval times an earlier run measured in OUT_DIR's timing log (as "
                        "grace-calc --from; default: --output-dir's own)")
    p.add_argument("--setup", action="append", metavar="LINE",
                   help="a shell line the batch script runs before srun (submitit's setup), e.g. "
                        "--setup 'module load cuda'; repeatable, in order")
    p.add_argument("--function", help="module:function to call in each rank instead of a command")
    p.add_argument("--python", help="the interpreter of the batch script and tasks (default: this one)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and the exact sbatch argv (stderr) and the batch script (stdout); writes "
                        "nothing, needs no sbatch")
    p.add_argument("--explain", action="store_true",
                   help="under the plan, where each figure comes from: the grace terms' sources, the save advice's "
                        "arithmetic, the requeue policy's conditions")
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
    for key, value in config.items():
        if not _type_ok(value, CONFIG_TYPES[key]):
            _fail(f"config {path}: {key} = {value!r} is not {CONFIG_TYPES[key]}. HINT: e.g. nodes = 2, "
                  'time = "4:00:00", quarantine = true, command = ["python", "train.py"]')
    return config


def _merged(args: argparse.Namespace) -> argparse.Namespace:
    """Command-line options over the config file's."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    args.command = command
    # argparse hands --sbatch-arg=-- over as an empty list (it strips "--" from values): it was "--"
    args.sbatch_arg = [a if isinstance(a, str) else "--" for a in args.sbatch_arg or []] or None
    config = _load_config(args.config) if args.config else {}
    for key, value in config.items():
        attr = "from_dir" if key == "from" else key.replace("-", "_")
        if key == "command":
            if not args.command:
                args.command = list(value)
        elif key in ("sbatch-arg", "setup"):
            setattr(args, attr, list(value) + list(getattr(args, attr) or []))
        elif getattr(args, attr, None) is None:
            setattr(args, attr, value)
    return args


def _grace(args: argparse.Namespace) -> GraceResult:
    """N from --signal-lead, or from the grace calculator (given times over the output dir's timing log), for the
    fewest nodes a start may get: with the global batch kept, their optimizer step is the longest."""
    result, warnings = sbatch_options.signal_lead(
        args.output_dir, world_size=args.nodes.min_nodes * args.ntasks_per_node, nodes=args.nodes.min_nodes,
        step_time=args.step_time,
        save_time=args.save_time, eval_time=args.eval_time, kill_wait=args.kill_wait, margin=args.margin,
        given_lead_s=None if args.signal_lead is None else int(args.signal_lead), from_dir=args.from_dir)
    sbatch_options.warn(PROG, warnings)
    return result


def _count(value: object, option: str, *, default: int, minimum: int) -> int:
    """An integer option (0 is not "unset": --nodes 0 is refused, not taken for 1)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{option} {value}: must be a whole number, {minimum} or more. HINT: e.g. {option} "
                         f"{max(minimum, 1)}")
    return value


# What may stand in an #SBATCH value (submitit quotes it; a Slurm value never needs a blank, quote or #).
SAFE_DIRECTIVE_VALUE = re.compile(r"[A-Za-z0-9_.,:@=/+%-]+")
OLD_LOG = "slurm-{job_id}.out"  # the log's path before submit.py ran on JitExecutor: kept as a link to task 0's


def _check_values(args: argparse.Namespace) -> None:
    for name in ("mem", "gpus_per_node", "partition", "account", "qos", "time"):
        value = getattr(args, name)
        if value is not None and not SAFE_DIRECTIVE_VALUE.fullmatch(str(value)):
            raise ValueError(f"--{name.replace('_', '-')} {value!r}: not a valid Slurm value. "
                             "HINT: letters, digits and . , : - _ only")
    for option, value in (("--job-name", args.job_name), ("--python", args.python)):
        if value is not None and not str(value).strip():
            raise ValueError(f"{option} is empty. HINT: leave it out for the default")
    args.python = job_python(args.python)
    if args.job_name is not None:
        sbatch_options.check_job_name(args.job_name)
    if re.search(r"%[jtAa]", args.output_dir):
        raise ValueError(f"--output-dir {args.output_dir!r} holds %j, %t, %A or %a, which submitit's log folder "
                         "reads as the job's id or task. HINT: a directory name without them")


def job_python(python: str | None) -> str:
    """The job's interpreter: ``--python`` (a path, or a name found on PATH here), default the one running this;
    ValueError for one that does not exist or cannot be run (every rank would fail to start)."""
    if python is None:
        return sys.executable
    if os.sep in python:
        python = os.path.expanduser(python)  # quoted in the script, where no shell would expand ~
    found = shutil.which(python) if os.sep not in python else python
    if found is None or not os.path.isfile(found) or not os.access(found, os.X_OK):
        what = "not found on PATH" if os.sep not in python else "not an executable file"
        raise ValueError(f"--python {python}: {what}, so no rank could start. HINT: the interpreter of the venv "
                         f"the job should use, e.g. --python ~/venvs/train/bin/python, or leave it out for this one "
                         f"({sys.executable})")
    refused = _import_refusal(found)
    if refused:
        raise ValueError(f"--python {python}: cannot import slurm_jit ({refused}), so the job's gate and every "
                         f"rank would fail at start. HINT: pip install slurm-jit into that venv (docs/install.md), "
                         f"or leave --python out for this one ({sys.executable})")
    return python


IMPORT_CHECK_S = 60  # `import slurm_jit` takes 0.04 s; a venv on a cold network filesystem, a lot longer


def _import_refusal(python: str) -> str | None:
    """Why ``python`` (with the environment the job inherits) cannot import slurm_jit, or None if it can."""
    try:
        proc = subprocess.run([python, "-c", "import slurm_jit"], capture_output=True, text=True, check=False,
                              timeout=IMPORT_CHECK_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return None if proc.returncode == 0 else last


def build_job(args: argparse.Namespace) -> Launch:
    if not args.output_dir:
        raise ValueError("no --output-dir. HINT: the directory the training writes its checkpoints to")
    if not args.time:
        raise ValueError("no --time. HINT: the job's time limit, e.g. --time 4:00:00 (minutes alone work too)")
    limit_s = sbatch_options.time_limit_s(str(args.time))
    args.output_dir = sbatch_options.check_output_dir(args.output_dir)
    args.nodes = node_range.parse(1 if args.nodes is None else args.nodes)
    args.ntasks_per_node = _count(args.ntasks_per_node, "--ntasks-per-node", default=1, minimum=1)
    if args.cpus_per_task is not None:
        args.cpus_per_task = _count(args.cpus_per_task, "--cpus-per-task", default=1, minimum=1)
    args.max_requeues = _count(args.max_requeues, "--max-requeues", default=DEFAULT_MAX_REQUEUES, minimum=0)
    args.retry_on_failure = _count(args.retry_on_failure, "--retry-on-failure", default=0, minimum=0)
    args.retry_on_hang = _count(args.retry_on_hang, "--retry-on-hang", default=policy.DEFAULT_RETRY_ON_HANG,
                                minimum=0)
    _check_values(args)
    sbatch_options.check_resources(args.mem, args.gpus_per_node)
    sbatch_options.check_extra_args(args.sbatch_arg or [])
    sbatch_options.check_environment(os.environ)
    result = _grace(args)
    if result.lead_s >= limit_s:
        raise ValueError(f"--signal lead {result.lead_s} s is not shorter than --time {args.time} ({limit_s} s). "
                         f"HINT: a longer --time, or a faster step/save")
    spec = training_spec(args)
    problem = submitit_hooks.problem()
    if problem is not None:
        raise ValueError(problem)
    executor = JitExecutor(
        folder=log_folder(args.output_dir), output_dir=args.output_dir, max_requeues=args.max_requeues,
        retry_on_failure=args.retry_on_failure, retry_on_hang=args.retry_on_hang,
        exclude_hung_node=bool(args.exclude_hung_node), signal_lead_s=result.lead_s, quarantine=bool(args.quarantine),
        python=shlex.quote(args.python), sbatch_args=tuple(args.sbatch_arg or ()))
    executor.update_parameters(**_parameters(args))
    what: tuple[Any, ...] = ((Command(spec["argv"]),) if "argv" in spec
                             else (task.call_function, spec["function"], list(spec["args"])))
    return Launch(executor=executor, entry=what, grace=result, training=spec, time=str(args.time),
                  python=args.python, saves=save_advice.for_job(
                      args.from_dir or args.output_dir, gpus_per_node=args.gpus_per_node, nodes=args.nodes.max_nodes,
                      ranks_per_node=args.ntasks_per_node, time_limit_s=float(limit_s), step_time=args.step_time,
                      save_time=args.save_time))


def _parameters(args: argparse.Namespace) -> dict[str, Any]:
    """The options as submitit's raw parameters (each task's stderr in its log: one log per task, as the single
    log before)."""
    # wckey None: submitit's default wckey "submitit"; the CLI's jobs never had one
    params: dict[str, Any] = {"nodes": args.nodes.sbatch_value(), "ntasks_per_node": args.ntasks_per_node,
                              "time": str(args.time), "job_name": args.job_name or "slurm-jit",
                              "stderr_to_stdout": True, "wckey": None}
    for name in ("cpus_per_task", "mem", "gpus_per_node", "partition", "account", "qos"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    if args.setup:
        params["setup"] = list(args.setup)
    return params


def _is_this_python(python: str | None) -> bool:
    """Whether the job's interpreter is this one (then its module path is ours to search)."""
    found = shutil.which(python) if python else sys.executable
    return found is not None and os.path.abspath(found) == os.path.abspath(sys.executable)  # a venv: not realpath


def training_spec(args: argparse.Namespace) -> dict[str, Any]:
    if args.function:
        entry.check_function(args.function, here=_is_this_python(args.python))
        return {"function": args.function, "args": list(args.command)}
    if not args.command:
        raise ValueError("no training command. HINT: put it after --, e.g. -- python train.py --lr 3e-4")
    program = args.command[0]
    if not program.strip():
        raise ValueError("the training command's program is empty. HINT: e.g. -- python train.py")
    entry.check_program(program)
    script_dir = command_output_dir(list(args.command))  # the ranks' JitTrainer would refuse it at once, in the job
    mismatch = output_dir_refusal(script_dir, args.output_dir) if script_dir is not None else None
    if mismatch:
        raise ValueError(f"the training command's {mismatch}")
    return {"argv": list(args.command)}


def _submit(launch: Launch) -> str:
    """Submit through the executor (it refuses while a job submitted into the directory may still run, writes
    the script, calls sbatch, keeps the script as ``OUT_DIR/slurm-jit/job-<id>.sbatch``); then the old log path
    as a link to task 0's log."""
    Path(launch.output_dir, TIMING_DIR).mkdir(parents=True, exist_ok=True)
    job_id = str(launch.executor.submit(*launch.entry).job_id)
    old = Path(launch.output_dir, OLD_LOG.format(job_id=job_id))
    try:
        old.symlink_to(Path(TIMING_DIR, LOG_FOLDER, f"{job_id}_0_log.out"))
    except OSError as exc:  # the job is queued: never fail it for a convenience link
        print(f"{PROG}: warning: cannot link {old} to task 0's log ({exc.strerror}). HINT: read "
              f"{task_logs(launch, job_id)}", file=sys.stderr)
    return job_id


# What sbatch (or the gateway) says when no controller answers, as opposed to refusing the job's options.
TIMED_OUT = "did not answer within"  # the gateway's words for a command killed at its timeout
NO_JOB_ID = "not a job id"
NO_CONTROLLER = ("not found on PATH", "Unable to contact slurm controller",
                 "Could not establish a configuration source", "Invalid user for SlurmUser")


def _sbatch_hint(message: str, launch: Launch) -> str:
    if TIMED_OUT in message or NO_JOB_ID in message:
        return ("the job may have been queued all the same (held: sbatch --hold): check squeue --me "
                f"--name={shlex.quote(launch.executor.job_name)} before submitting again")
    if any(words in message for words in NO_CONTROLLER):
        return "is Slurm up (tools/local-slurm up)? Try --dry-run to see the script"
    return "sbatch refused the job: fix the option its message names; --dry-run shows the script"


def _check(args: argparse.Namespace) -> tuple[Launch, gate.GateResult]:
    try:
        launch = build_job(args)
        checked = gate.check(launch.output_dir, quarantine=False, world_size=launch.world_size)
    except (ValueError, GraceError, ScriptError) as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot read {args.output_dir}: {exc.strerror or exc}. HINT: check the path and permissions")
    if not checked.ok and not launch.executor.quarantine:
        print("\n".join(plan_lines(launch, checked, explain=bool(args.explain))), file=sys.stderr)
        _fail(checked.message, EXIT_REFUSED)
    return launch, checked


def submit_main(argv: Sequence[str]) -> int:
    args = _merged(_parser().parse_args(argv))
    launch, checked = _check(args)
    try:
        if not args.dry_run:
            output_claim.check_free(launch.output_dir)  # again under the submit lock, before sbatch
    except ValueError as exc:
        _fail(str(exc), EXIT_REFUSED)
    print("\n".join(plan_lines(launch, checked, explain=bool(args.explain))),
          file=sys.stderr if args.dry_run else sys.stdout)
    if args.dry_run:
        sys.stdout.write(launch.executor.submission_text(launch.entry[0]))
        return EXIT_OK
    try:
        job_id = _submit(launch)
    except OSError as exc:
        _fail(f"cannot write to {launch.output_dir}: {exc.strerror or exc}. HINT: an output directory you can "
              "write to, on storage every node sees")
    except ValueError as exc:  # JitExecutorError: the directory is in use, a pickling failure, a refused gate
        _fail(str(exc), EXIT_REFUSED)
    except (slurm.SlurmError, FailedSubmission) as exc:
        _fail(f"{str(exc).removesuffix('.')}. HINT: {_sbatch_hint(str(exc), launch)}")
    print("\n".join(submitted_lines(launch, job_id, [*PROG.split(" "), "status", shlex.quote(launch.output_dir)])),
          flush=True)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["status"]:
        sys.exit(status_main(args[1:]))
    sys.exit(submit_main(args))


if __name__ == "__main__":
    main()
