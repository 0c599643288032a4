"""Reading an sbatch script: its ``#SBATCH --signal``, ``--time``, ``--partition``, ``--nodes`` and how it starts
training. Judging it against a computed grace period is :mod:`slurm_jit.grace.script_check`'s.

Pure: no Slurm calls, no torch. The Slurm rules applied are stated in :mod:`slurm_jit.grace.calc`.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
from dataclasses import dataclass

from slurm_jit import signal_names
from slurm_jit.grace.calc import (
    LEAD_ENV_VAR,
    SLURM_SIGNAL_LEAD_MAX_S,
    GraceError,
)
from slurm_jit.launch import node_range
from slurm_jit.launch.node_range import NodeRange

SBATCH_PREFIX = "#SBATCH"
# sbatch(1) --signal: "If a sig_num is specified without any sig_time, the default time will be 60 seconds."
SIGNAL_DEFAULT_LEAD_S = 60

LAUNCHER_PROGRAMS = {"torchrun": "torchrun", "deepspeed": "deepspeed", "accelerate": "accelerate"}
# `python -m MODULE` forms of the same launchers.
LAUNCHER_MODULES = {
    "torch.distributed.run": "torchrun",
    "torch.distributed.launch": "torchrun",
    "deepspeed.launcher.runner": "deepspeed",
    "accelerate.commands.launch": "accelerate",
}
_PYTHON_RE = re.compile(r"python[\d.]*")
# Words that run the rest of the command line in the same process tree (signals pass through unchanged).
_TRANSPARENT_PREFIXES = {"exec", "time", "nohup", "command", "then", "do", "else", "if", "while", "until"}
_SEPARATORS = {";", "&&", "||", "|", "&", "\n", "(", ")", "{", "}"}


class ScriptError(GraceError):
    """The script (or one of its options) cannot be read; the message says where and how to fix it."""


@dataclass(frozen=True, kw_only=True)
class SignalSpec:
    """A parsed ``--signal=[{R|B}:]<sig_num>[@sig_time]``."""

    name: str  # signal name without "SIG" ("TERM", "USR1"), also when given as a number
    lead_s: int  # sig_time: seconds before the end time at which the signal is sent
    batch_only: bool  # "B:" was given: only the batch shell is signalled, none of the job steps
    text: str  # the value as written in the script


@dataclass(frozen=True, kw_only=True)
class Launch:
    """One command of the script that starts (or may start) the training processes."""

    lineno: int  # 1-based line of the script where the command starts
    text: str  # the command as written (continuation lines joined)
    via_srun: bool  # started through srun, so it runs in a job step
    uses_exec: bool  # `exec ...`: replaces the batch shell instead of running as its child
    background: bool  # followed by `&`
    launcher: str | None  # "torchrun", "deepspeed" or "accelerate" between Slurm and Python; None if none
    runs_python: bool  # Python runs (directly or under the launcher); False: a program we cannot see into


@dataclass(frozen=True, kw_only=True)
class SbatchScript:
    """What the grace-period check needs from a batch script."""

    path: str  # where it was read from ("job 123" for a submitted job's script)
    signal: SignalSpec | None  # the effective --signal (the last one wins, as in sbatch), None when absent
    signal_lineno: int | None  # the line of that --signal
    ignored_signal_lineno: int | None  # a #SBATCH --signal after the first command, which sbatch ignores
    time_limit_s: int | None  # --time in seconds; None when not given or unlimited
    partition: str | None  # --partition, None when not given
    launches: tuple[Launch, ...]  # the commands that start training, in script order
    side_launches: tuple[Launch, ...]  # python run by the batch shell beside an srun training: pre/post steps
    traps_signal: bool  # the script sets a `trap ... TERM` (or the --signal's own name)
    exported_lead: str | None  # the value of `export SLURM_JIT_SIGNAL_LEAD_S=...` as written, None if absent
    nodes: NodeRange | None = None  # --nodes / -N, None when not given


def signal_name(sig: str) -> str:
    """Normalise ``TERM``, ``SIGTERM``, ``15`` to ``TERM``; raises ScriptError for an unknown name."""
    try:
        text = sig.strip()
        return signal_names.parse_signal(int(text) if text.isdigit() else text).name.removeprefix("SIG")
    except ValueError:
        raise ScriptError(f"unknown signal {sig!r} in --signal. HINT: use --signal=TERM@N") from None


def parse_signal(value: str) -> SignalSpec:
    """Parse the value of ``--signal`` as sbatch(1) defines it."""
    match = re.fullmatch(r"(?:([A-Za-z]+):)?([A-Za-z0-9]+)(?:@(\S*))?", value.strip())
    if not match:
        raise ScriptError(f"cannot read --signal={value}. HINT: write it as --signal=TERM@N")
    flags, sig, lead = match.group(1) or "", match.group(2), match.group(3)
    if set(flags.upper()) - {"B", "R"}:
        raise ScriptError(f"unknown --signal flag {flags!r}: in --signal={value}. HINT: only B: and R: exist")
    if lead is None:
        lead_s = SIGNAL_DEFAULT_LEAD_S
    elif not lead.isdigit() or int(lead) > SLURM_SIGNAL_LEAD_MAX_S:
        raise ScriptError(
            f"--signal={value}: sig_time must be an integer 0..{SLURM_SIGNAL_LEAD_MAX_S} (sbatch(1)). HINT: "
            "use grace-calc to size it"
        )
    else:
        lead_s = int(lead)
    batch_only = "B" in flags.upper()
    return SignalSpec(name=signal_name(sig), lead_s=lead_s, batch_only=batch_only, text=value.strip())


def parse_time_limit(value: str) -> int | None:
    """``--time`` in seconds, in the formats of sbatch(1): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; 0 -> None."""
    text = value.strip()
    if text.upper() in {"UNLIMITED", "INFINITE", "0"}:
        return None
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise ScriptError(f"cannot read --time={value}. HINT: use minutes, H:M:S or D-H:M:S")
    days, first, second, third = match.groups()
    nums = [int(x) for x in (first, second, third) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (nums + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(nums) == 1:  # minutes
        return nums[0] * 60
    if len(nums) == 2:  # minutes:seconds
        return nums[0] * 60 + nums[1]
    return (nums[0] * 60 + nums[1]) * 60 + nums[2]


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines with backslash continuations joined, each with its first line number."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not pending:
            start = lineno
        if line.endswith("\\") and not line.lstrip().startswith("#"):
            pending += line[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def _directive_options(line: str) -> list[str]:
    body = line.strip()[len(SBATCH_PREFIX) :]
    body = re.split(r"\s#", body, maxsplit=1)[0]  # a trailing "# comment"
    try:
        return shlex.split(body)
    except ValueError:
        return body.split()


def _option_values(tokens: list[str], long: str, short: str | None) -> list[str]:
    values: list[str] = []
    for i, tok in enumerate(tokens):
        if tok.startswith(long + "="):
            values.append(tok.split("=", 1)[1])
        elif tok == long or (short is not None and tok == short):
            if i + 1 < len(tokens):
                values.append(tokens[i + 1])
        elif short is not None and tok.startswith(short) and not tok.startswith("--") and len(tok) > 2:
            values.append(tok[2:])
    return values


def _words(command: str) -> list[str]:
    command = command.replace(">&", ">").replace("&>", ">")  # `2>&1`, `&> log` redirect; they are no `&`
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote: fall back to plain words
        return command.split()


def _split_commands(words: list[str]) -> list[tuple[list[str], bool]]:
    """Split a line's words into simple commands, each with whether it is sent to the background."""
    commands: list[tuple[list[str], bool]] = []
    current: list[str] = []
    for word in words:
        if word in _SEPARATORS or set(word) <= set(";&|"):
            if current:
                commands.append((current, word == "&"))
            current = []
        else:
            current.append(word)
    if current:
        commands.append((current, False))
    return commands


def _is_assignment(word: str) -> bool:
    return re.fullmatch(r"[A-Za-z_]\w*=.*", word) is not None


def _is_python(word: str) -> bool:
    return _PYTHON_RE.fullmatch(os.path.basename(word)) is not None


def _classify(words: list[str]) -> tuple[bool, bool, str | None, bool] | None:
    """(via_srun, uses_exec, launcher, runs_python) of a simple command; None if it is not a launch."""
    i, uses_exec = 0, False
    while i < len(words) and (_is_assignment(words[i]) or words[i] in _TRANSPARENT_PREFIXES):
        uses_exec = uses_exec or words[i] == "exec"
        i += 1
    rest = words[i:]
    if not rest:
        return None
    via_srun = os.path.basename(rest[0]) == "srun"
    for j, word in enumerate(rest):
        base = os.path.basename(word)
        if base in LAUNCHER_PROGRAMS:
            return via_srun, uses_exec, LAUNCHER_PROGRAMS[base], True
        if _is_python(word):
            args = rest[j + 1 :]
            if args and args[0] in {"-c", "-V", "--version"}:
                return None  # a one-line check, not the training
            if len(args) >= 2 and args[0] == "-m" and args[1] in LAUNCHER_MODULES:
                return via_srun, uses_exec, LAUNCHER_MODULES[args[1]], True
            return via_srun, uses_exec, None, True
        if not via_srun:
            return None  # a plain shell command (echo, mkdir, ...) before any python
    return (via_srun, uses_exec, None, False) if via_srun else None


def _parse_body(lines: list[tuple[int, str]]) -> tuple[list[Launch], list[Launch], set[str], str | None]:
    """Training launches, other srun steps, the signal names trapped, and the exported lead."""
    training: list[Launch] = []
    other_steps: list[Launch] = []
    traps: list[str] = []
    exported: str | None = None
    for lineno, line in lines:
        for words, background in _split_commands(_words(line)):
            if words[0] == "trap" and len(words) >= 3:
                traps.extend(w.upper().removeprefix("SIG") for w in words[2:])
                continue
            # `export VAR=N`, or `VAR=N srun ...` (which sets it for that command only)
            assignments = words[1:] if words[0] == "export" else itertools.takewhile(_is_assignment, words)
            for word in assignments:
                if word.startswith(LEAD_ENV_VAR + "="):
                    exported = word.split("=", 1)[1]
            kind = _classify(words) if words[0] != "export" else None
            if kind is None:
                continue
            via_srun, uses_exec, launcher, runs_python = kind
            launch = Launch(
                lineno=lineno, text=line.strip(), via_srun=via_srun, uses_exec=uses_exec,
                background=background, launcher=launcher, runs_python=runs_python,
            )
            (training if runs_python else other_steps).append(launch)
    return training, other_steps, set(traps), exported


def _split_script(text: str) -> tuple[list[tuple[int, list[str]]], int | None, list[tuple[int, str]]]:
    """(header directives, line of a --signal directive after the first command, command lines)."""
    directives: list[tuple[int, list[str]]] = []
    late_signal: int | None = None
    body: list[tuple[int, str]] = []
    for lineno, line in _logical_lines(text):
        stripped = line.strip()
        if stripped.startswith(SBATCH_PREFIX):
            options = _directive_options(stripped)
            if not body:
                directives.append((lineno, options))
            elif _option_values(options, "--signal", None):
                late_signal = lineno
        elif stripped and not stripped.startswith("#"):
            body.append((lineno, stripped))
    return directives, late_signal, body


def parse_script(text: str, path: str = "<script>") -> SbatchScript:
    """Parse a batch script. Directives after the first command are ignored, exactly as sbatch does."""
    directives, late_signal, body = _split_script(text)
    signal_spec: SignalSpec | None = None
    signal_lineno: int | None = None
    time_limit_s: int | None = None
    partition: str | None = None
    nodes: NodeRange | None = None
    for lineno, options in directives:
        for value in _option_values(options, "--signal", None):
            signal_spec, signal_lineno = parse_signal(value), lineno
        for value in _option_values(options, "--time", "-t"):
            time_limit_s = parse_time_limit(value)
        for value in _option_values(options, "--partition", "-p"):
            partition = value
        for value in _option_values(options, "--nodes", "-N"):
            nodes = _parse_nodes(value, path, lineno)

    training, other_steps, trapped, exported = _parse_body(body)
    wanted = {"TERM"} | ({signal_spec.name} if signal_spec else set())
    launches = training or other_steps[-1:]  # `srun ./train.sh`: the last step we cannot see into
    # Beside an srun training launch, python run by the batch shell is a pre/post step (e.g. a report).
    stepped = [launch for launch in launches if launch.via_srun]
    side = [launch for launch in launches if not launch.via_srun] if stepped else []
    launches = stepped or launches
    return SbatchScript(
        path=path,
        signal=signal_spec,
        signal_lineno=signal_lineno,
        ignored_signal_lineno=late_signal,
        time_limit_s=time_limit_s,
        partition=partition,
        launches=tuple(launches),
        side_launches=tuple(side),
        traps_signal=bool(trapped & wanted),
        exported_lead=exported,
        nodes=nodes,
    )


def _parse_nodes(value: str, path: str, lineno: int) -> NodeRange:
    try:
        return node_range.parse(value, where=f"{path}:{lineno}: #SBATCH --nodes={value}")
    except ValueError as exc:
        raise ScriptError(str(exc)) from None


def read_script(path: str | os.PathLike[str]) -> SbatchScript:
    """Read and parse a batch script file; raises ScriptError when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError as exc:
        raise ScriptError(f"cannot read {os.fspath(path)}: {exc.strerror}. HINT: check the path") from None
    return parse_script(text, os.fspath(path))
