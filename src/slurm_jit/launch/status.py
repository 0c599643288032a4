"""``python launch/submit.py status OUT_DIR|JOBID``: the job's state, restarts, last stop, resume point, grace."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from typing import NoReturn

from slurm_jit import slurm, timing
from slurm_jit.launch import finished, gate, output_claim, policy, progress, sbatch_options
from slurm_jit.train import stop_record, stop_summary

EXIT_OK, EXIT_ERROR = 0, 2


def out_dir_of_job(job_id: str) -> str | None:
    """The OUT_DIR= line of a job's batch script (as submit.py and the sbatch/ scripts write it), relative to the
    job's working directory; None when there is none or it is computed by the shell (``$OUT``)."""
    for line in slurm.job_script(job_id).splitlines():
        if line.startswith("OUT_DIR="):
            value = line.removeprefix("OUT_DIR=")
            if not value.startswith("'") and ("$" in value or "`" in value):  # computed by the shell
                return None
            try:
                words = shlex.split(value)
            except ValueError:  # a quote left open: a path with a line break, from an older submit
                return None
            if not words:
                return None
            return os.path.join(slurm.show_job(job_id).get("WorkDir", ""), words[0])
    return None


def _show_job(job_id: str | None) -> dict[str, str] | None:
    """The job as slurmctld shows it; None without a job id, or when slurmctld no longer knows it."""
    if not job_id:
        return None
    try:
        return slurm.show_job(job_id)
    except slurm.SlurmError:
        return None


def _job_lines(job_id: str | None, job: dict[str, str] | None) -> list[str]:
    if not job_id:
        return ["job:      none recorded yet (no stop has been handled by the launcher)"]
    if job is None:
        return [f"job:      {job_id}: no longer known to slurmctld (ended more than MinJobAge ago)"]
    return [f"job:      {job_id} {slurm.job_state(job)}, restarts {job.get('Restarts', '?')}, "
            f"run time {job.get('RunTime', '?')} of {job.get('TimeLimit', '?')}"]


def _stopped_line(history: list[dict[str, object]], job_id: str | None, job: dict[str, str] | None) -> str | None:
    """The last stop: the launcher's decision, or a cancel only Slurm knows of. A plain ``scancel`` kills the
    batch shell with the ranks, so after_step never runs and never records it: Slurm's CANCELLED says it."""
    last = history[-1] if history else None
    cancelled = job is not None and slurm.job_state(job) in policy.CANCELLED_STATES
    if cancelled and job is not None and not _recorded_this_run(last, job_id, job):
        return (f"stopped:  {policy.CAUSE_USER_CANCEL} (restart {job.get('Restarts', '?')}), not requeued: Slurm "
                "says CANCELLED (scancel); it ended the batch shell too, so the log has no slurm-jit: line for it")
    if last is None:
        return None
    verdict = str(last.get("outcome") or ("requeued" if last.get("requeue") else "not requeued"))
    step = "" if last.get("step") is None else f" at step {last.get('step')}"
    return f"stopped:  {last.get('cause')}{step} (restart {last.get('restart')}), {verdict}: {last.get('reason')}"


def _recorded_this_run(last: dict[str, object] | None, job_id: str | None, job: dict[str, str]) -> bool:
    """Whether the launcher's last record is of the job's current run (its decision then says what happened: a
    requeue withdrawn by the cancel, a cancel it saw); without Slurm's restart count, a cancel it recorded."""
    if last is None or str(last.get("job_id")) != job_id:
        return False
    restarts = job.get("Restarts")
    if restarts is None:
        return last.get("cause") == policy.CAUSE_USER_CANCEL
    return str(last.get("restart")) == str(restarts)


def _grace_line(out_dir: str) -> str:
    """N of --signal=TERM@N from the timing log, by the calculation submit.py sizes the job with."""
    if not os.path.isdir(timing.timing_dir(out_dir)):
        return "grace:    no timing log"
    try:
        result, _ = sbatch_options.signal_lead(out_dir)
    except (OSError, ValueError) as exc:  # GraceError and the timing log's errors are ValueErrors
        if str(exc).startswith(("no step time", "no save time")):
            return "grace:    the timing log has no step or save time yet"
        return f"grace:    not computed from the timing log: {exc}"
    terms = " + ".join(f"{t.name} {t.seconds:.1f} s" for t in result.terms)
    return f"grace:    {terms} = {result.needed_s:.1f} s -> --signal=TERM@{result.lead_s} (measured)"


MAX_RUNS_SHOWN = 12  # the newest runs of a long requeue chain; older ones are counted


def _ranks_line(out_dir: str) -> list[str]:
    """The world size of each restart, from rank 0's start records in the timing log (a run with a node range
    may come back on fewer nodes), with the accumulation the trainer set to keep the global batch:
    ``job 7: restart 0 on 2 ranks, restart 1 on 1 rank (accumulation 2 -> 4)``."""
    try:
        records = timing.read_records(out_dir) if os.path.isdir(timing.timing_dir(out_dir)) else []
    except (OSError, ValueError):  # the grace line says what is wrong with the log
        return []
    starts = timing.starts(records)
    if not starts:
        return []
    kept = {r.get("run_id"): r for r in records if r["event"] == "batch"}  # the trainer kept the global batch
    jobs: dict[str, list[str]] = {}
    for number, start in enumerate(starts, start=1):
        restart = start.get("restart")
        label = f"restart {restart}" if isinstance(restart, int) else f"run {number}"
        size = start.get("world_size")
        batch = kept.get(start.get("run_id"))
        accumulation = (f" (accumulation {batch.get('accumulation_from')} -> {batch.get('accumulation_to')})"
                        if batch else "")
        job = f"job {start['job_id']}" if start.get("job_id") else "outside Slurm"
        jobs.setdefault(job, []).append(f"{label} on {size} rank{'' if size == 1 else 's'}{accumulation}")
    runs = [(job, run) for job, listed in jobs.items() for run in listed][-MAX_RUNS_SHOWN:]
    shown: dict[str, list[str]] = {}
    for job, run in runs:
        shown.setdefault(job, []).append(run)
    older = f"{len(starts) - len(runs)} older run(s); " if len(starts) > len(runs) else ""
    return ["ranks:    " + older + "; ".join(f"{job}: {', '.join(listed)}" for job, listed in shown.items())]


MAX_LOG_LINES = 8  # per-task log paths printed; a 512-rank job lists the first ones and the pattern


def task_logs(script: str, job_id: str) -> list[str]:
    """The per-task log paths of a JitExecutor (or submit.py) job, from its batch script: srun's ``--output``
    pattern (submitit's ``%j_%t_log.out``) and ``--error`` for each of the ``--tasks N`` of the finish line.
    Empty for a script without them (the raw sbatch/ scripts: their log is sbatch's --output)."""
    patterns, tasks, counted = {}, None, None
    for line in script.splitlines():
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        if words[:1] == ["srun"]:
            patterns = {flag: words[i + 1] for i, flag in enumerate(words[:-1]) if flag in ("--output", "--error")}
        if "slurm_jit.launch.runner" in words and "--tasks" in words[:-1]:
            counted = words[words.index("--tasks") + 1]
            tasks = int(counted) if counted.isdigit() else None
    if "--output" not in patterns or tasks is None and counted is None:
        return []
    if tasks is None:  # "$SLURM_JIT_WORLD_SIZE": a node range, the ranks of each start differ
        pattern = patterns["--output"].replace("%j", job_id).replace("%%", "%")
        return [f"{pattern} (one per rank, %t the rank; with a node range each start has its own count)"]
    paths = []
    for task in range(min(tasks, MAX_LOG_LINES)):
        found = [p.replace("%j", job_id).replace("%t", str(task)).replace("%%", "%") for p in patterns.values()]
        paths.append(f"task {task}: {', '.join(found)}" + (" (with the batch script's lines)" if task == 0 else ""))
    if tasks > MAX_LOG_LINES:
        paths.append(f"... {tasks} tasks: {patterns['--output'].replace('%j', job_id).replace('%%', '%')}")
    return paths


def _log_lines(out_dir: str, job_id: str | None) -> list[str]:
    if not job_id:
        return []
    kept = output_claim.job_script_path(out_dir, job_id)
    try:
        script = kept.read_text(encoding="utf-8") if kept.exists() else slurm.job_script(job_id)
    except (OSError, UnicodeDecodeError, slurm.SlurmError):
        return []
    paths = task_logs(script, job_id)
    return [f"{'logs:' if i == 0 else '':<10}{path}" for i, path in enumerate(paths)]


def report(out_dir: str, job_id: str | None) -> list[str]:
    saved = progress.read(out_dir)
    recorded = output_claim.recorded_jobs(out_dir)
    job_id = job_id or (recorded[-1] if recorded else None) \
        or (str(saved["job_id"]) if str(saved.get("job_id", "")).isdigit() else None)
    job = _show_job(job_id)
    lines = [f"output:   {out_dir}", *_job_lines(job_id, job), *_log_lines(out_dir, job_id)]
    trouble = progress.problem(out_dir)
    if trouble:
        lines.append(f"warning:  {trouble}: the launcher's history is ignored")
    stopped = _stopped_line(progress.history(saved), job_id, job)
    if stopped is not None:
        lines.append(stopped)
    record = stop_record.read(out_dir)
    lines.extend(_ranks_line(out_dir))
    lines.append("record:   " + (f"{record['state']} step={record.get('step')} job={record.get('job_id')} "
                                 f"restart={record.get('restart_count') or 0}" if record else "none"))
    said = stop_summary.phrase(record)
    if said is not None:
        lines.append(f"stuck:    {said}")
    try:
        lines.append("resume:   " + finished.resume_line(out_dir, gate.check(out_dir)))
    except OSError as exc:
        lines.append(f"resume:   cannot read {out_dir}: {exc.strerror or exc}")
    lines.append(_grace_line(out_dir))
    return lines


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}. HINT: status OUT_DIR or status JOBID\n")


def status_main(argv: Sequence[str]) -> int:
    parser = _Parser(prog="python launch/submit.py status")
    parser.add_argument("target", help="the output directory, or a job id")
    args = parser.parse_args(argv)
    job_id = None
    out_dir: str | None = args.target
    try:
        if args.target.isdigit() and not os.path.isdir(args.target):
            slurm.show_job(args.target)  # an unknown job id fails here, with Slurm's own words
            job_id, out_dir = args.target, out_dir_of_job(args.target)
            if out_dir is None:
                print(f"status: cannot tell the output directory of job {job_id} from its script (no literal "
                      "OUT_DIR= line). HINT: give the output directory instead", file=sys.stderr)
                return EXIT_ERROR
    except slurm.SlurmError as exc:
        print(f"status: {exc}. HINT: give the output directory instead", file=sys.stderr)
        return EXIT_ERROR
    if not os.path.isdir(str(out_dir)):
        print(f"status: no directory {out_dir}. HINT: the --output-dir given to submit.py, or a job id",
              file=sys.stderr)
        return EXIT_ERROR
    print("\n".join(report(str(out_dir), job_id)))
    return EXIT_OK
