"""The parameters a :class:`~slurm_jit.launch.executor.JitExecutor` refuses, each in one line with a HINT: values
whose type the batch script or the world size cannot take, the options the JIT job writes itself (its --signal,
requeue, logs), and setup lines the script cannot carry as given. Pure: no Slurm, no submitit."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from slurm_jit.launch import node_range

# Parameters the JIT job sets itself, and why.
OWNED_PARAMETERS = {
    "signal_delay_s": "the JIT job writes --signal=TERM@N itself, N from step_time_s/save_time_s, the timing log "
                      "or signal_lead_s: give those to JitExecutor",
    "use_srun": "the JIT job runs one srun task per rank",
    "teardown": "after_step (the requeue policy) and the result files run there",
}
# sbatch options (additional_parameters keys) the JIT job writes; a key that is a prefix of one is refused too
# (sbatch's getopt takes unambiguous prefixes in #SBATCH lines: --sig=B:USR1@600 would be --signal).
OWNED_SBATCH = ("signal", "requeue", "no-requeue", "open-mode", "output", "error", "array", "wait", "parsable",
                "time", "job-name")
OWNED_SRUN = ("signal", "output", "error")  # srun options the runner's logs and signals depend on
OWNED_SRUN_LETTERS = "oe"  # srun's -o / -e, also inside a cluster such as -lo


# submitit's executor arguments JitExecutor has under another name with another meaning (also AutoExecutor's
# slurm_-prefixed form), refused in one line rather than taken with submitit's meaning.
SUBMITIT_ARGUMENTS = {
    "max_num_timeout": ("submitit's cap on requeues after a time limit (preemptions uncapped); JitExecutor caps "
                        "every requeue, time limits, preemptions, node failures and hangs alike", "max_requeues"),
}


class JitExecutorError(ValueError):
    """A parameter or submission the JIT job cannot take; the message is one line with a HINT."""


def _refuse_owned_option(where: str, name: str, owned: tuple[str, ...], hint: str) -> None:
    key = name.lstrip("-").split("=")[0].replace("_", "-")
    hit = next((o for o in owned if key and o.startswith(key)), None)
    if hit is not None:
        raise JitExecutorError(f"{where} {name!r} sets --{hit}, which the JIT job writes itself. HINT: {hint}")


def refuse_submitit_arguments(given: Mapping[str, Any], where: str, known: tuple[str, ...] = ()) -> None:
    """Refuse (one line, HINT) submitit's executor arguments of :data:`SUBMITIT_ARGUMENTS` (``max_num_timeout``,
    ``slurm_max_num_timeout``); with ``known`` (the names ``where`` takes), any other name too, where Python would
    raise a bare TypeError."""
    for name, value in given.items():
        if name.removeprefix("slurm_") in SUBMITIT_ARGUMENTS:
            why, ours = SUBMITIT_ARGUMENTS[name.removeprefix("slurm_")]
            raise JitExecutorError(f"{where}({name}={value!r}): {why}. HINT: give {ours} instead, e.g. "
                                   f"JitExecutor(..., {ours}={value!r})")
        if known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise JitExecutorError(f"{where}: unknown argument {name!r}. HINT: "
                                   + (f"did you mean {close[0]}?" if close else f"one of {', '.join(known)}"))


def check_shapes(params: Mapping[str, Any]) -> None:
    """Refuse (one line, HINT) values whose type the script or the world size cannot take (raw submitit names)."""
    value = params.get("ntasks_per_node")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise JitExecutorError(f"ntasks_per_node={value!r}: a whole number, 1 or more. HINT: e.g. ntasks_per_node=2")
    extra = params.get("additional_parameters")
    if extra is not None and not isinstance(extra, Mapping):
        raise JitExecutorError("additional_parameters is not a dict. HINT: e.g. {'mail-type': 'END'}")
    if params.get("nodes") is not None:
        _check_nodes(params["nodes"], extra or {})
    job_name = params.get("job_name")
    if job_name is not None and (not isinstance(job_name, str) or not job_name.strip()):
        raise JitExecutorError(f"job_name={job_name!r}: empty or not a string. HINT: e.g. job_name='train-gpt'")
    directives = {k: v for k, v in params.items() if k not in ("setup", "srun_args", "additional_parameters")}
    for key, value in [*directives.items(), *(extra or {}).items()]:
        if any(not c.isprintable() for c in f"{key}{value}"):
            raise JitExecutorError(f"{key}={value!r} holds a line break or control character: in an #SBATCH line "
                                   "(or scontrol's one-line fields) it would read as another option. HINT: a "
                                   "printable value")


def _check_nodes(nodes: object, extra: Mapping[str, Any]) -> None:
    """A node count or sbatch's ``"MIN-MAX"``; a range with a fixed task count is refused: the ranks per node
    would change with the node count, where the world size is nodes x ntasks_per_node."""
    if isinstance(nodes, bool) or not isinstance(nodes, (int, str)) or isinstance(nodes, int) and nodes < 1:
        raise JitExecutorError(f"nodes={nodes!r}: a whole number, 1 or more, or sbatch's range \"MIN-MAX\". "
                               "HINT: e.g. nodes=2 or nodes=\"1-2\"")
    try:
        span = node_range.parse(nodes, where=f"nodes={nodes!r}")
    except ValueError as exc:
        raise JitExecutorError(str(exc)) from None
    fixed = [str(key) for key in extra if str(key).lstrip("-").replace("_", "-") in ("ntasks", "n")]
    if span.elastic and fixed:
        raise JitExecutorError(f"nodes={nodes!r} with additional_parameters {fixed[0]!r}: a fixed task count "
                               "cannot hold on a node count that changes between restarts. HINT: leave "
                               f"{fixed[0]} out and give tasks_per_node; the world size is nodes x tasks_per_node")


def check_owned(params: Mapping[str, Any]) -> None:
    """Refuse (one line, HINT) the parameters the JIT job owns (raw submitit names)."""
    for name, why in OWNED_PARAMETERS.items():
        if name in params:
            raise JitExecutorError(f"update_parameters({name}=...): {why}. HINT: leave {name} out")
    for key in params.get("additional_parameters") or {}:
        _refuse_owned_option("additional_parameters key", str(key), OWNED_SBATCH,
                             "leave it out (timeout_min sets the time, max_requeues the requeues, name= or "
                             "job_name= the name)")
    srun_args = params.get("srun_args") or []
    if isinstance(srun_args, str):
        raise JitExecutorError("srun_args is a string. HINT: a list, e.g. srun_args=['--cpu-bind=cores']")
    for arg in srun_args:
        text = str(arg)
        if text.startswith("--"):
            _refuse_owned_option("srun_args", text, OWNED_SRUN, "leave it out: the JIT job sets it")
        elif text.startswith("-") and any(c in OWNED_SRUN_LETTERS for c in text[1:].split("=")[0]):
            raise JitExecutorError(f"srun_args {text!r} sets srun's -o/-e, the per-task logs. HINT: leave it out")
    check_setup(params.get("setup"))


def check_setup(setup: object) -> None:
    """Refuse (one line, HINT) setup lines the batch script cannot carry as given: not a list of strings, an
    empty line, a control character (a line break would add lines nobody reads as one), or an ``#SBATCH`` line
    (sbatch reads directives until the first command: it would override the JIT job's own)."""
    if setup is None:
        return
    if isinstance(setup, str) or not isinstance(setup, (list, tuple)) or not all(isinstance(s, str) for s in setup):
        raise JitExecutorError("setup must be a list of shell lines. HINT: e.g. setup=['module load cuda']")
    for line in setup:
        if not line.strip() or any(not c.isprintable() and c != "\t" for c in line):
            raise JitExecutorError(f"setup line {line!r} is empty or holds a line break or control character. "
                                   "HINT: one shell command per line, e.g. 'module load cuda'")
        if line.lstrip().upper().startswith("#SBATCH"):
            raise JitExecutorError(f"setup line {line!r} is an #SBATCH directive: sbatch would read it over the "
                                   "JIT job's own. HINT: give sbatch options as parameters (slurm_additional_"
                                   "parameters, or submit.py's own options)")
