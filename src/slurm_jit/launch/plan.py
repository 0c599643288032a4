"""The launcher's plan: what ``python launch/submit.py`` is about to submit, a line per fact (issue #41 item 4).

A line holds one fact in at most ~160 characters, its numbers rounded as a person reads them (grace/human.py); the
signal's ``TERM@N`` comes first, the job id and its log last (submit.py). Where each figure came from (the grace
terms' sources, the save advice's arithmetic, the requeue policy's conditions) is behind ``--explain``.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_jit.checkpoint import elastic_plan
from slurm_jit.grace import cli as grace_cli
from slurm_jit.grace import human
from slurm_jit.grace.calc import GraceResult
from slurm_jit.grace.save_advice import Advice
from slurm_jit.launch import finished, gate, node_range, ops
from slurm_jit.launch.executor import JitExecutor
from slurm_jit.timing import TIMING_DIR

LOG_FOLDER = "logs"  # OUT_DIR/slurm-jit/logs: submitit's log folder for the CLI's jobs (%j_%t_log.out)
WIDTH = 160  # a line of terminal output (docs/STYLE: the plan, ckpt-check and grace-calc keep to it)
LABEL = 12  # "  requeue:  ": the labels' column
HINT = " HINT: "  # a value's HINT goes on a line of its own, under the value


@dataclass(frozen=True)
class Launch:
    """One submit: the executor that writes the script and calls sbatch, and what it submits."""

    executor: JitExecutor
    entry: tuple[Any, ...]  # ex.submit(*entry): a Command, or task.call_function and its arguments
    grace: GraceResult
    training: dict[str, Any]  # {"argv": [...]} or {"function": ..., "args": [...]}, for the plan
    time: str
    python: str  # the job's interpreter, as given (the executor holds it quoted for the shell)
    saves: Advice | None = None  # the periodic saves Young's interval advises (grace/save_advice.py), for the plan

    @property
    def output_dir(self) -> str:
        return str(self.executor.output_dir)

    @property
    def world_size(self) -> int:
        return int(self.executor.world_size)


def log_folder(output_dir: str) -> str:
    return str(Path(output_dir) / TIMING_DIR / LOG_FOLDER)


def task_logs(launch: Launch, job_id: str = "%j") -> str:
    """The per-task logs (submitit's), ``%t`` the task; task 0's also holds the batch script's lines."""
    return str(Path(log_folder(launch.output_dir)) / f"{job_id}_%t_log.out")


def quoted(argv: Sequence[str]) -> str:
    return " ".join(json.dumps(a) if not a.isprintable() else shlex.quote(a) for a in argv)


def grace_sum(result: GraceResult) -> str:
    """The grace period's terms and their sum, rounded: ``step 5 s + save 30 s + kill_wait 3 s + margin 10 s = 48 s``
    (terms of 0 s left out; a given lead with what it overrides)."""
    parts = []
    for term in result.terms:
        if term.name == "given":
            parts.append(f"given {human.seconds(term.seconds)} ({term.source})")
        elif term.name == "step" and result.latency_steps > 1:
            parts.append(f"step {result.latency_steps} x {human.seconds(term.seconds / result.latency_steps)}")
        elif term.seconds:
            parts.append(f"{term.name} {human.seconds(term.seconds)}")
    return f"{' + '.join(parts)} = {human.seconds(result.needed_s)}"


def plan_lines(launch: Launch, checked: gate.GateResult, *, explain: bool = False) -> list[str]:
    """The plan (and with ``explain``, the reasoning under it)."""
    result, spec, ex = launch.grace, launch.training, launch.executor
    what = ([f"{spec['function']}({' '.join(spec['args'])})"] if "function" in spec
            else [json.dumps(a) if not a.isprintable() or " " in a else a for a in spec["argv"]])
    nodes, per_node = ex.nodes, ex.tasks_per_node
    sizes = nodes.world_sizes(per_node)
    ranks = f"{sizes[0]}-{sizes[-1]}" if nodes.elastic else str(launch.world_size)
    elastic_nodes = node_range.plan_line(nodes, per_node)
    staging = grace_cli.staging_note(launch.output_dir, per_node)
    first = (f"plan: {nodes.sbatch_value()} node(s) x {per_node} task(s) = {ranks} ranks, one srun task each; "
             f"--time={launch.time}" + ("" if explain else "; --explain: where each figure comes from"))
    lines = [
        *textwrap.wrap(first, width=WIDTH, subsequent_indent=" " * LABEL, break_long_words=False,
                       break_on_hyphens=False),
        *(_labelled("nodes:", elastic_nodes) if elastic_nodes else []),
        *_labelled("signal:", f"#SBATCH --signal=TERM@{result.lead_s} (no B:, so it reaches the ranks); "
                              f"export SLURM_JIT_SIGNAL_LEAD_S={result.lead_s}"),
        *_labelled("grace:", grace_sum(result)),
        *(_labelled("staging:", staging) if staging else []),
        *(_labelled("saves:", launch.saves.line) if launch.saves else []),
        *_labelled("requeue:", _requeue(ex)),
        *_labelled("resume:", finished.resume_line(launch.output_dir, checked)),
        *(_labelled("elastic:", _elastic_line(launch, checked)) if checked.elastic is not None else []),
        *_command("training:", what),
        *_labelled("python:", f"{launch.python} (the batch script's and every task's interpreter; --python to change)"),
        *_labelled("ops:", ops.plan_line(ops.job_env(), gpus=bool(ex.parameters.get("gpus_per_node")))),
        *_command("sbatch:", [quoted([a]) for a in ex.sbatch_argv()]),
        *_labelled("logs:", f"{task_logs(launch)} (one per task; task 0's also holds the batch script's lines)"),
    ]
    return lines + (explain_lines(launch) if explain else [])


def submitted_lines(launch: Launch, job_id: str, status: Sequence[str]) -> list[str]:
    """What a submit prints last: the job id and task 0's log (on the next line when both do not fit), the status
    command. Scripts read the job id from ``submitted job N;``."""
    log = task_logs(launch, job_id).replace("%t", "0")
    first = f"submitted job {job_id}; log {log}"
    head = [first] if len(first) <= WIDTH else [f"submitted job {job_id}; log", f"{'':<{LABEL}}{log}"]
    return head + _command("status:", status)


def explain_lines(launch: Launch) -> list[str]:
    """Where each figure of the plan comes from, wrapped to :data:`WIDTH`."""
    result = launch.grace
    lines = ["why:"]
    for i, term in enumerate(result.terms):
        lines += _wrapped("grace:" if i == 0 else "", f"{term.name} {term.seconds:.4g} s: {term.source}")
    lines += _wrapped("", f"= {result.needed_s:.4g} s, rounded up to whole seconds: N of --signal=TERM@N is "
                          f"{result.lead_s} (grace-calc --help: the calculator)")
    if launch.saves is not None:
        lines += _wrapped("saves:", launch.saves.why)
    lines += _wrapped("requeue:", _requeue_rules(launch.executor))
    return lines


def _labelled(label: str, text: str) -> list[str]:
    """A value under its label, its HINT (if any) on the next line under the value; each wrapped to :data:`WIDTH`."""
    value, hint, rest = text.partition(HINT)
    return _wrapped(label, value) + (_wrapped("", f"HINT: {rest}") if hint else [])


def _command(label: str, words: Sequence[str]) -> list[str]:
    """A shell command under its label, cut between words into lines of :data:`WIDTH` that end in `` \\``, so that
    it pastes into a shell as it is (a word longer than a line stays whole)."""
    lines, line, fresh = [], f"  {label:<{LABEL - 2}}", True
    for word in words:
        if not fresh and len(line) + 1 + len(word) + 2 > WIDTH:
            lines.append(line + " \\")
            line, fresh = " " * LABEL, True
        line += word if fresh else f" {word}"
        fresh = False
    return [*lines, line]


def _wrapped(label: str, text: str) -> list[str]:
    return textwrap.wrap(text, width=WIDTH, initial_indent=f"  {label:<{LABEL - 2}}", subsequent_indent=" " * LABEL,
                         break_long_words=False, break_on_hyphens=False)


def _requeue(ex: JitExecutor) -> str:
    """The requeue policy's counts (its conditions: :func:`_requeue_rules`)."""
    line = (f"after a JIT stop, the same job up to {ex.max_requeues} times; after a crash: "
            f"{_retries(ex.retry_on_failure)}; after a hang or a lost peer: {_retries(ex.retry_on_hang)}"
            + (", off the stuck node" if ex.exclude_hung_node else ""))
    if max(ex.retry_on_failure, ex.retry_on_hang) > ex.max_requeues:
        line += f"; no more than {ex.max_requeues} in all"
    return line


def _retries(count: int) -> str:
    return f"{count} {'retry' if count == 1 else 'retries'}"


def _requeue_rules(ex: JitExecutor) -> str:
    return (f"after a JIT stop, requeue the same job (scontrol requeue) up to {ex.max_requeues} times, only "
            "while it is running (never after scancel), the checkpoint passes ckpt-check and the step advanced; "
            f"after a crash: {_retries(ex.retry_on_failure)}; after a hang or a lost peer: "
            f"{_retries(ex.retry_on_hang)} from the newest complete checkpoint"
            + (", excluding the stuck node (where the partition has a spare one)" if ex.exclude_hung_node else "")
            + (f"; every requeue counts against the {ex.max_requeues} above: no more than {ex.max_requeues} "
               "in all" if max(ex.retry_on_failure, ex.retry_on_hang) > ex.max_requeues else ""))


def _elastic_line(launch: Launch, checked: gate.GateResult) -> str:
    """What the resume does about the world size change, with the conversion's estimated time."""
    elastic = checked.elastic
    assert elastic is not None
    line = f"{elastic.written_by} -> {launch.world_size} ranks from {checked.resume_point}: {elastic.action}"
    if elastic.action != elastic_plan.CONVERT:
        return line
    conversion = grace_cli.next_conversion(launch.output_dir, launch.world_size)
    took = f"~{conversion.seconds:.0f} s ({conversion.source})" if conversion and conversion.seconds is not None \
        else "time not estimated (no conversion in the timing log yet)"
    return f"{line}, once, at the start of the first job, before its first step: {took}"
