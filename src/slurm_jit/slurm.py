"""The one gateway to Slurm.

Every call of ``sbatch``, ``squeue``, ``scontrol``, ``scancel`` and ``sinfo`` in this project goes through
:func:`run`. Unit tests swap :data:`runner` for a fake at this single boundary; tests marked ``slurm`` use the
real local cluster (``tools/local-slurm up``).

Accounting is usually off on small clusters (and on the embedded local one), so job state is read with
``scontrol show job``, never ``sacct``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence

SLURM_COMMANDS = frozenset({"sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun"})
COMMAND_TIMEOUT_S = 60.0  # a healthy slurmctld answers in well under a second; 60 s covers a loaded one


class SlurmError(RuntimeError):
    """A Slurm command failed or is not installed; the message says which and how to fix it."""


def _subprocess_runner(argv: Sequence[str], timeout_s: float) -> str:
    if shutil.which(argv[0]) is None:
        raise SlurmError(
            f"{argv[0]} not found on PATH. HINT: run on a Slurm login node, or start the local cluster "
            "with tools/local-slurm up"
        )
    try:
        # errors="replace": a job name, comment or path in a byte that is not UTF-8 is not a UnicodeDecodeError
        proc = subprocess.run(list(argv), capture_output=True, text=True, errors="replace", timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"{' '.join(argv)} did not answer within {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise SlurmError(f"{' '.join(argv)} failed (exit {proc.returncode}): {detail[-1] if detail else ''}")
    return proc.stdout


# Swapped by unit tests for a fake taking (argv, timeout_s) -> stdout.
runner: Callable[[Sequence[str], float], str] = _subprocess_runner


def run(argv: Sequence[str], timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    """Run one Slurm command (argv list, never a shell string) and return its standard output."""
    if not argv or argv[0] not in SLURM_COMMANDS:
        raise ValueError(f"not a Slurm command: {argv!r}")
    return runner(argv, timeout_s)


def available() -> bool:
    """True when a Slurm controller answers here."""
    try:
        run(["scontrol", "ping"], timeout_s=10)
    except SlurmError:
        return False
    return True


# ``scontrol show job`` prints these unescaped, each last on its line: the value is the rest of that line (a job
# named ``x JobState=RUNNING`` must not read as a RUNNING job; a path may hold spaces).
REST_OF_LINE_KEYS = ("JobName", "Command", "WorkDir", "StdErr", "StdIn", "StdOut", "Comment")


def parse_key_values(text: str) -> dict[str, str]:
    """Parse ``scontrol show`` output (``Key=Value`` pairs, several per line) into a dict; the first of repeated
    keys counts, and a :data:`REST_OF_LINE_KEYS` key takes the rest of its line as its value."""
    pairs: dict[str, str] = {}
    for line in text.splitlines():
        rest_at = len(line)
        for key in REST_OF_LINE_KEYS:
            found = re.search(rf"(?:^|\s){key}=", line)
            if found is not None and found.end() < rest_at:
                rest_at = found.end()
                pairs.setdefault(key, line[rest_at:])
        for match in re.finditer(r"(\w[\w:/.]*)=(\S*)", line[:rest_at]):
            pairs.setdefault(match.group(1), match.group(2))
    return pairs


def show_config() -> dict[str, str]:
    """``scontrol show config`` as a dict (``Key = Value`` lines)."""
    config: dict[str, str] = {}
    for line in run(["scontrol", "show", "config"]).splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.strip()] = value.strip()
    return config


def show_partition(name: str) -> dict[str, str]:
    """``scontrol show partition NAME`` as a dict."""
    return parse_key_values(run(["scontrol", "show", "partition", name]))


def default_partition() -> str | None:
    """The name of the default partition (marked ``*`` by sinfo), if any."""
    for name in run(["sinfo", "-h", "-o", "%P"]).split():
        if name.endswith("*"):
            return name.rstrip("*")
    return None


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol show job JOBID`` as a dict (kept by slurmctld for MinJobAge seconds after the end)."""
    return parse_key_values(run(["scontrol", "show", "job", str(job_id)]))


# Job states after which a job never runs again (squeue(1) JOB STATE CODES); every other state is a live job.
ENDED_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                          "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "TIMEOUT"})
UNKNOWN_JOB = "Invalid job id specified"  # scontrol's words for a job it does not (or no longer) know


def live_state(job_id: str) -> str | None:
    """The state of a job that may still run (PENDING, RUNNING, REQUEUED, SUSPENDED, ...); None when it has ended
    or slurmctld no longer knows it. Raises SlurmError when slurmctld does not answer."""
    try:
        state = job_state(show_job(job_id))
    except SlurmError as exc:
        if UNKNOWN_JOB in str(exc):
            return None
        raise
    return None if state in ENDED_STATES else state


def job_script(job_id: str) -> str:
    """The batch script of a job, as ``scontrol write batch_script JOBID -`` prints it."""
    return run(["scontrol", "write", "batch_script", str(job_id), "-"])


def submit(script_path: str | os.PathLike[str], extra_args: Sequence[str] = ()) -> str:
    """``sbatch --parsable`` a script; returns the job id."""
    out = run(["sbatch", "--parsable", *extra_args, os.fspath(script_path)])
    return out.strip().split(";")[0]


def cancel(job_id: str, signal_name: str | None = None) -> None:
    """``scancel`` a job, or send it a signal with ``--signal``."""
    argv = ["scancel"]
    if signal_name:
        argv.append(f"--signal={signal_name}")
    run([*argv, str(job_id)])


def seconds(value: str) -> int | None:
    """A Slurm duration or plain seconds (``30``, ``30 sec``, ``00:05:00``, ``1-00:00:00``) in seconds."""
    value = value.strip()
    if value in {"", "UNLIMITED", "INFINITE", "NONE", "(null)", "N/A"}:
        return None
    match = re.fullmatch(r"(\d+)\s*(sec|s)?", value)
    if match:
        return int(match.group(1))
    days = 0
    if "-" in value:
        day_str, _, value = value.partition("-")
        days = int(day_str)
    parts = [int(p) for p in value.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    hours, minutes, secs = parts[-3:]
    return ((days * 24 + hours) * 60 + minutes) * 60 + secs


def node_address(node_name: str) -> str:
    """The address Slurm reaches a node at (its ``NodeAddr``; the node name itself when slurm.conf gives none)."""
    node = parse_key_values(run(["scontrol", "show", "node", node_name]))
    return node.get("NodeAddr") or node_name


def requeue(job_id: str) -> None:
    """``scontrol requeue JOBID``: the same job id runs again (SLURM_RESTART_COUNT + 1).

    Slurm accepts this even for a job that ``scancel`` already cancelled: check :func:`show_job` first.
    """
    run(["scontrol", "requeue", str(job_id)])


# After ``scontrol requeuehold``, Slurm SIGTERMs every process of the job, a running scontrol among them (exit
# -15): the commands that follow are tried again (the signal is sent once; SIGKILL comes KillWait, >= 30 s, later).
REQUEUE_TERM_ATTEMPTS = 3
REQUEUE_TERM_PAUSE_S = 0.2


def _run_past_term(argv: Sequence[str]) -> str:
    for attempt in range(REQUEUE_TERM_ATTEMPTS):
        try:
            return run(argv)
        except SlurmError:
            if attempt == REQUEUE_TERM_ATTEMPTS - 1:
                raise
            time.sleep(REQUEUE_TERM_PAUSE_S)
    raise AssertionError("unreachable")


def hostnames(expression: str) -> list[str]:
    """A hostlist (``node[1-3],gpu7``) as node names (``scontrol show hostnames``); [] for none or ``(null)``."""
    if expression.strip() in {"", "(null)"}:
        return []
    return run(["scontrol", "show", "hostnames", expression]).split()


def _exclusion_blocks(job: dict[str, str], node: str, min_nodes: int | None = None) -> str | None:
    """Why excluding ``node`` would leave the job no way to start (pending forever: BadConstraints) or cannot be done
    (not a node of its partition), or None when it can, or when Slurm does not say enough to tell (the exclusion is
    then made, as asked). ``min_nodes``: a job of a node range, whose NumNodes while it runs is the count it got."""
    if node in hostnames(job.get("ReqNodeList", "")):
        return f"the job requires it (ReqNodeList={job['ReqNodeList']})"
    needed = re.match(r"\d+", str(min_nodes) if min_nodes else job.get("NumNodes", ""))
    partitions = [name for name in job.get("Partition", "").split(",") if name]
    pool = {name for part in partitions for name in hostnames(show_partition(part).get("Nodes", ""))}
    if needed is None or not pool:
        return None
    if node not in pool:  # a host name that is not Slurm's node name: ExcNodeList would refuse it (held for nothing)
        return f"it is not a node of partition {','.join(partitions)}"
    left = pool - set(hostnames(job.get("ExcNodeList", ""))) - {node}
    if len(left) >= int(needed.group()):
        return None
    return (f"the job needs {needed.group()} node(s) and partition {','.join(partitions)} would have {len(left)} "
            f"left without it: it would stay pending forever")


def requeue_excluding(job_id: str, node: str, min_nodes: int | None = None) -> str | None:
    """Requeue the job so that it never runs on ``node`` again (added to its ``ExcNodeList``).

    A running job's ExcNodeList cannot be changed ("Job is no longer pending execution"), so: ``scontrol
    requeuehold`` (requeued, held), ``scontrol update JobId=J ExcNodeList=...``, ``scontrol release``. Where the
    exclusion would leave the job no node set to start on (a 1-node partition, the job needs every node, its
    ReqNodeList names the node) it is a plain requeue instead: the job runs again, on the same node. Returns None,
    or a one-line warning (with its HINT) when the node is not excluded (the job is requeued all the same).
    SlurmError when the requeue failed, or when the release did (the job is then held: its message says how to
    release it).
    """
    job = show_job(job_id)  # now: after the requeuehold, our scontrols get TERM
    try:
        blocked = _exclusion_blocks(job, node, min_nodes)
    except SlurmError:  # the partition or a hostlist unreadable: exclude, as asked
        blocked = None
    if blocked is not None:
        requeue(job_id)
        return (f"node {node} not excluded: {blocked}; requeued on any node. HINT: --exclude-hung-node needs a "
                "spare node; the job runs again on the nodes it can have")
    excluded = job.get("ExcNodeList", "(null)")
    merged = node if excluded in {"", "(null)"} else f"{excluded},{node}"
    run(["scontrol", "requeuehold", str(job_id)])
    warning = None
    try:
        _run_past_term(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={merged}"])
    except SlurmError as exc:
        warning = (f"node {node} not excluded ({exc}); requeued all the same. HINT: scontrol update "
                   f"JobId={job_id} ExcNodeList={merged} while it is pending")
    try:
        _run_past_term(["scontrol", "release", str(job_id)])
    except SlurmError as exc:
        raise SlurmError(f"job {job_id} is requeued but held ({exc}). HINT: scontrol release {job_id}") from exc
    return warning


def job_state(job: dict[str, str]) -> str:
    """``JobState`` of a :func:`show_job` dict, without a reason suffix; ``UNKNOWN`` when absent."""
    return job.get("JobState", "UNKNOWN").split("+")[0] or "UNKNOWN"


# What scontrol says for a job slurmctld no longer knows (MinJobAge after its end, or never submitted).
INVALID_JOB_ID = "Invalid job id specified"


def state_of(job_id: str) -> str | None:
    """The job's state (``squeue -o %T``, which no job name can spoof as ``scontrol show job``'s text can); None
    when slurmctld no longer knows the job. SlurmError when slurmctld does not answer."""
    try:
        out = run(["squeue", "-h", "-j", str(job_id), "--states=all", "-o", "%T"])
    except SlurmError as exc:
        if INVALID_JOB_ID in str(exc):
            return None
        raise
    states = out.split()
    return states[0] if states else None
