"""Checks every JIT launcher shares (``python launch/submit.py`` and any executor built on it).

- :func:`check_extra_args`: refuse extra sbatch arguments that would set an option the launcher owns, read as
  sbatch's ``getopt_long`` reads them: unique prefixes of long options (``--sig=``, ``--no-requ``, ``--out=``),
  clusters of short ones (``-vt1`` is ``-v -t 1``), values in the next argument (``-t 5``), and words that
  sbatch would take for the batch script itself;
- :func:`check_output_dir`: an output directory sbatch's ``--output`` pattern and the job's tools can carry;
- :func:`check_job_name`: a job name ``scontrol show job`` prints on one line;
- :func:`check_resources`, :func:`time_limit_s`: ``--mem``, ``--gpus-per-node`` and a ``--time`` sbatch takes,
  refused before anything is written (a job with no time limit never gets its warning);
- :func:`signal_lead`: the one calculation of N of ``--signal=TERM@N`` (submit and ``status`` both print it).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence

from slurm_jit import timing
from slurm_jit.grace import calc as grace_calc
from slurm_jit.grace import cli as grace_cli
from slurm_jit.grace.calc import GraceError, GraceResult, Term, compute_grace
from slurm_jit.grace.sbatch_script import parse_time_limit

# sbatch options the JIT job writes itself (sbatch's command line wins over #SBATCH lines, so an extra argument
# would silently replace them), with their one-letter forms. --signal without the JIT lead, --no-requeue, an
# --output or --error elsewhere (the job's log and its HINT lines), --open-mode=truncate (a requeue wipes the log
# of the run before), --array (every element would write the same output directory), --wait/--test-only (no job
# id on stdout), --parsable and --wrap (the launcher's own).
OWNED_LONG = ("nodes", "ntasks-per-node", "tasks-per-node", "ntasks", "cpus-per-task", "mem", "gpus-per-node",
              "partition", "account", "qos", "time", "job-name", "signal", "requeue", "no-requeue", "open-mode",
              "output", "error", "array", "wait", "test-only", "parsable", "wrap")
OWNED_SHORT = {"N": "nodes", "n": "ntasks", "c": "cpus-per-task", "p": "partition", "A": "account", "q": "qos",
               "t": "time", "J": "job-name", "o": "output", "e": "error", "a": "array", "W": "wait"}
# sbatch(1)'s long options (Slurm 20.11 to 24.x; 22.05's checked against its own "ambiguous" lists), by argument:
# getopt_long needs the whole table to tell an exact name (--gpus, --mem) from a prefix of a longer one
# (--gpus-per-node, --mem-per-cpu). --tasks-per-node is a hidden alias of --ntasks-per-node.
_NO_ARG = ("contiguous", "help", "hold", "ignore-pbs", "no-requeue", "overcommit", "oversubscribe", "parsable",
           "quiet", "reboot", "requeue", "spread-job", "test-only", "usage", "use-min-nodes", "verbose",
           "version", "wait", "stepmgr")
_OPTIONAL_ARG = ("exclusive", "get-user-env", "nice", "no-kill", "propagate", "export", "oom-kill-step")
_REQUIRED_ARG = (
    "account", "acctg-freq", "array", "batch", "bb", "bbf", "begin", "chdir", "cluster", "cluster-constraint",
    "clusters", "comment", "constraint", "container", "container-id", "context", "core-spec", "cores-per-socket",
    "cpu-freq", "cpus-per-gpu", "cpus-per-task", "deadline", "delay-boot", "dependency", "distribution", "error",
    "exclude", "export-file", "extra", "extra-node-info", "gid", "gpu-bind", "gpu-freq", "gpus", "gpus-per-node",
    "gpus-per-socket", "gpus-per-task", "gres", "gres-flags", "hint", "input", "job-name", "kill-on-invalid-dep",
    "licenses", "mail-type", "mail-user", "mcs-label", "mem", "mem-bind", "mem-per-cpu", "mem-per-gpu", "mincpus",
    "network", "nodefile", "nodelist", "nodes", "ntasks", "ntasks-per-core", "ntasks-per-gpu", "ntasks-per-node",
    "ntasks-per-socket", "ntasks-per-tres", "open-mode", "output", "partition", "power", "prefer", "priority",
    "profile", "qos", "reservation", "segment", "signal", "sockets-per-node", "switches", "tasks-per-node",
    "thread-spec", "threads-per-core", "time", "time-min", "tmp", "tres-bind", "tres-per-task", "uid",
    "wait-all-nodes", "wckey", "wrap",
)
LONG_OPTIONS = {**dict.fromkeys(_NO_ARG, "no"), **dict.fromkeys(_OPTIONAL_ARG, "optional"),
                **dict.fromkeys(_REQUIRED_ARG, "required")}
# sbatch's one-letter options that take an argument (attached, -t5, or the next word); the others take none.
SHORT_WITH_ARG = frozenset("aAbBcCdDeFGiJLmMnNopqStwx")
# Characters sbatch's --output pattern treats specially: "%" starts a replacement (%j, %x, %%), and a backslash
# anywhere turns every replacement off (sbatch(1), filename pattern), the job id of slurm-%j.out included.
PATTERN_BACKSLASH = "\\"


class OptionError(ValueError):
    """An extra sbatch argument the launcher refuses; one line with a HINT."""


def _refuse(arg: str, owned: str, who: str) -> OptionError:
    return OptionError(f"--sbatch-arg={arg} sets --{owned}, which {who} writes itself (sbatch's command line would "
                       f"override it). HINT: use {who}'s own option for it, or leave it out")


def long_option(name: str) -> tuple[str | None, list[str]]:
    """(the option getopt_long takes ``--name`` for, or None; every option it could mean). An exact name wins;
    else a unique prefix; several candidates are ambiguous (sbatch refuses them, and so do we if one is owned)."""
    if name in LONG_OPTIONS:
        return name, [name]
    candidates = sorted(option for option in LONG_OPTIONS if option.startswith(name)) if name else []
    return (candidates[0] if len(candidates) == 1 else None), candidates


def _check_long(arg: str, who: str) -> bool:
    """Refuse an owned ``--name[=value]``; True when it takes the next argument as its value."""
    name, has_value, _ = arg[2:].partition("=")
    option, candidates = long_option(name)
    owned = next((c for c in candidates if c in OWNED_LONG), None)
    if owned is not None and option is None:  # ambiguous: sbatch refuses it, and it could mean an owned one
        raise OptionError(f"--sbatch-arg={arg} is an ambiguous prefix of {', '.join('--' + c for c in candidates)}"
                          f": it could set --{owned}, which {who} writes itself. HINT: spell the option out")
    if owned is not None:
        raise _refuse(arg, owned, who)
    return option is not None and not has_value and LONG_OPTIONS[option] == "required"


def _check_short(arg: str, who: str) -> bool:
    """Refuse a cluster of short options (``-vt1``) holding an owned letter; True when its last letter takes the
    next argument as its value."""
    for index, letter in enumerate(arg[1:], start=1):
        if letter in OWNED_SHORT:
            raise _refuse(arg, OWNED_SHORT[letter], who)
        if letter in SHORT_WITH_ARG:
            return index == len(arg) - 1  # the rest of the word is the value; none left: the next word is
    return False


def check_extra_args(extra: Sequence[str], who: str = "submit.py") -> None:
    """Raise :class:`OptionError` when ``extra`` (sbatch arguments put before the script) would set an owned
    option, end in an option missing its value, or hold a word sbatch would take for the batch script. ``who``
    names the launcher in the message."""
    takes_value = False
    for arg in extra:
        if takes_value:  # the previous option's value; an owned-looking one is refused all the same
            takes_value = False
            if arg.startswith("--") and len(arg) > 2:
                _check_long(arg, who)
            continue
        if arg == "--" or not arg.startswith("-") or arg == "-":
            raise OptionError(f"--sbatch-arg={arg!r} is not an sbatch option: sbatch would take it for the batch "
                              "script. HINT: one option per --sbatch-arg, with its value after '=' "
                              "(--sbatch-arg=--exclusive, --sbatch-arg=--constraint=a100)")
        takes_value = _check_long(arg, who) if arg.startswith("--") else _check_short(arg, who)
    if takes_value:
        raise OptionError(f"--sbatch-arg={extra[-1]} needs a value: sbatch would take the batch script's path for "
                          f"it. HINT: give it after '=', e.g. --sbatch-arg={extra[-1]}=VALUE")


# sbatch's input environment variables for options the script sets: they win over #SBATCH lines (sbatch(1),
# INPUT ENVIRONMENT VARIABLES), so SBATCH_NO_REQUEUE=1 in a login shell's profile would make the job one that
# cannot be requeued, SBATCH_TIMELIMIT one whose --signal lead was sized for another limit.
OWNED_ENV = {"SBATCH_SIGNAL": "signal", "SBATCH_REQUEUE": "requeue", "SBATCH_NO_REQUEUE": "no-requeue",
             "SBATCH_OPEN_MODE": "open-mode", "SBATCH_TIMELIMIT": "time", "SBATCH_ARRAY_INX": "array",
             "SBATCH_WAIT": "wait", "SBATCH_ERROR": "error"}


def check_environment(env: Mapping[str, str], who: str = "submit.py") -> None:
    """OptionError when ``env`` sets an sbatch input variable that would override an option the launcher
    writes into the script."""
    found = sorted(name for name in OWNED_ENV if name in env)
    if found:
        names = ", ".join(f"{name} (--{OWNED_ENV[name]})" for name in found)
        raise OptionError(f"{names} set in the environment: sbatch would take it over the script's own option, "
                          f"which {who} writes. HINT: unset {' '.join(found)} for this submit")


def check_output_dir(path: str) -> str:
    """The absolute output directory; ValueError for one sbatch's ``--output`` pattern or a one-line record
    cannot carry (a control character, a line break, a backslash)."""
    bad = sorted({repr(ch) for ch in path if not ch.isprintable() or ch == PATTERN_BACKSLASH})
    if bad:
        raise ValueError(f"--output-dir {path!r} holds {', '.join(bad)}: sbatch's --output pattern (a backslash "
                         "turns off %j) and the job's one-line records cannot carry it. HINT: a directory name "
                         "of printable characters, without a backslash")
    return os.path.abspath(path)


def check_job_name(name: str) -> None:
    """ValueError for a job name with a control character: ``scontrol show job`` prints it unescaped, where a
    line break could make it read as another field (the job's state)."""
    if not name.strip() or not name.isprintable():
        raise ValueError(f"--job-name {name!r}: empty or holding a control character. HINT: a printable name, "
                         "e.g. --job-name train-gpt")


# sbatch(1)'s value forms, as Slurm reads them: --mem's str_to_mbytes (a whole number, an optional K/M/G/T unit
# and B; 0 is "all the node's memory"), --gpus-per-node's "[type:]count", comma-separated per type.
MEM_VALUE = re.compile(r"\d+(?:[KMGTkmgt][Bb]?)?")
GPUS_VALUE = re.compile(r"(?:[A-Za-z0-9_.-]+:)?\d+(?:,(?:[A-Za-z0-9_.-]+:)?\d+)*")
NO_TIME_LIMIT = "0, UNLIMITED or INFINITE"  # sbatch(1): a time limit of 0 means none


def check_resources(mem: object, gpus_per_node: object) -> None:
    """ValueError (one line, HINT) for a ``--mem`` or ``--gpus-per-node`` sbatch would refuse (after the launcher
    wrote the job's files, were it left to sbatch)."""
    if mem is not None and not MEM_VALUE.fullmatch(str(mem)):
        raise ValueError(f"--mem {mem}: not a memory size sbatch reads. HINT: a whole number with an optional unit "
                         "K, M, G or T (default M), e.g. --mem 64G")
    if gpus_per_node is not None and not GPUS_VALUE.fullmatch(str(gpus_per_node)):
        raise ValueError(f"--gpus-per-node {gpus_per_node}: not sbatch's [type:]count. HINT: a whole number of GPUs "
                         "per node, 0 or more, e.g. --gpus-per-node 4 or --gpus-per-node a100:4")


def time_limit_s(time: str) -> int:
    """``--time`` in seconds; ValueError (one line, HINT) for none (0, UNLIMITED, INFINITE, 00): Slurm would never
    send the job its --signal warning, so no JIT stop could ever happen."""
    limit_s = parse_time_limit(time)
    if not limit_s:
        raise ValueError(f"--time {time}: no time limit ({NO_TIME_LIMIT}), so Slurm would never send the job its "
                         "--signal warning and no JIT checkpoint would ever be saved. HINT: the limit the job runs "
                         "under, e.g. --time 4:00:00 (the partition's MaxTime at most)")
    return limit_s


def _timing_log_world_size(output_dir: str) -> int | None:
    """The world size of the newest run in the output dir's timing log (None: no log, or none recorded)."""
    try:
        records = timing.read_records(output_dir) if os.path.isdir(timing.timing_dir(output_dir)) else []
    except (OSError, ValueError):
        return None
    sizes = [r["world_size"] for r in records if isinstance(r.get("world_size"), int)]
    return sizes[-1] if sizes else None


# Why the launcher counts no evaluation unless --eval-time says so (train/evaluation.py aborts one at a stop).
NO_EVAL_SOURCE = "the JitTrainer aborts an evaluation a stop lands in; --eval-time to count one"
NO_SAVE_HINT = "give --save-time, or --from the OUT_DIR of a run that saved a checkpoint"  # submit.py's options


def signal_lead(output_dir: str, *, world_size: int | None = None, nodes: int | None = None,
                step_time: str | None = None, save_time: str | None = None, eval_time: str | None = None,
                kill_wait: str | None = None, margin: str | None = None,
                given_lead_s: int | None = None, from_dir: str | None = None) -> tuple[GraceResult, list[str]]:
    """N of ``--signal=TERM@N`` and its terms, with warnings: ``given_lead_s`` itself, or the grace calculator
    over the given times and the timing log of ``from_dir`` (an earlier run's OUT_DIR; default ``output_dir``;
    ``world_size`` None: its newest run's). Raises GraceError (one line with a HINT) when neither is enough."""
    if from_dir is not None and not _has_timing_log(from_dir):
        raise GraceError(f"--from {from_dir}: no timing log with records there ({timing.timing_dir(from_dir)}). "
                         "HINT: the --output-dir of a run the JitTrainer trained in, or give --step-time and "
                         "--save-time")
    if given_lead_s is not None:
        times = {"--step-time": step_time, "--save-time": save_time, "--eval-time": eval_time,
                 "--kill-wait": kill_wait, "--margin": margin}
        return _given_lead(given_lead_s, times, from_dir), []
    log_dir = from_dir or output_dir
    world_size = world_size or _timing_log_world_size(log_dir)
    has_log = _has_timing_log(log_dir)
    sizing = argparse.Namespace(
        from_dir=log_dir if has_log else None, step_time=step_time, save_time=save_time, eval_time=eval_time,
        no_eval=eval_time is None, no_eval_source=NO_EVAL_SOURCE,
        no_save_hint=NO_SAVE_HINT, kill_wait=kill_wait, margin=margin, step_stat="max", world_size=world_size,
        ckpt_bytes=None, ckpt_dir=None, params=None, dtype="bf16", optimizer="adamw", zero_stage=0,
        nodes=nodes or 1, probe=None, probe_size="0", write_bandwidth=None,
    )
    inputs, warnings, _ = grace_cli.gather_inputs(sizing, {})
    return compute_grace(inputs), warnings


def _given_lead(lead_s: int, times: Mapping[str, str | None], from_dir: str | None) -> GraceResult:
    """``--signal-lead N`` itself. The times and ``--from`` it overrides are still read (a typo is refused, not
    dropped unseen) and named in the term's source, which the plan prints."""
    if lead_s < 1:
        raise GraceError(f"--signal-lead {lead_s}: must be 1 or more. HINT: e.g. --signal-lead 300")
    for option, value in times.items():
        if value is None:
            continue
        if option == "--margin":
            grace_calc.parse_margin(value)
        else:
            grace_calc.parse_duration(value, what=option, allow_zero=option == "--kill-wait")
    overridden = [f"{option} {value}" for option, value in times.items() if value is not None]
    overridden += [f"--from {from_dir}"] if from_dir is not None else []
    source = "--signal-lead" + (f"; it overrides {', '.join(overridden)} (not used)" if overridden else "")
    return GraceResult(terms=(Term(name="given", seconds=lead_s, source=source),), needed_s=lead_s, lead_s=lead_s)


def _has_timing_log(output_dir: str) -> bool:
    """A timing log with records (a slurm-jit/ folder from an earlier submit may hold none yet)."""
    if not os.path.isdir(timing.timing_dir(output_dir)):
        return False
    try:
        return bool(timing.read_records(output_dir))
    except ValueError:
        return False


def warn(prog: str, warnings: Sequence[str]) -> None:
    for warning in warnings:
        print(f"{prog}: warning: {warning}", file=sys.stderr)
