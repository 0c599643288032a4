"""JitExecutor without a cluster: the batch script it generates (submitit's, with the JIT pieces), the parameters
it takes and refuses, the submitit hooks it checks, and what sbatch/scontrol it calls (the gateway faked at its one
boundary; tests/integration/test_executor_slurm.py runs the real cluster)."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Sequence
from pathlib import Path

import executor_helpers
import pytest
import submitit

from slurm_jit import slurm
from slurm_jit.launch import Command, JitExecutor, submitit_hooks
from slurm_jit.launch.executor import JitExecutorError


@pytest.fixture
def ex(tmp_path: Path) -> JitExecutor:
    executor = JitExecutor(folder=tmp_path / "logs" / "%j", output_dir=tmp_path / "out", max_requeues=4,
                           step_time_s=2, save_time_s=5)
    executor.update_parameters(timeout_min=10, nodes=1, tasks_per_node=2, cpus_per_task=1)
    return executor


def _lines(text: str) -> list[str]:
    return text.splitlines()


def test_script_has_term_signal_without_b_requeue_and_submitits_lines(ex: JitExecutor) -> None:
    lines = _lines(ex.submission_text(executor_helpers.add))
    lead = ex.signal_lead()
    assert f"#SBATCH --signal=TERM@{lead}" in lines
    assert [line for line in lines if line.startswith("#SBATCH --signal")] == [f"#SBATCH --signal=TERM@{lead}"]
    assert "USR2" not in "\n".join(lines)
    assert "#SBATCH --requeue" in lines and "#SBATCH --open-mode=append" in lines
    assert "#SBATCH --ntasks-per-node=2" in lines and "#SBATCH --time=10" in lines
    assert "export SUBMITIT_EXECUTOR=slurm" in lines
    assert f"export SLURM_JIT_SIGNAL_LEAD_S={lead}" in lines


def test_gate_runs_before_srun_and_after_step_then_finish_after_it(ex: JitExecutor) -> None:
    lines = _lines(ex.submission_text(executor_helpers.add))
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    gate = next(i for i, line in enumerate(lines) if "-m slurm_jit.launch.gate" in line)
    after = next(i for i, line in enumerate(lines) if "-m slurm_jit.launch.after_step" in line)
    assert gate < srun < after
    assert "--world-size 2" in lines[gate] and "--gate-refused" in lines[gate] and "exit 1" in lines[gate]
    assert "-m slurm_jit.launch.runner task" in lines[srun] and "--kill-on-bad-exit=1" in lines[srun]
    assert "%j_%t_log.out" in lines[srun]  # submitit's per-task logs
    assert [line for line in lines[srun + 1:after] if line and not line.startswith("#")] == ["srun_exit=$?"]
    assert '--srun-exit "$srun_exit" --max-requeues 4 --retry-on-failure 0' in lines[after]
    assert lines[after + 1] == "after_step_exit=$?"
    assert lines[-1].startswith("exec ") and "-m slurm_jit.launch.runner finish" in lines[-1]
    assert "_handle_signals" not in "\n".join(lines) and "submitit.core._submit" not in "\n".join(lines)


def test_setup_lines_come_before_the_gate(ex: JitExecutor) -> None:
    ex.update_parameters(slurm_setup=["module load cuda", "conda activate env"])
    lines = _lines(ex.submission_text(executor_helpers.add))
    assert lines.index("module load cuda") < lines.index("conda activate env") < next(
        i for i, line in enumerate(lines) if "-m slurm_jit.launch.gate" in line)


def test_a_command_job_finishes_with_the_command_flag(ex: JitExecutor) -> None:
    assert "--command" in _lines(ex.submission_text(Command(["true"])))[-1]
    assert "--command" not in _lines(ex.submission_text(executor_helpers.add))[-1]


def test_generic_prefixed_and_raw_names_are_taken(ex: JitExecutor) -> None:
    ex.update_parameters(timeout_min=30, mem_gb=2, gpus_per_node=0, slurm_partition="debug", qos="normal",
                         slurm_additional_parameters={"exclusive": True}, slurm_srun_args=["--cpu-bind=none"],
                         name="my job")
    assert {k: ex.parameters[k] for k in ("time", "mem", "partition", "qos", "job_name")} == {
        "time": 30, "mem": "2GB", "partition": "debug", "qos": "normal", "job_name": "my job"}
    text = ex.submission_text(executor_helpers.add)
    assert "#SBATCH --exclusive" in text and "--kill-on-bad-exit=1 --cpu-bind=none" in text


@pytest.mark.parametrize("params, words", [
    ({"signal_delay_s": 120}, "signal_delay_s"),
    ({"slurm_signal_delay_s": 120}, "signal_delay_s"),
    ({"use_srun": False}, "use_srun"),
    ({"teardown": ["echo"]}, "teardown"),
    ({"srun_args": ["--signal=USR1@60"]}, "--signal"),
    ({"srun_args": ["--sig=USR1@60"]}, "--signal"),
    ({"srun_args": ["-o", "/dev/null"]}, "-o/-e"),
    ({"additional_parameters": {"signal": "B:USR1@600"}}, "--signal"),
    ({"additional_parameters": {"sig": "B:USR1@600"}}, "--signal"),
    ({"additional_parameters": {"requeue": False}}, "--requeue"),
    ({"additional_parameters": {"no_requeue": True}}, "--no-requeue"),
    ({"additional_parameters": {"open_mode": "truncate"}}, "--open-mode"),
    ({"additional_parameters": {"output": "/dev/null"}}, "--output"),
    ({"additional_parameters": {"error": "/dev/null"}}, "--error"),
    ({"additional_parameters": {"array": "0-3"}}, "--array"),
    ({"additional_parameters": {"wait": True}}, "--wait"),
    ({"slurm_setup": "module load cuda"}, "setup"),
    ({"timout_min": 5}, "did you mean timeout_min"),
    ({"slurm_partion": "gpu"}, "did you mean slurm_partition"),
    ({"timeout_min": 5, "time": 6}, "twice"),
    ({"tasks_per_node": "2"}, "ntasks_per_node='2': a whole number"),
    ({"nodes": 0}, "nodes=0: a whole number"),
    ({"slurm_additional_parameters": "signal=B:USR1@600"}, "not a dict"),
    ({"slurm_srun_args": "--signal=USR1@60"}, "srun_args is a string"),
    # found by attacking it as a submitit user: each was accepted (a forged line, a name dropped, a traceback)
    ({"name": "a\nJobState=RUNNING"}, "holds a line break or control character"),
    ({"slurm_partition": "gpu\n#SBATCH --no-requeue"}, "holds a line break"),
    ({"slurm_additional_parameters": {"comment": "a\n#SBATCH --no-requeue"}}, "holds a line break"),
    ({"slurm_additional_parameters": {"job_name": "x"}}, "--job-name"),
    ({"name": ""}, "job_name='': empty"),
    ({"mem_gb": "lots"}, "mem_gb='lots': a positive number of GB"),
    ({"mem_gb": -1}, "a positive number of GB"),
    ({"slurm_setup": ["module load cuda", "#SBATCH --no-requeue"]}, "is an #SBATCH directive"),
    ({"slurm_setup": ["module load cuda\nexport X=1"]}, "holds a line break"),
    ({"slurm_setup": [""]}, "is empty"),
])
def test_owned_parameters_and_typos_are_refused_in_one_line(ex: JitExecutor, params: dict[str, object],
                                                            words: str) -> None:
    before = dict(ex.parameters)
    with pytest.raises(JitExecutorError) as info:
        ex.update_parameters(**params)
    message = str(info.value)
    assert words in message and "HINT:" in message and "\n" not in message, message
    assert ex.parameters == before  # nothing half-applied


def test_constructible_without_srun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun (nor anything else) here
    with pytest.raises(RuntimeError, match="srun"):
        submitit.SlurmExecutor(folder=tmp_path)
    executor = JitExecutor(folder=tmp_path / "logs", output_dir=tmp_path / "out", signal_lead_s=60)
    assert "#SBATCH --signal=TERM@60" in executor.submission_text()


def test_submitit_outside_the_range_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    assert submitit_hooks.problem() is None  # the installed one is in range, with every hook
    monkeypatch.setattr(submitit_hooks.metadata, "version", lambda name: "1.5.3")
    message = submitit_hooks.problem()
    assert message is not None and "submitit 1.5.3 is outside the tested range submitit>=1.5.4,<1.6" in message
    assert 'HINT: pip install "submitit>=1.5.4,<1.6"' in message


def test_pyproject_pins_the_checked_range() -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'"{submitit_hooks.SUPPORTED_RANGE}"' in pyproject


def test_a_lead_not_shorter_than_the_time_limit_is_refused(ex: JitExecutor) -> None:
    ex.update_parameters(timeout_min=1)
    ex.signal_lead_s = 90
    with pytest.raises(JitExecutorError, match=r"lead 90 s is not shorter than the time limit \(60 s\)"):
        ex.submit(executor_helpers.add, 1, 2)


@pytest.mark.parametrize("limit", [0, "0", "UNLIMITED", "infinite"], ids=["int-0", "str-0", "UNLIMITED", "infinite"])
def test_no_time_limit_is_refused_before_sbatch(ex: JitExecutor, monkeypatch: pytest.MonkeyPatch,
                                                limit: object) -> None:
    # sbatch(1): a time limit of 0 (UNLIMITED, INFINITE) is none, so Slurm never sends the --signal warning and no
    # JIT checkpoint is ever taken. Before: the lead-vs-limit check was skipped and the job submitted.
    gateway = Gateway()
    monkeypatch.setattr(slurm, "runner", gateway)
    ex.update_parameters(timeout_min=limit)
    with pytest.raises(JitExecutorError, match="no time limit") as refused:
        ex.submit(executor_helpers.add, 1, 2)
    assert "\n" not in str(refused.value) and "HINT: " in str(refused.value), refused.value
    assert gateway.calls == []


def test_a_signal_lead_of_true_is_refused(tmp_path: Path) -> None:
    # Before: True is an int in Python: --signal=TERM@True in the script, refused only by sbatch after the submit
    with pytest.raises(JitExecutorError, match="signal_lead_s=True: whole seconds"):
        JitExecutor(folder=tmp_path / "logs", output_dir=tmp_path / "out", signal_lead_s=True)


def test_no_step_time_and_no_timing_log_is_refused_in_one_line(tmp_path: Path) -> None:
    executor = JitExecutor(folder=tmp_path / "logs", output_dir=tmp_path / "out")
    with pytest.raises(JitExecutorError, match="no step time. HINT: give step_time_s"):
        executor.submission_text()


class Gateway:
    """The Slurm gateway's runner: answers sbatch with a job id, records every argv."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout_s: float) -> str:
        self.calls.append(list(argv))
        if argv[0] == "sbatch":
            return "4242\n"
        if argv[0] == "squeue":
            return "RUNNING\n"
        return ""


def test_submit_goes_through_the_gateway_held_then_released(ex: JitExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = Gateway()
    monkeypatch.setattr(slurm, "runner", gateway)
    job = ex.submit(executor_helpers.add, 1, 2)
    assert job.job_id == "4242" and job.num_tasks == 2
    assert gateway.calls[0][:3] == ["sbatch", "--parsable", "--hold"]
    assert gateway.calls[1] == ["scontrol", "release", "4242"]
    assert job.paths.submitted_pickle.exists() and job.paths.submission_file.exists()  # in place before release
    assert job.state == "RUNNING" and not job.done()
    job.cancel()
    job._interrupt()
    assert gateway.calls[-2:] == [["scancel", "4242"], ["scancel", "--signal=TERM", "4242"]]
    assert not any(call[0] == "sacct" for call in gateway.calls)


def test_arrays_and_batches_are_refused_in_one_line(ex: JitExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = Gateway()
    monkeypatch.setattr(slurm, "runner", gateway)
    with pytest.raises(JitExecutorError, match="one JitExecutor per output_dir"):
        ex.map_array(executor_helpers.add, [1, 2], [3, 4])
    with pytest.raises(JitExecutorError, match="one JitExecutor per output_dir"):
        with ex.batch():
            ex.submit(executor_helpers.add, 1, 2)
            ex.submit(executor_helpers.add, 3, 4)
    assert gateway.calls == []


def test_an_unpicklable_function_is_refused_before_sbatch(ex: JitExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = Gateway()
    monkeypatch.setattr(slurm, "runner", gateway)
    lock = threading.Lock()
    with pytest.raises(JitExecutorError, match="cannot pickle .* HINT: submit a function with picklable"):
        ex.submit(lambda: lock.locked())
    assert gateway.calls == []
    assert not list(Path(ex.folder).parent.glob("*.pkl"))  # no pickle left behind


def test_a_command_without_its_exec_bit_is_refused(ex: JitExecutor, tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(JitExecutorError, match="not executable .* HINT: .*chmod \\+x"):
        ex.submit(Command([str(script)]))
    with pytest.raises(ValueError, match="HINT"):
        Command("python train.py")  # type: ignore[arg-type]


def test_a_command_outcome_pickles() -> None:
    from slurm_jit.launch.command import CommandOutcome

    outcome = CommandOutcome(job_id="1", restarts=1, final_step=400, stop_record={"state": "finished"}, srun_exit=0)
    assert pickle.loads(pickle.dumps(outcome)) == outcome


class Resumable(submitit.helpers.Checkpointable):
    def __call__(self) -> int:
        return 1


def test_a_submitit_checkpointable_is_refused(ex: JitExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = Gateway()
    monkeypatch.setattr(slurm, "runner", gateway)
    with pytest.raises(JitExecutorError, match="Checkpointable: its checkpoint\\(\\) runs from submitit's signal"):
        ex.submit(Resumable())
    assert gateway.calls == []


@pytest.mark.parametrize("folder", ["logs\\\\x", "logs/a\nb", "logs/%A_%a"])
def test_a_log_folder_sbatch_would_expand_is_refused(tmp_path: Path, folder: str) -> None:
    with pytest.raises(JitExecutorError, match="HINT: a plain path"):
        JitExecutor(folder=tmp_path / folder, output_dir=tmp_path / "out", signal_lead_s=60)


@pytest.mark.parametrize("folder", ["logs/%x", "logs/100%", "run 50%x/%j"])
def test_a_percent_in_the_log_folder_is_escaped_for_sbatch_and_srun(tmp_path: Path, folder: str) -> None:
    """A literal % (python launch/submit.py's --output-dir "run 50%x") reaches sbatch's and srun's --output as %%,
    so the logs land where the Job reads them; submitit's %j stays a tag."""
    executor = JitExecutor(folder=tmp_path / folder, output_dir=tmp_path / "out", signal_lead_s=60)
    lines = executor.submission_text(executor_helpers.add).splitlines()
    escaped = str(tmp_path / folder).replace("%", "%%").replace("%%j", "%j")
    output = next(line for line in lines if line.startswith("#SBATCH --output="))
    assert output.removeprefix("#SBATCH --output=").strip("'") == f"{escaped}/%j_0_log.out"
    srun = next(line for line in lines if line.startswith("srun "))
    assert f"{escaped}/%j_%t_log.out" in srun


def test_submit_without_slurm_says_so_in_one_line_and_leaves_no_pickle(ex: JitExecutor, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    with pytest.raises(slurm.SlurmError, match="sbatch not found on PATH. HINT:"):
        ex.submit(executor_helpers.add, 1, 2)
    leftovers = [p.name for p in Path(ex.folder).parent.iterdir()] if Path(ex.folder).parent.exists() else []
    assert not [name for name in leftovers if name.endswith((".pkl", ".sh"))], leftovers


def test_a_missing_submitit_hook_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(submitit.SlurmJob, "_interrupt")
    message = submitit_hooks.problem()
    assert message is not None and "\n" not in message
    assert "lacks submitit.slurm.slurm.SlurmJob._interrupt" in message and "HINT:" in message


@pytest.mark.parametrize("name", ["max_num_timeout", "slurm_max_num_timeout"])
def test_submitits_max_num_timeout_is_refused_naming_max_requeues(tmp_path: Path, name: str) -> None:
    """submitit's cap on requeues after a time limit (AutoExecutor's slurm_ form too): JitExecutor's
    max_requeues caps every requeue, so the name is refused in one line rather than taken with another meaning.
    Before: a bare TypeError from the constructor, "did you mean slurm_time?" from update_parameters."""
    with pytest.raises(JitExecutorError) as info:
        JitExecutor(folder=tmp_path / "logs", output_dir=tmp_path / "out", signal_lead_s=60, **{name: 3})
    message = str(info.value)
    assert message.startswith(f"JitExecutor({name}=3): submitit's cap on requeues after a time limit"), message
    assert message.endswith("HINT: give max_requeues instead, e.g. JitExecutor(..., max_requeues=3)")
    assert "\n" not in message
    executor = JitExecutor(folder=tmp_path / "logs", output_dir=tmp_path / "out", signal_lead_s=60)
    with pytest.raises(JitExecutorError, match=r"^update_parameters\(" + name + r"=3\): .*HINT: give max_requeues"):
        executor.update_parameters(**{name: 3})


def test_an_unknown_constructor_argument_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(JitExecutorError, match=r"^JitExecutor: unknown argument 'max_requeue'\. HINT: did you mean "
                                               r"max_requeues\?$"):
        JitExecutor(folder=tmp_path / "logs", output_dir=tmp_path / "out", max_requeue=3)


def test_a_second_submit_into_a_live_output_dir_names_the_output_dir_argument(
        ex: JitExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python API's refusal names output_dir=, not submit.py's --output-dir flag."""
    monkeypatch.setattr(slurm, "runner", Gateway())  # scontrol show job 4242: still there (no JobState: UNKNOWN)
    first = ex.submit(executor_helpers.add, 1, 2)
    with pytest.raises(JitExecutorError) as info:
        ex.submit(executor_helpers.add, 3, 4)
    message = str(info.value)
    assert f"is in use by job {first.job_id}" in message and "\n" not in message, message
    assert message.endswith(f"scancel {first.job_id}, or give this one another output_dir="), message
    assert "--output-dir" not in message
