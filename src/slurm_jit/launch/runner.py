"""The per-task runner of :class:`~slurm_jit.launch.executor.JitExecutor` jobs, and their result files.

``python -m slurm_jit.launch.runner task FOLDER`` is each srun task (one per rank): it waits for the submitted
pickle, sets the rank environment (:func:`slurm_jit.train.dist_env.from_slurm`), and execs a
:class:`~slurm_jit.launch.command.Command` or calls the function in this process. It never installs submitit's
``_handle_signals`` (which bypasses SIGTERM in every task and requeues from a signal handler in rank 0): the
trainer takes the signals, ``after_step`` takes the requeue decision. A function's return value (or error) is kept
as *pending* for this run only.

``python -m slurm_jit.launch.runner finish FOLDER OUT_DIR --tasks N ...`` is the batch script's last line, after
``after_step``: when the job is over (not requeued) it writes submitit's ``%j_%t_result.pkl`` for every task,
from the pending values and the policy's decision; a requeued run writes none.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from submitit.core import utils

from slurm_jit import slurm
from slurm_jit.launch import ops, progress
from slurm_jit.launch.command import Command, CommandOutcome
from slurm_jit.train import dist_env, stop_record

PICKLE_WAIT_S = 120  # the pickle is moved in place right after sbatch answers; a slow shared FS may lag (NFS)
EXIT_BAD_SUBMISSION = 2
REQUEUED_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD"})
# How long a rank waits for its node's first rank to copy the ops (ops.job_copy) before copying them itself: a copy
# of the CPU ops (105 MB here) takes under a second, a few GB of CUDA ops on a slow /tmp a minute.
OPS_COPY_WAIT_S = 120
OPS_COPY_SAY_S = 1.0  # a copy that takes longer is said in the job log (it delays the first step); a quick one not


def _run_ids(env: Mapping[str, str]) -> tuple[str, int]:
    restart = env.get("SLURM_RESTART_COUNT", "0").strip() or "0"
    return env["SLURM_JOB_ID"], int(restart) if restart.isdigit() else 0


def pending_path(folder: Path, job_id: str, task: int, restart: int) -> Path:
    """Where task ``task`` of run ``restart`` keeps its value until the job is over."""
    return folder / f"{job_id}_{task}_restart{restart}_pending.pkl"


def _save(path: Path, outcome: tuple[str, Any]) -> None:
    """Write-then-rename (a reader never sees half a file); a failed write leaves nothing behind (submitit's
    temporary_save_path would refuse every later save of the same path)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        utils.cloudpickle_dump(outcome, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _say(message: str) -> None:
    print(f"slurm-jit runner: {message}", file=sys.stderr, flush=True)


def _exec(command: Command) -> int:
    try:
        os.execvp(command.argv[0], list(command.argv))  # this process becomes the rank
    except OSError as exc:
        _say(f"cannot run {command.argv[0]}: {exc.strerror or exc}. HINT: give the program's path; chmod +x it")
    return EXIT_BAD_SUBMISSION


def _call(delayed: Any, pending: Path) -> int:
    """Call the function here; keep ("success", value) or ("error", traceback) as pending."""
    try:
        outcome: tuple[str, Any] = ("success", delayed.function(*delayed.args, **delayed.kwargs))
        code = 0
    except SystemExit as exc:  # sys.exit() in the function: its status is the task's
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        outcome = ("success", None) if code == 0 else ("error", f"SystemExit: the function exited with {exc.code}")
    except Exception:  # noqa: BLE001 - the function's error is its result, as in submitit
        trace = traceback.format_exc()
        print(trace, file=sys.stderr, flush=True)
        outcome, code = ("error", trace), 1
    try:
        _save(pending, outcome)
    except Exception as exc:  # noqa: BLE001 - an unpicklable return value
        _save(pending, ("error", f"the return value cannot be pickled ({type(exc).__name__}: {exc})"))
        _say(f"the return value cannot be pickled: {exc}. HINT: return plain data (numbers, str, dict)")
        return 1
    return code


def task_main(folder: str, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    os.environ["SUBMITIT_FOLDER"] = folder  # submitit.JobEnvironment().paths in the user's code
    job_id, restart = _run_ids(env)
    rank = int(env.get("SLURM_PROCID", "0"))
    paths = utils.JobPaths(folder, job_id=job_id, task_id=rank)
    paths.result_pickle.unlink(missing_ok=True)  # a result of an earlier run (a manual requeue) is not this one's
    pending = pending_path(paths.folder, job_id, rank, restart)
    dist_env.from_slurm()
    _load_ops_from_own_copy(env, job_id, restart)
    deadline = time.monotonic() + PICKLE_WAIT_S
    while not paths.submitted_pickle.exists() and time.monotonic() < deadline:
        time.sleep(1)
    try:
        delayed = utils.DelayedSubmission.load(paths.submitted_pickle)
    except Exception as exc:  # noqa: BLE001 - missing, or the function's module is not importable here
        message = f"cannot load {paths.submitted_pickle} ({type(exc).__name__}: {exc})"
        _say(f"{message}. HINT: the function's module must be importable on the nodes (PYTHONPATH)")
        _save(pending, ("error", message))
        return EXIT_BAD_SUBMISSION
    if isinstance(delayed.function, Command):
        return _exec(delayed.function)
    return _call(delayed, pending)


def _load_ops_from_own_copy(env: Mapping[str, str], job_id: str, restart: int) -> None:
    """This rank's TORCH_EXTENSIONS_DIR: this job start's node-local copy of the built ops, so that no other job's
    build, load or stale lock can hold its start (ops.py says why). The node's first rank copies, the others wait
    for it (up to OPS_COPY_WAIT_S, then copy themselves). Where the copy cannot be made (TMPDIR full, read-only,
    not writable) every rank of the node loads from the shared directory at once, and the one that tried says why."""
    shared = ops.torch_build_root(env)
    if shared is None:
        return
    dest = ops.copy_path(env, job_id, restart)
    started = time.monotonic()
    if env.get("SLURM_LOCALID", "0") != "0" and not _first_rank_copied(dest):
        return
    try:
        made, skipped = ops.job_copy(shared, dest)
    except OSError as exc:
        ops.mark_failed(dest, str(exc))
        _say(f"ops: no copy of {shared} in {dest.parent} for this job ({exc}), so the ranks on "
             f"{socket.gethostname()} load from {shared}, where another job's build or lock can hold them. HINT: "
             "point TMPDIR at a writable local disk with room for that directory")
        return
    os.environ["TORCH_EXTENSIONS_DIR"] = str(dest)
    if made:
        _after_copy(shared, dest, time.monotonic() - started, skipped, job_id)


def _first_rank_copied(dest: Path) -> bool:
    """Wait for the node's first rank's copy: True once it is there (or after OPS_COPY_WAIT_S: copy it here),
    False as soon as that rank cannot make it (ops.copy_failed)."""
    deadline = time.monotonic() + OPS_COPY_WAIT_S
    while not dest.is_dir() and time.monotonic() < deadline:
        if ops.copy_failed(dest):
            return False
        time.sleep(0.1)
    return True


def _after_copy(shared: Path, dest: Path, took_s: float, skipped: list[str], job_id: str) -> None:
    if took_s >= OPS_COPY_SAY_S:
        _say(f"ops: copying {shared} to {dest} on {socket.gethostname()} took {took_s:.1f} s (the ranks load their "
             "start's own copy: no other job's build or lock holds them)")
    if skipped:
        _say(f"ops: {', '.join(skipped)} changed during the copy (a build in {shared}): this job builds its own")
    now = time.time()
    for op in sorted(p.name for p in shared.iterdir() if p.is_dir()) if shared.is_dir() else []:
        stale = ops.stale_lock(op, shared, now)
        if stale is not None:
            _say(f"ops: a lock left in {stale.parent} (a build cut off) holds every other loader of it forever. "
                 f"HINT: if no build uses {shared} now, rm {stale}")
    if not any(p != dest and not p.name.startswith(".") for p in dest.parent.iterdir()):
        return  # no other copy on this node: nothing to ask Slurm about
    try:
        running = set(slurm.run(["squeue", "--me", "-h", "-o", "%A"]).split())
    except slurm.SlurmError:
        return  # the copies of ended jobs stay until a later start on this node can ask
    ops.prune_copies(dest.parent, running | {job_id})


def _publish_ops(env: Mapping[str, str], job_id: str, restart: int) -> None:
    """After each start: the ops its ranks built are published to the shared directory where that has none, and
    the batch node's copy is removed."""
    shared, copy = ops.torch_build_root(env), ops.copy_path(env, job_id, restart)
    if shared is not None:
        published, rebuilt = ops.publish(copy, shared)
        if published:
            print(f"slurm-jit: ops {', '.join(published)} built by this job, now in {shared} for the next jobs",
                  flush=True)
        if rebuilt:
            print(f"slurm-jit: ops {', '.join(rebuilt)} were rebuilt by this job (the ones in {shared} are another "
                  "toolchain's: another ninja, venv or DeepSpeed), as every start will. HINT: one toolchain per "
                  f"directory: give this venv a TORCH_EXTENSIONS_DIR of its own, build the ops there ({ops.DOCS})",
                  flush=True)
    shutil.rmtree(copy, ignore_errors=True)
    ops.failed_path(copy).unlink(missing_ok=True)


# --- finish: the result files, once the job is over ---------------------------------------------------------------
def _decision(out_dir: str, job_id: str, restart: int) -> dict[str, Any] | None:
    """after_step's record of this run's decision, None when it recorded none."""
    entries = [e for e in progress.history(progress.read(out_dir))
               if str(e.get("job_id")) == job_id and e.get("restart") == restart]
    return entries[-1] if entries else None


def _requeued(decision: dict[str, Any] | None, after_step_exit: int, job_id: str, restart: int) -> bool:
    if decision is not None:
        return decision.get("requeue") is True and after_step_exit == 0
    if after_step_exit != 0:
        return False
    try:  # no record (after_step could not write it): ask Slurm whether this run was requeued
        job = slurm.show_job(job_id)
    except slurm.SlurmError:
        return False
    restarts = job.get("Restarts", "0")
    return slurm.job_state(job) in REQUEUED_STATES or (restarts.isdigit() and int(restarts) > restart)


def _reason(args: argparse.Namespace, decision: dict[str, Any] | None, restart: int) -> str:
    if args.gate_refused:
        return ("the ckpt-check gate refused to start: checkpoints exist but none is resumable (see the job log). "
                "HINT: inspect with ckpt-check OUT_DIR; quarantine=True renames them aside")
    if decision is None:
        return f"srun exit {args.srun_exit}, after_step exit {args.after_step_exit} (see the job log)"
    step = "" if decision.get("step") is None else f" at step {decision['step']}"
    what = "finished" if decision.get("cause") == "finished" else f"stopped by {decision.get('cause')}"
    outcome = decision.get("outcome")
    if decision.get("requeue") is True:  # decided, but after_step failed to requeue (withdrawn or refused)
        return f"{what}{step} (restart {restart}); the requeue did not happen (see the job log)"
    if isinstance(outcome, str) and outcome not in ("requeued", "not requeued"):  # after_step's record of why
        return f"{what}{step} (restart {restart}); {outcome}"
    return f"{what}{step} (restart {restart}); policy: no requeue: {decision.get('reason')}"


def _outcomes(args: argparse.Namespace, job_id: str, restart: int, folder: Path) -> list[tuple[str, Any]]:
    decision = None if args.gate_refused else _decision(args.out_dir, job_id, restart)
    record = stop_record.read(args.out_dir)
    ours = record is not None and str(record.get("job_id")) == job_id \
        and str(record.get("restart_count") or 0) == str(restart)
    cancelled = decision is not None and decision.get("cause") == "user cancel"
    ok = (not args.gate_refused and not cancelled and args.srun_exit == 0
          and (not ours or record is not None and record.get("state") == "finished"))
    reason = f"job {job_id}: {_reason(args, decision, restart)}"
    if args.command:
        outcome = CommandOutcome(job_id=job_id, restarts=restart, srun_exit=args.srun_exit if args.srun_exit
                                 is not None else -1, final_step=record.get("step") if ours and record else None,
                                 stop_record=record if ours else None)
        return [("success", outcome) if ok else ("error", reason)] * args.tasks
    results = []
    for task in range(args.tasks):
        try:
            pending: tuple[str, Any] | None = utils.pickle_load(pending_path(folder, job_id, task, restart))
        except Exception:  # noqa: BLE001 - the task died before it could keep one
            pending = None
        if ok and pending is not None and pending[0] == "success":
            results.append(pending)
        elif pending is not None and pending[0] == "error":
            trace = str(pending[1]).strip()
            results.append(("error", f"job {job_id}: task {task} raised {trace.splitlines()[-1]}; "
                                     f"{_reason(args, decision, restart)}\n{trace}"))
        else:
            results.append(("error", reason if not ok else f"job {job_id}: task {task} left no result"))
    return results


def finish_main(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    job_id, restart = _run_ids(env)
    _publish_ops(env, job_id, restart)
    decision = None if args.gate_refused else _decision(args.out_dir, job_id, restart)
    if not args.gate_refused and _requeued(decision, args.after_step_exit, job_id, restart):
        print(f"slurm-jit: job {job_id} requeued: no result files from run {restart}", flush=True)
        return 0
    folder = utils.JobPaths(args.folder, job_id=job_id).folder
    outcomes = _outcomes(args, job_id, restart, folder)
    for task, outcome in enumerate(outcomes):
        _save(utils.JobPaths(args.folder, job_id=job_id, task_id=task).result_pickle, outcome)
    ok = all(o[0] == "success" for o in outcomes)
    print(f"slurm-jit: job {job_id} over: {'result' if ok else 'error'} files written for {args.tasks} task(s)",
          flush=True)
    return 0 if ok else (args.srun_exit or args.after_step_exit or 1)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slurm_jit.launch.runner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    task = sub.add_parser("task", help="one srun task: run the submitted function or Command")
    task.add_argument("folder")
    finish = sub.add_parser("finish", help="the batch script's last line: result files once the job is over")
    finish.add_argument("folder")
    finish.add_argument("out_dir")
    finish.add_argument("--tasks", type=int, required=True)
    finish.add_argument("--command", action="store_true", help="the job runs a Command (result: its outcome)")
    finish.add_argument("--srun-exit", type=int, default=None)
    finish.add_argument("--after-step-exit", type=int, default=0)
    finish.add_argument("--gate-refused", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if not os.environ.get("SLURM_JOB_ID"):
        _say("SLURM_JOB_ID is not set. HINT: JitExecutor's batch script runs this, inside a Slurm job")
        sys.exit(EXIT_BAD_SUBMISSION)
    sys.exit(task_main(args.folder) if args.mode == "task" else finish_main(args))


if __name__ == "__main__":
    main()
