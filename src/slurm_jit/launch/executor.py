"""``JitExecutor``: submitit's ``SlurmExecutor`` with a JIT job's script, runner and requeue policy.

    from slurm_jit.launch import Command, JitExecutor
    ex = JitExecutor(folder="logs/%j", output_dir="out", max_requeues=4, step_time_s=30, save_time_s=60)
    ex.update_parameters(timeout_min=60, nodes=2, tasks_per_node=8, slurm_partition="gpu",
                         slurm_setup=["module load cuda"])
    job = ex.submit(train, "out", lr=3e-4)          # a function, called in every srun task (one per rank)
    job = ex.submit(Command(["python", "train.py"]))  # or a program, exec'd in every srun task
    job.result()                                       # after the whole requeue chain

What submitit does here: the parameter names, the ``#SBATCH`` lines, the log layout (``%j_%t_log.out``), the pickle
of the function and the result files (``%j_%t_result.pkl``), the Job objects. What is ours: ``--signal=TERM@N``
(no ``B:``, N sized by the grace calculator) and ``--requeue``, the ckpt-check gate before srun, the per-task
runner (:mod:`slurm_jit.launch.runner`, never submitit's ``_handle_signals``), ``after_step`` after srun (the one
requeue policy, once per job), and the result files written only when the job is over
(:mod:`slurm_jit.launch.job` reads them, and the job's state, through the Slurm gateway).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
import re
import shlex
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slurm_jit import slurm
from slurm_jit.grace.calc import LEAD_ENV_VAR, GraceError
from slurm_jit.grace.sbatch_script import ScriptError, parse_time_limit
from slurm_jit.launch import gate, node_range, output_claim, sbatch_options, submitit_hooks
from slurm_jit.launch.command import Command
from slurm_jit.launch.executor_params import JitExecutorError, check_owned, check_shapes, refuse_submitit_arguments
from slurm_jit.launch.policy import DEFAULT_RETRY_ON_HANG
from slurm_jit.train.refusals import OUTPUT_DIR_ENV

_problem = submitit_hooks.problem()
if _problem is None:
    from submitit.core import core, utils
    from submitit.helpers import Checkpointable
    from submitit.slurm.slurm import SlurmExecutor, _convert_mem, _get_default_parameters, _make_sbatch_string

    from slurm_jit.launch.job import JitJob

    FailedSubmission: type[Exception] = utils.FailedSubmissionError  # sbatch answered without a job id
else:  # the construction says why, in one line (an import error here would be a traceback)
    SlurmExecutor = object  # type: ignore[misc,assignment]
    FailedSubmission = RuntimeError

log = logging.getLogger(__name__)

DEFAULT_MAX_REQUEUES = 5  # as python launch/submit.py: a week on 1-day limits, few enough to stop a bad loop
KILL_ON_BAD_EXIT = "--kill-on-bad-exit=1"  # a rank that fails ends the step: its peers would wait forever
PREFIX = "slurm_"


class JitExecutor(SlurmExecutor):  # type: ignore[misc,valid-type]
    """A submitit ``SlurmExecutor`` for JIT-checkpointed training; see the module docstring.

    ``output_dir`` is the training's output directory (checkpoints, stop record, timing log): the function or
    program must write there. N of ``--signal=TERM@N`` comes from ``signal_lead_s``, else the grace calculator
    on ``step_time_s``/``save_time_s`` over ``output_dir``'s timing log, as ``python launch/submit.py`` sizes it.
    """

    def __init__(self, folder: str | os.PathLike[str], output_dir: str | os.PathLike[str], *,
                 max_requeues: int = DEFAULT_MAX_REQUEUES, retry_on_failure: int = 0,
                 retry_on_hang: int = DEFAULT_RETRY_ON_HANG, exclude_hung_node: bool = False,
                 step_time_s: float | None = None, save_time_s: float | None = None,
                 signal_lead_s: int | None = None, quarantine: bool = False, python: str | None = None,
                 max_pickle_size_gb: float = 1.0, sbatch_args: Sequence[str] = (), **submitit_args: Any) -> None:
        if _problem is not None:
            raise RuntimeError(f"JitExecutor: {_problem}")
        refuse_submitit_arguments(submitit_args, "JitExecutor", _init_names())  # max_num_timeout, typos
        for name, value in (("max_requeues", max_requeues), ("retry_on_failure", retry_on_failure),
                            ("retry_on_hang", retry_on_hang)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise JitExecutorError(f"{name}={value!r}: a whole number, 0 or more. HINT: e.g. {name}=4")
        if not isinstance(exclude_hung_node, bool):  # bool("no") is True: a string or a number is refused
            raise JitExecutorError(f"exclude_hung_node={exclude_hung_node!r}: True or False. HINT: "
                                   "exclude_hung_node=True")
        if signal_lead_s is not None and (isinstance(signal_lead_s, bool) or not isinstance(signal_lead_s, int)
                                          or signal_lead_s < 1):
            raise JitExecutorError(f"signal_lead_s={signal_lead_s!r}: whole seconds, 1 or more. HINT: e.g. 300")
        text = os.fspath(output_dir)
        if not text or any(not c.isprintable() for c in text):
            raise JitExecutorError(f"output_dir {text!r}: empty or holds control characters. HINT: a plain path")
        _check_folder(os.fspath(folder))
        if isinstance(sbatch_args, str):
            raise JitExecutorError("sbatch_args is a string. HINT: a list, e.g. sbatch_args=['--exclusive']")
        sbatch_options.check_extra_args(list(sbatch_args), who="JitExecutor")
        # SlurmExecutor.__init__ refuses where srun is missing: JitExecutor is built for tests and dry runs too.
        core.PicklingExecutor.__init__(self, os.fspath(folder), max_num_timeout=0,
                                       max_pickle_size_gb=max_pickle_size_gb)
        self.python = shlex.quote(sys.executable) if python is None else python
        self.output_dir = os.path.abspath(text)
        self.max_requeues, self.retry_on_failure, self.quarantine = max_requeues, retry_on_failure, quarantine
        self.retry_on_hang, self.exclude_hung_node = retry_on_hang, exclude_hung_node
        self.step_time_s, self.save_time_s, self.signal_lead_s = step_time_s, save_time_s, signal_lead_s
        self.sbatch_args = tuple(sbatch_args)  # sbatch's command line, before the script (values as argv)
        self._kind = "function"

    job_class = JitJob if _problem is None else None  # type: ignore[assignment]

    # --- parameters -------------------------------------------------------------------------------------------
    @classmethod
    def _valid_names(cls) -> set[str]:
        raw = set(_get_default_parameters())
        return raw | {PREFIX + n for n in raw} | set(cls._equivalence_dict() or {})

    def _raw_parameters(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """submitit's generic names, ``slurm_``-prefixed and raw ones, as raw names; typos refused."""
        generic: dict[str, str] = dict(self._equivalence_dict() or {})  # type: ignore[arg-type]
        raw_names, params = set(_get_default_parameters()), {}
        refuse_submitit_arguments(kwargs, "update_parameters")  # slurm_max_num_timeout: a constructor argument
        for name, value in kwargs.items():
            raw = name.removeprefix(PREFIX) if name.startswith(PREFIX) else generic.get(name, name)
            if raw not in raw_names or (name.startswith(PREFIX) and raw in generic):
                close = difflib.get_close_matches(name, sorted(self._valid_names()), n=1)
                raise JitExecutorError(f"update_parameters: unknown parameter {name!r}. HINT: "
                                       + (f"did you mean {close[0]}?" if close else
                                          "submitit's names (timeout_min, nodes, tasks_per_node, ...) or sbatch's"))
            if raw in params:
                raise JitExecutorError(f"update_parameters: {name} sets {raw} twice. HINT: give it once")
            params[raw] = _mem(value) if name == "mem_gb" else value
        return params

    def _internal_update_parameters(self, **kwargs: Any) -> None:
        params = self._raw_parameters(kwargs)
        check_shapes(params)
        check_owned(params)
        if params.get("nodes") is not None:  # "2" -> 2, "1-2" kept: the #SBATCH value
            params["nodes"] = node_range.parse(params["nodes"]).sbatch_value()
        try:
            super()._internal_update_parameters(**params)  # submitit's own check (renders a script)
        except (TypeError, ValueError, AssertionError) as exc:
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise JitExecutorError(f"update_parameters: {detail}. HINT: see sbatch(1) for the value") from None

    # --- the script -------------------------------------------------------------------------------------------
    @property
    def nodes(self) -> node_range.NodeRange:
        """The node counts a start may get (``nodes="1-2"``: sbatch's range)."""
        return node_range.parse(self.parameters.get("nodes", 1))

    @property
    def tasks_per_node(self) -> int:
        return max(1, int(self.parameters.get("ntasks_per_node", 1)))

    @property
    def world_size(self) -> int:
        """The ranks the job asks for (with a node range: on its most nodes, the count Slurm gives first)."""
        return self.nodes.max_nodes * self.tasks_per_node

    def _script_world_size(self) -> str:
        """The ranks of this start in the batch script: fixed, or with a node range the nodes Slurm gave."""
        return '"$SLURM_JIT_WORLD_SIZE"' if self.nodes.elastic else str(self.world_size)

    def signal_lead(self) -> int:
        """N of ``--signal=TERM@N``: given, or from the grace calculator (the one calculation ``python
        launch/submit.py`` and its ``status`` use)."""
        if self.signal_lead_s is not None:
            return self.signal_lead_s
        try:
            result, warnings = sbatch_options.signal_lead(
                self.output_dir, world_size=self.nodes.min_nodes * self.tasks_per_node, nodes=self.nodes.min_nodes,
                step_time=_opt(self.step_time_s), save_time=_opt(self.save_time_s))
        except GraceError as exc:
            raise JitExecutorError(f"--signal lead: {exc}".replace("--step-time", "step_time_s")
                                   .replace("--save-time", "save_time_s")) from None
        for warning in warnings:
            log.warning("JitExecutor: %s", warning)
        return int(result.lead_s)

    @property
    def _submitit_command_str(self) -> str:
        return " ".join([self.python, "-u -m slurm_jit.launch.runner task", shlex.quote(str(self.folder))])

    @property
    def job_name(self) -> str:
        """The job's name: on sbatch's command line, never in an #SBATCH line (sbatch splits those at blanks)."""
        return str(self.parameters.get("job_name", "submitit"))

    def _finish_line(self, *flags: str) -> str:
        kind = " --command" if self._kind == "command" else ""
        return (f"{self.python} -m slurm_jit.launch.runner finish {shlex.quote(str(self.folder))} "
                f'"$OUT_DIR" --tasks {self._script_world_size()}{kind} ' + " ".join(flags)).rstrip()

    def _setup_lines(self, lead_s: int) -> list[str]:
        out, quarantine = '"$OUT_DIR"', " --quarantine" if self.quarantine else ""
        return [
            "# slurm-jit: the training's output directory (status JOBID reads this line)",
            f"OUT_DIR={shlex.quote(self.output_dir)}",
            "# slurm-jit: the ranks' JitTrainer refuses another output_dir than this one",
            f'export {OUTPUT_DIR_ENV}="$OUT_DIR"',
            "# slurm-jit: the trainer's budget, N of --signal=TERM@N (no B:, so the warning reaches the ranks)",
            f"export {LEAD_ENV_VAR}={lead_s}",
            'echo "slurm-jit: job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}"',
            *self._range_lines(),
            "# slurm-jit: the ckpt-check gate: no start when checkpoints exist but none is resumable",
            f"{self.python} -m slurm_jit.launch.gate {out} --world-size {self._script_world_size()}{quarantine} "
            f"|| {{ {self._finish_line('--gate-refused')}; exit 1; }}",
        ]

    def _range_lines(self) -> list[str]:
        """With a node range: this start's world size, from the nodes Slurm gave it."""
        if not self.nodes.elastic:
            return []
        return [f"# slurm-jit: --nodes={self.nodes.sbatch_value()}: this start's ranks, nodes given x tasks per node",
                f"SLURM_JIT_WORLD_SIZE=$((SLURM_JOB_NUM_NODES * {self.tasks_per_node}))",
                'echo "slurm-jit: ${SLURM_JIT_WORLD_SIZE} ranks on ${SLURM_JOB_NUM_NODES} node(s) '
                f'(--nodes={self.nodes.sbatch_value()})"']

    def _range_allocation(self, params: dict[str, Any]) -> list[str]:
        """With a node range, move the tasks per node from sbatch to srun (``params`` changed in place; srun's
        options returned). sbatch turns ``--ntasks-per-node=K`` into ``--ntasks=MIN*K``, and a job of MIN*K tasks
        never gets more than MIN nodes (measured on Slurm 22.05: ``--nodes=1-2 --ntasks-per-node=1`` ran on one of
        two idle nodes). So the allocation asks one task per node holding the K ranks' CPUs, and srun starts K
        tasks on every node it got."""
        if not self.nodes.elastic:
            return []
        params.pop("ntasks_per_node", None)
        per_task = params.get("cpus_per_task")
        if self.tasks_per_node == 1:
            return [f"--ntasks-per-node={self.tasks_per_node}"]
        params["cpus_per_task"] = self.tasks_per_node * int(per_task or 1)
        return [f"--ntasks-per-node={self.tasks_per_node}", f"--cpus-per-task={int(per_task or 1)}"]

    def _teardown_lines(self) -> list[str]:
        out, quarantine = '"$OUT_DIR"', " --quarantine" if self.quarantine else ""
        return [
            "srun_exit=$?",
            "# slurm-jit: requeue this same job or not, once per job, after every rank exited (launch/policy.py)",
            f'{self.python} -m slurm_jit.launch.after_step {out} --srun-exit "$srun_exit" '
            f"--max-requeues {self.max_requeues} --retry-on-failure {self.retry_on_failure}{self._hang_options()}"
            f"{quarantine}",
            "after_step_exit=$?",
            "# slurm-jit: the result files, only once the job is over (a requeued run writes none)",
            "exec " + self._finish_line('--srun-exit "$srun_exit"', '--after-step-exit "$after_step_exit"'),
        ]

    def _hang_options(self) -> str:
        """after_step's hang options, only where they differ from its defaults (scripts stay as they were)."""
        budget = "" if self.retry_on_hang == DEFAULT_RETRY_ON_HANG else f" --retry-on-hang {self.retry_on_hang}"
        fewest = f" --min-nodes {self.nodes.min_nodes}" if self.exclude_hung_node and self.nodes.elastic else ""
        return budget + (" --exclude-hung-node" if self.exclude_hung_node else "") + fewest

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        params = dict(self.parameters)
        params.pop("job_name", None)  # on sbatch's command line (sbatch_argv)
        lead_s = self.signal_lead()
        additional = {**(params.pop("additional_parameters", None) or {}), "signal": f"TERM@{lead_s}",
                      "requeue": True}
        srun_args = [KILL_ON_BAD_EXIT, *self._range_allocation(params), *(params.pop("srun_args", None) or [])]
        text = str(_make_sbatch_string(
            command=command, folder=_pattern_folder(str(self.folder)),
            setup=[*(params.pop("setup", None) or []), *self._setup_lines(lead_s)],
            teardown=self._teardown_lines(), additional_parameters=additional, srun_args=srun_args, **params))
        return "\n".join(line for line in text.split("\n") if not line.startswith("#SBATCH --job-name=")) + "\n"

    def submission_text(self, what: object = None) -> str:
        """The batch script a submit of ``what`` (a function, or a :class:`Command`) would write (dry runs)."""
        self._kind = "command" if isinstance(what, Command) else "function"
        return self._make_submission_file_text(self._submitit_command_str, "dry-run")

    def submission_path(self) -> Path:
        """Where a submit writes the batch script for sbatch: named after output_dir, so one path per submit
        (submits into one output_dir hold its lock) and a dry run can print the exact sbatch argv."""
        return utils.JobPaths.get_first_id_independent_folder(self.folder) / output_claim.submission_name(
            self.output_dir)

    def sbatch_argv(self, submission_file_path: Path | None = None) -> list[str]:
        """The exact sbatch command line of a submit (``--hold``: released once the pickle is in place)."""
        return ["sbatch", "--parsable", "--hold", f"--job-name={self.job_name}", *self.sbatch_args,
                str(submission_file_path or self.submission_path())]

    # --- submission -------------------------------------------------------------------------------------------
    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        # --hold: released once the pickle and the log folder are in place (a job that started first would find
        # no folder for its --output, where Slurm creates none)
        return self.sbatch_argv(submission_file_path)

    @staticmethod
    def _get_job_id_from_submission_command(string: bytes | str) -> str:
        text = string.decode() if isinstance(string, bytes) else string
        job_id = text.strip().split(";")[0]
        if not job_id.isdigit():
            raise utils.FailedSubmissionError(f"sbatch printed {text.strip()!r}, not a job id. HINT: check squeue: "
                                              "the job may have been queued")
        return job_id

    def check(self) -> int:
        """Refuse (one line, HINT) what cannot run: a lead not shorter than the time limit, a refused gate.
        Returns N of ``--signal=TERM@N``."""
        lead_s = self.signal_lead()
        try:
            limit_s = parse_time_limit(str(self.parameters.get("time", 5)))
        except ScriptError as exc:
            raise JitExecutorError(f"timeout_min: {exc}") from None
        if limit_s is None:  # sbatch(1): 0 is no time limit, so Slurm would never send the warning
            raise JitExecutorError(f"timeout_min={self.parameters.get('time')!r} is no time limit (0, UNLIMITED or "
                                   "INFINITE): Slurm would never send the --signal warning, so no JIT checkpoint "
                                   "would be taken. HINT: a time limit, e.g. timeout_min=240")
        if lead_s >= limit_s:
            raise JitExecutorError(f"--signal lead {lead_s} s is not shorter than the time limit ({limit_s} s). "
                                   "HINT: a longer timeout_min, or a faster step/save")
        try:
            checked = gate.check(self.output_dir, quarantine=False, world_size=self.world_size)
        except OSError as exc:
            raise JitExecutorError(f"cannot read {self.output_dir}: {exc.strerror or exc}. HINT: check the path "
                                   "and its permissions") from None
        if not checked.ok and not self.quarantine:
            raise JitExecutorError(checked.message)
        return lead_s

    def _internal_process_submissions(self, delayed_submissions: list[Any]) -> list[Any]:
        if len(delayed_submissions) != 1:
            raise JitExecutorError(
                f"{len(delayed_submissions)} submissions in one array (map_array, submit_array or batch) would "
                f"all train into output_dir {self.output_dir}. HINT: one JitExecutor per output_dir, and "
                "executor.submit once per training")
        delayed = delayed_submissions[0]
        if isinstance(delayed.function, Checkpointable):
            raise JitExecutorError(
                f"{type(delayed.function).__name__} is a submitit Checkpointable: its checkpoint() runs from "
                "submitit's signal handler, which JitExecutor replaces. HINT: a JitTrainer saves its own JIT "
                "checkpoint at the warning; submit a plain function or Command")
        if isinstance(delayed.function, Command) and delayed.function.problem():
            raise JitExecutorError(f"Command: {delayed.function.problem()}. HINT: give the program's path; "
                                   "chmod +x a script")
        self.check()
        pickle_path = self._dump(delayed)
        self._kind = "command" if isinstance(delayed.function, Command) else "function"
        try:
            job = self._submit_claimed()
        except BaseException:
            pickle_path.unlink(missing_ok=True)
            raise
        try:
            job.paths.move_temporary_file(pickle_path, "submitted_pickle")
            slurm.run(["scontrol", "release", job.job_id])
        except (OSError, slurm.SlurmError) as exc:
            job.cancel(check=False)
            raise JitExecutorError(f"job {job.job_id} was queued held and could not be released ({exc}); "
                                   "cancelled. HINT: check the log folder and slurmctld, then submit again") from None
        return [job]

    def _submit_claimed(self) -> Any:
        """Submit while no other job submitted into output_dir (by this executor or submit.py) may still run; the
        job's script is kept as ``OUT_DIR/slurm-jit/job-<id>.sbatch`` so that later submits see it."""
        try:
            with output_claim.submit_lock(self.output_dir):
                output_claim.check_free(self.output_dir, option="output_dir=")
                job = self._submit_command(self._submitit_command_str)
                try:
                    _keep_script(job, self.output_dir)
                except OSError:
                    job.cancel(check=False)  # still held: it never ran
                    raise
        except (ValueError, OSError) as exc:
            if isinstance(exc, JitExecutorError):
                raise
            raise JitExecutorError(str(exc).splitlines()[0] if str(exc) else repr(exc)) from None
        return job

    def _dump(self, delayed: Any) -> Path:
        """Pickle the submission next to the logs; an unpicklable function or argument is refused in one line."""
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        pickle_path = folder / f"{uuid.uuid4().hex}.pkl"
        try:
            delayed.dump(pickle_path)
        except Exception as exc:  # cloudpickle raises TypeError, PicklingError, AttributeError, ...
            pickle_path.unlink(missing_ok=True)
            name = getattr(delayed.function, "__qualname__", type(delayed.function).__name__)
            raise JitExecutorError(f"cannot pickle {name} or its arguments ({type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''}). HINT: submit a function "
                                   "with picklable arguments (no open files, locks, sockets or live models)") from None
        size_gb = pickle_path.stat().st_size / 1024**3
        if size_gb > self.max_pickle_size_gb:
            pickle_path.unlink()
            raise JitExecutorError(f"the pickled function and arguments take {size_gb:.2f} GB > "
                                   f"max_pickle_size_gb={self.max_pickle_size_gb}. HINT: pass paths, not data")
        return pickle_path

    def _submit_command(self, command: str) -> Any:
        """submitit's, with sbatch through the Slurm gateway (one line on a refusal)."""
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        script_path = self.submission_path()
        script_path.unlink(missing_ok=True)  # the last submit's link to its own script: never write through it
        script_path.write_text(self._make_submission_file_text(command, script_path.stem), encoding="utf-8")
        try:
            output = slurm.run(self._make_submission_command(script_path))
        except BaseException:
            script_path.unlink(missing_ok=True)
            raise
        job_id = self._get_job_id_from_submission_command(output)
        JitJob.watcher.forget(job_id)
        # with a node range, the tasks every start has (a requeue on fewer nodes writes results for fewer)
        job = JitJob(folder=self.folder, job_id=job_id, tasks=list(range(self.nodes.min_nodes * self.tasks_per_node)))
        job.paths.move_temporary_file(script_path, "submission_file", keep_as_symlink=True)
        return job


def _init_names() -> tuple[str, ...]:
    """The names JitExecutor's constructor takes (for the hint on an unknown one)."""
    params = inspect.signature(JitExecutor.__init__).parameters.values()
    return tuple(p.name for p in params if p.kind is not p.VAR_KEYWORD and p.name != "self")


def _keep_script(job: Any, output_dir: str | os.PathLike[str]) -> None:
    """The accepted job's script, kept where :mod:`output_claim` looks for the jobs of a directory."""
    target = output_claim.job_script_path(output_dir, job.job_id)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_bytes(Path(job.paths.submission_file).read_bytes())
    os.replace(tmp, target)


def _check_folder(folder: str) -> None:
    """submitit's log folder goes into sbatch's and srun's --output pattern: a backslash (it turns every
    replacement off) or a control character would put the logs where the Job never looks; %A/%a are array tags
    (arrays are refused). Any other % is escaped there (:func:`_pattern_folder`)."""
    if not folder or "\\" in folder or any(not c.isprintable() for c in folder) or re.search(r"%[Aa]", folder):
        raise JitExecutorError(f"folder {folder!r}: sbatch would expand its \\, %A, %a or control characters "
                               "in --output. HINT: a plain path; %j (the job id) is the only tag needed")


def _pattern_folder(folder: str) -> str:
    """The folder as sbatch's and srun's filename pattern: submitit's tags %j and %t kept, any other % doubled
    (``run 50%x`` stays literal, where Python's paths read it literally too)."""
    return re.sub(r"%(?![jt])", "%%", folder)


def _mem(value: object) -> str:
    """submitit's mem_gb conversion, refusing in one line what it cannot convert."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise JitExecutorError(f"mem_gb={value!r}: a positive number of GB. HINT: e.g. mem_gb=64")
    return str(_convert_mem(value))


def _opt(value: float | None) -> str | None:
    return None if value is None else str(value)

