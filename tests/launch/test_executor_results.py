"""The runner's result files and the Job that reads them, on real files: a run that is requeued writes no result,
the run that ends the job writes every task's, and an error carries the policy's one-line reason. The Slurm
gateway is faked at its one boundary (tests/integration/test_executor_slurm.py runs the real cluster)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import executor_helpers
import pytest
from submitit.core import utils

from slurm_jit import slurm
from slurm_jit.launch import job as job_module
from slurm_jit.launch import progress, runner
from slurm_jit.launch.command import CommandOutcome
from slurm_jit.launch.job import JitJob
from slurm_jit.train import stop_record

JOB = "77"


@pytest.fixture(autouse=True)
def _fresh_watcher() -> Iterator[None]:
    """JitJob's watcher is shared by the process: what these fakes said of job 77 must not reach a real job 77
    of the local cluster in a later test."""
    yield
    JitJob.watcher.clear()


@pytest.fixture
def job_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SLURM_JOB_ID", JOB)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)  # not an srun task: dist_env leaves RANK alone
    monkeypatch.delenv("RANK", raising=False)
    # task_main points the rank's TORCH_EXTENSIONS_DIR at its start's copy of the ops: restored after the test, and
    # the copy made of an empty directory under this test's TMPDIR
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    return tmp_path


def _submit(folder: Path, function: object, *args: object) -> None:
    path = utils.JobPaths(folder, job_id=JOB).submitted_pickle
    path.parent.mkdir(parents=True, exist_ok=True)
    utils.DelayedSubmission(function, *args).dump(path)


def _tasks(folder: Path, monkeypatch: pytest.MonkeyPatch, n: int = 2) -> list[int]:
    codes = []
    for rank in range(n):
        monkeypatch.setenv("SLURM_PROCID", str(rank))
        codes.append(runner.task_main(str(folder)))
    return codes


def _decide(out: Path, restart: int, cause: str, requeue: bool, reason: str, step: int | None = None) -> None:
    saved = progress.read(out)
    progress.write(out, {"job_id": JOB, "history": [*progress.history(saved), {
        "job_id": JOB, "restart": restart, "cause": cause, "step": step, "requeue": requeue, "reason": reason}]})


def _finish(folder: Path, out: Path, srun_exit: int, after_step_exit: int, *, tasks: int = 2,
            command: bool = False, gate_refused: bool = False) -> int:
    return runner.finish_main(argparse.Namespace(folder=str(folder), out_dir=str(out), tasks=tasks,
                                                 command=command, srun_exit=srun_exit,
                                                 after_step_exit=after_step_exit, gate_refused=gate_refused))


def _results(folder: Path, tasks: int = 2) -> list[tuple[str, object] | None]:
    found = []
    for task in range(tasks):
        path = utils.JobPaths(folder, job_id=JOB, task_id=task).result_pickle
        found.append(utils.pickle_load(path) if path.exists() else None)
    return found


def test_a_requeued_run_writes_no_result_and_the_last_run_writes_every_tasks(
        job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, out = job_env / "logs" / "%j", job_env / "out"
    _submit(folder, executor_helpers.add, 1, 2)
    assert _tasks(folder, monkeypatch) == [0, 0]
    stop_record.write(out, "jit_stop", step=5)
    _decide(out, 0, "time limit", True, "JIT checkpoint complete; requeue 1 of 4")
    assert _finish(folder, out, srun_exit=0, after_step_exit=0) == 0
    assert _results(folder) == [None, None]  # a JIT stop that is requeued is not a result
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert _tasks(folder, monkeypatch) == [0, 0]
    stop_record.write(out, "finished", step=9)
    _decide(out, 1, "finished", False, "training reached its end", step=9)
    assert _finish(folder, out, srun_exit=0, after_step_exit=0) == 0
    assert _results(folder) == [("success", 3), ("success", 3)]


def test_a_function_that_raises_gives_its_error_with_the_policys_reason(
        job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, out = job_env / "logs", job_env / "out"
    _submit(folder, executor_helpers.fail, "boom")
    assert _tasks(folder, monkeypatch) == [1, 1]
    _decide(out, 0, "crash", False, "no stop record, srun exit 1; failures are not requeued "
                                    "(--retry-on-failure 0, 0 used)")
    assert _finish(folder, out, srun_exit=1, after_step_exit=1) == 1
    outcome = _results(folder)[0]
    assert outcome is not None and outcome[0] == "error"
    first, *trace = str(outcome[1]).splitlines()
    assert first == (f"job {JOB}: task 0 raised ValueError: boom; stopped by crash (restart 0); policy: no requeue: "
                     "no stop record, srun exit 1; failures are not requeued (--retry-on-failure 0, 0 used)")
    assert any("raise ValueError(message)" in line for line in trace)


def test_a_plain_function_without_a_trainer_is_a_success(job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, out = job_env / "logs", job_env / "out"
    _submit(folder, executor_helpers.add, 2, 2)
    assert _tasks(folder, monkeypatch) == [0, 0]
    _decide(out, 0, "crash", False, "no stop record, srun exit 0; failures are not requeued")  # what after_step says
    assert _finish(folder, out, srun_exit=0, after_step_exit=1) == 0
    assert _results(folder) == [("success", 4), ("success", 4)]


def test_a_jit_stop_not_requeued_is_an_error_not_a_result(job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, out = job_env / "logs", job_env / "out"
    _submit(folder, executor_helpers.add, 1, 1)
    assert _tasks(folder, monkeypatch) == [0, 0]
    stop_record.write(out, "jit_stop", step=5)
    _decide(out, 0, "time limit", False, "maximum requeues reached (0 of 0)", step=5)
    assert _finish(folder, out, srun_exit=0, after_step_exit=1) == 1
    assert _results(folder)[1] == ("error", f"job {JOB}: stopped by time limit at step 5 (restart 0); "
                                            "policy: no requeue: maximum requeues reached (0 of 0)")


def test_a_command_result_is_the_jobs_outcome(job_env: Path) -> None:
    folder, out = job_env / "logs", job_env / "out"
    stop_record.write(out, "finished", step=40)
    _decide(out, 0, "finished", False, "training reached its end", step=40)
    assert _finish(folder, out, srun_exit=0, after_step_exit=0, tasks=1, command=True) == 0
    outcome = _results(folder, tasks=1)[0]
    assert outcome is not None and outcome[0] == "success" and isinstance(outcome[1], CommandOutcome)
    assert (outcome[1].final_step, outcome[1].restarts, outcome[1].stop_record["state"]) == (40, 0, "finished")


def test_a_refused_gate_says_so(job_env: Path) -> None:
    folder, out = job_env / "logs", job_env / "out"
    assert _finish(folder, out, srun_exit=0, after_step_exit=0, tasks=1, gate_refused=True) == 1
    outcome = _results(folder, tasks=1)[0]
    assert outcome is not None and "the ckpt-check gate refused to start" in str(outcome[1])


class Gateway:
    def __init__(self, state: str) -> None:
        self.state = state

    def __call__(self, argv: Sequence[str], timeout_s: float) -> str:
        if self.state == "gone":
            raise slurm.SlurmError(f"{' '.join(argv)} failed (exit 1): slurm_load_jobs error: Invalid job id "
                                   "specified")
        assert argv[0] == "squeue", argv
        return f"{self.state}\n"


def _job(folder: Path, monkeypatch: pytest.MonkeyPatch, state: str) -> JitJob:
    monkeypatch.setattr(slurm, "runner", Gateway(state))
    JitJob.watcher.clear()
    return JitJob(folder=folder, job_id=JOB, tasks=[0, 1])


def test_the_job_gives_rank_0s_result_once_slurm_says_it_ended(job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, out = job_env / "logs", job_env / "out"
    _submit(folder, executor_helpers.add, 1, 2)
    _tasks(folder, monkeypatch)
    _finish(folder, out, srun_exit=0, after_step_exit=1)
    job = _job(folder, monkeypatch, "COMPLETING")
    assert not job.done()  # the results are there, but Slurm has not ended the job yet
    job = _job(folder, monkeypatch, "COMPLETED")
    assert job.done() and job.result() == 3 and job.results() == [3, 3] and job.exception() is None
    assert job.state == "COMPLETED"
    job = _job(folder, monkeypatch, "gone")  # MinJobAge later: the result files say how it ended
    assert job.done() and job.state == "COMPLETED" and job.result() == 3


def test_a_requeued_job_is_not_done(job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for state in ("PENDING", "REQUEUED", "RUNNING"):
        assert not _job(job_env / "logs", monkeypatch, state).done()


def test_a_cancelled_job_says_so(job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job(job_env / "logs", monkeypatch, "CANCELLED")
    error = job.exception()
    assert isinstance(error, utils.UncompletedJobError)
    assert str(error).startswith(f"job {JOB} was cancelled (scancel) and left no result; a cancelled job is never "
                                 "requeued. HINT:")
    with pytest.raises(utils.UncompletedJobError, match="cancelled"):
        job.result()


def test_a_failed_job_raises_its_first_line_reason(job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, out = job_env / "logs", job_env / "out"
    _submit(folder, executor_helpers.fail, "boom")
    _tasks(folder, monkeypatch)
    _decide(out, 0, "crash", False, "no stop record, srun exit 1; failures are not requeued")
    _finish(folder, out, srun_exit=1, after_step_exit=1)
    job = _job(folder, monkeypatch, "FAILED")
    with pytest.raises(utils.FailedJobError, match="task 0 raised ValueError: boom; stopped by crash"):
        job.result()
    assert str(job.exception()).splitlines()[0].endswith("policy: no requeue: no stop record, srun exit 1; "
                                                          "failures are not requeued")


def test_an_unpicklable_return_value_is_an_error_not_a_crash(job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, out = job_env / "logs", job_env / "out"
    _submit(folder, executor_helpers.returns_a_lock)
    assert _tasks(folder, monkeypatch, n=1) == [1]
    _decide(out, 0, "crash", False, "no stop record, srun exit 1; failures are not requeued")
    assert _finish(folder, out, srun_exit=1, after_step_exit=1, tasks=1) == 1
    outcome = _results(folder, tasks=1)[0]
    assert outcome is not None and "task 0 raised the return value cannot be pickled (TypeError" in str(outcome[1])


def test_sys_exit_in_the_function_is_the_tasks_status(job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = job_env / "logs"
    _submit(folder, executor_helpers.exits, 3)
    assert _tasks(folder, monkeypatch, n=1) == [3]
    _submit(folder, executor_helpers.exits, 0)
    assert _tasks(folder, monkeypatch, n=1) == [0]


def test_a_function_whose_module_is_missing_on_the_node_fails_in_one_line(
        job_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib
    import sys

    folder, out = job_env / "logs", job_env / "out"
    module_dir = job_env / "mods"
    module_dir.mkdir()
    (module_dir / "only_here.py").write_text("def train():\n    return 1\n")
    monkeypatch.syspath_prepend(str(module_dir))
    _submit(folder, importlib.import_module("only_here").train)
    (module_dir / "only_here.py").unlink()
    del sys.modules["only_here"]
    assert _tasks(folder, monkeypatch, n=1) == [runner.EXIT_BAD_SUBMISSION]
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "No module named 'only_here'" in said[0] and "HINT: the function's module" in said[0]
    _decide(out, 0, "crash", False, "no stop record, srun exit 2; failures are not requeued")
    _finish(folder, out, srun_exit=2, after_step_exit=2, tasks=1)
    outcome = _results(folder, tasks=1)[0]
    assert outcome is not None and outcome[0] == "error" and "No module named 'only_here'" in str(outcome[1])


def test_a_new_job_with_the_id_of_an_ended_one_is_not_done(job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """slurmctld reuses job ids after its state is reset: the executor forgets what the watcher knew of the id it
    was just given. Before, a real job 77 submitted after a test's fake job 77 ended was done() at once."""
    folder = job_env / "logs"
    assert _job(folder, monkeypatch, "COMPLETED").done(force_check=True)
    monkeypatch.setattr(slurm, "runner", Gateway("PENDING"))
    JitJob.watcher.forget(JOB)
    assert not JitJob(folder=folder, job_id=JOB, tasks=[0, 1]).done()


def _write_error_log(path: Path, code: str) -> None:
    """A task's error log as srun writes it: a real Python process's stderr."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as err:
        subprocess.run([sys.executable, "-c", code], stderr=err, check=False, timeout=60)


def test_a_job_without_a_result_quotes_the_tail_of_its_error_log(
        job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As submitit's UncompletedJobError: "Error stream produced:" and the task's error log (its last lines: the log
    grows with every requeue). Before: only a pointer to the output log, where the error is not."""
    monkeypatch.setattr(JitJob, "_results_timeout_s", 0)
    job = _job(job_env / "logs", monkeypatch, "FAILED")
    paths = job.task(0).paths
    _write_error_log(paths.stderr, "import sys\nfor i in range(100): print('noise line', i, file=sys.stderr)\n"
                                   "bytearray(2**62)")
    paths.stdout.write_text("slurm-jit: job 77 restart 0 on node1\n")
    lines = str(job.exception()).splitlines()
    assert lines[0] == (f"job {JOB} ended FAILED without a result (killed before its last line ran?). HINT: see its "
                        f"error log {paths.stderr}")
    assert lines[1:3] == ["Error stream produced:", "-" * 40]
    assert lines[-1] == "MemoryError" and "noise line 99" in lines and "noise line 0" not in lines
    assert len(lines) == 3 + job_module.LOG_TAIL_LINES
    with pytest.raises(utils.UncompletedJobError, match="(?s)Error stream produced:.*MemoryError"):
        job.result()


def test_a_job_without_a_result_or_an_error_log_quotes_its_output_log(
        job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(JitJob, "_results_timeout_s", 0)
    job = _job(job_env / "logs", monkeypatch, "NODE_FAIL")
    paths = job.task(0).paths
    paths.folder.mkdir(parents=True)
    paths.stdout.write_text("slurm-jit: job 77 restart 0 on node1\n")
    paths.stderr.write_text("")
    assert str(job.exception()).splitlines()[1:] == [f"No error stream produced. Look at stdout: {paths.stdout}",
                                                     "-" * 40, "slurm-jit: job 77 restart 0 on node1"]


def test_a_job_slurm_forgot_without_a_result_is_done_and_says_purged(
        job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit reads UNKNOWN and waits on (its sacct keeps jobs); scontrol and squeue forget a job MinJobAge after
    its end, so a wait would never end: the job is done, its state PURGED, its error says why."""
    monkeypatch.setattr(JitJob, "_results_timeout_s", 0)
    job = _job(job_env / "logs", monkeypatch, "gone")
    _write_error_log(job.task(0).paths.stderr, "raise MemoryError")
    assert job.done() and job.state == job_module.PURGED == "PURGED"
    lines = str(job.exception()).splitlines()
    assert lines[0] == (f"job {JOB} ended and left no result, and Slurm no longer knows it (MinJobAge after its end, "
                        f"or slurmctld's state was reset). HINT: see its error log {job.task(0).paths.stderr}")
    assert lines[1] == "Error stream produced:" and lines[-1] == "MemoryError"


@pytest.mark.timeout(30)
def test_a_fifo_in_place_of_a_log_is_never_waited_on(job_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A FIFO (or device) where the task's logs should be: the error says there is no stream, at once; opening it
    would block exception() and result() until a writer came."""
    monkeypatch.setattr(JitJob, "_results_timeout_s", 0)
    job = _job(job_env / "logs", monkeypatch, "FAILED")
    paths = job.task(0).paths
    paths.folder.mkdir(parents=True)
    os.mkfifo(paths.stderr)
    os.mkfifo(paths.stdout)
    assert str(job.exception()).splitlines()[1:] == [f"No output/error stream produced ! Check: {paths.stdout}"]
