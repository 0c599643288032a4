"""``python launch/submit.py`` as a thin CLI over JitExecutor: the sbatch argv a dry run prints is the one a
submit runs, ``--setup`` lines, a dry run that writes nothing and needs no Slurm, the logs ``status`` names, and
the function entry. The Slurm gateway is faked at its one boundary (tests/test_launch_slurm.py: the real one)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import fake_slurm
import plan_text
import pytest

from slurm_jit import slurm
from slurm_jit.launch import output_claim, status, submit, task

ROOT = Path(__file__).resolve().parents[2]
SUBMIT = ROOT / "launch" / "submit.py"
BASE = ["--python", "python", "--time", "30", "--signal-lead", "300"]
CMD = ["--", "python", "train.py", "--lr", "3e-4"]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SUBMIT), *args], capture_output=True, text=True, check=False,
                          timeout=60, env=env)


def plan_argv(stderr_or_stdout: str) -> list[str]:
    """The sbatch command the plan printed, its lines joined as a shell joins ``\\`` continuations."""
    return shlex.split(plan_text.value(stderr_or_stdout, "sbatch:"))


Gateway = fake_slurm.SubmitGateway


def test_a_submit_runs_exactly_the_sbatch_argv_its_dry_run_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out dir"
    options = ["--output-dir", str(out), *BASE, "--job-name", "gpt; $(x)", "--sbatch-arg=--exclusive",
               "--setup", "module load cuda", *CMD]
    dry = cli("--dry-run", *options)
    assert dry.returncode == 0, dry.stderr
    gateway = Gateway()
    monkeypatch.setattr(slurm, "runner", gateway)
    with pytest.raises(SystemExit) as exited:
        submit.main(options)
    printed = capsys.readouterr().out
    assert exited.value.code == 0, printed
    assert gateway.calls[0] == plan_argv(dry.stderr) == plan_argv(printed)
    assert gateway.calls[1] == ["scontrol", "release", "4242"]
    kept = output_claim.job_script_path(out, "4242")
    assert kept.read_text() == dry.stdout  # the script sbatch got is the one the dry run printed
    logs = out / "slurm-jit" / "logs"
    assert f"submitted job 4242; log {logs}/4242_0_log.out\n" in printed  # this tmp_path fits one line
    assert f"\n  status:   python launch/submit.py status '{out}'\n" in printed
    assert os.readlink(out / "slurm-4242.out") == "slurm-jit/logs/4242_0_log.out"  # the old path, as a link
    assert (logs / "4242_submitted.pkl").is_file()


def test_a_second_submit_after_the_first_job_ended_leaves_the_first_ones_files_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The script's path is one per output directory; after a submit it is submitit's link to the job's
    ``<id>_submission.sh``: the next submit wrote its script through it, into the first job's file."""
    out, ids = tmp_path / "out", iter(["4242", "4343"])

    def gateway(argv: Sequence[str], timeout_s: float) -> str:
        if argv[0] == "sbatch":
            return next(ids) + "\n"
        if argv[:3] == ["scontrol", "show", "job"]:
            return f"JobId={argv[3]} JobName=x\n   JobState=COMPLETED Reason=None\n"
        return ""

    monkeypatch.setattr(slurm, "runner", gateway)
    for command, requeues in (("first.py", "1"), ("second.py", "2")):  # two different scripts
        with pytest.raises(SystemExit) as exited:
            submit.main(["--output-dir", str(out), *BASE, "--max-requeues", requeues, "--", "python", command])
        assert exited.value.code == 0, capsys.readouterr()
    logs = out / "slurm-jit" / "logs"
    first, second = (logs / "4242_submission.sh").read_text(), (logs / "4343_submission.sh").read_text()
    assert first == output_claim.job_script_path(out, "4242").read_text()
    assert second == output_claim.job_script_path(out, "4343").read_text()
    assert "--max-requeues 1 " in first and "--max-requeues 2 " in second
    assert not (logs / "4242_submission.sh").is_symlink() and not (logs / "4343_submission.sh").is_symlink()
    import submitit

    commands = [submitit.SlurmJob(logs, job_id).submission().function.argv for job_id in ("4242", "4343")]
    assert commands == [("python", "first.py"), ("python", "second.py")]


def test_setup_lines_run_in_order_after_the_parameters_and_before_the_gate(tmp_path: Path) -> None:
    proc = cli("--dry-run", "--output-dir", str(tmp_path / "out"), *BASE, "--setup", "module load cuda",
               "--setup", "source 'my env'/bin/activate", *CMD)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    first, second = lines.index("module load cuda"), lines.index("source 'my env'/bin/activate")
    gate = next(i for i, line in enumerate(lines) if "-m slurm_jit.launch.gate" in line)
    last_directive = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert last_directive < first < second < gate


def test_setup_lines_from_the_config_come_before_the_command_lines(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text('setup = ["module load a"]\n')
    proc = cli("--dry-run", "--config", str(config), "--output-dir", str(tmp_path / "out"), *BASE,
               "--setup", "module load b", *CMD)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines.index("module load a") < lines.index("module load b")


@pytest.mark.parametrize(("line", "message"), [
    ("", "is empty or holds a line break"),
    ("   ", "is empty or holds a line break"),
    ("module load cuda\n#SBATCH --no-requeue", "is empty or holds a line break"),
    ("echo a\rb", "is empty or holds a line break"),
    ("#SBATCH --no-requeue", "is an #SBATCH directive"),  # sbatch reads directives up to the first command
    ("  #sbatch --signal=B:USR1@5", "is an #SBATCH directive"),
])
def test_a_setup_line_the_script_cannot_carry_is_refused_in_one_line(tmp_path: Path, line: str,
                                                                     message: str) -> None:
    proc = cli("--dry-run", "--output-dir", str(tmp_path / "out"), *BASE, "--setup", line, *CMD)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert message in proc.stderr and "HINT" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_a_dry_run_with_every_option_writes_nothing_and_needs_no_slurm(tmp_path: Path) -> None:
    out = tmp_path / "out"
    bare = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no sbatch, srun or scontrol on it
    proc = cli("--dry-run", "--output-dir", str(out), "--python", sys.executable, "--time", "1-00:00:00",
               "--nodes", "2", "--ntasks-per-node", "4", "--cpus-per-task", "8", "--mem", "64G",
               "--gpus-per-node", "4", "--partition", "gpu", "--account", "proj-1", "--qos", "high",
               "--job-name", "j k", "--sbatch-arg=--exclusive", "--max-requeues", "2", "--retry-on-failure", "1",
               "--quarantine", "--step-time", "30s", "--save-time", "1m", "--eval-time", "10s", "--kill-wait",
               "30", "--margin", "5", "--setup", "module load cuda", "--function", "slurm_jit.demo_train:main",
               "--", "--max-steps", "2", env=bare)
    assert proc.returncode == 0, proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
    script = proc.stdout
    for directive in ("--nodes=2", "--ntasks-per-node=4", "--cpus-per-task=8", "--mem=64G", "--gpus-per-node=4",
                      "--partition=gpu", "--account=proj-1", "--qos=high", "--time=1-00:00:00", "--requeue"):
        assert f"#SBATCH {directive}" in script.splitlines(), directive
    assert "--max-requeues 2 --retry-on-failure 1 --quarantine" in script and "--world-size 8 --quarantine" in script
    argv = plan_argv(proc.stderr)
    assert argv[:5] == ["sbatch", "--parsable", "--hold", "--job-name=j k", "--exclusive"]
    assert "training: slurm_jit.demo_train:main(--max-steps 2)" in proc.stderr


def test_status_names_every_tasks_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run 50%x"
    proc = cli("--dry-run", "--output-dir", str(out), *BASE, "--ntasks-per-node", "2", *CMD)
    assert proc.returncode == 0, proc.stderr
    output_claim.job_script_path(out, "77").parent.mkdir(parents=True)
    output_claim.job_script_path(out, "77").write_text(proc.stdout)  # as a submit keeps it
    monkeypatch.setattr(slurm, "runner", Gateway())
    lines = status.report(str(out), None)
    logs = out / "slurm-jit" / "logs"
    assert f"logs:     task 0: {logs}/77_0_log.out (with the batch script's lines)" in lines
    assert f"          task 1: {logs}/77_1_log.out" in lines
    assert lines[1].startswith("job:      77 RUNNING")


def test_status_lists_the_first_logs_of_a_wide_job_and_the_pattern() -> None:
    script = ("srun --unbuffered --output /l/%j_%t_log.out --error /l/%j_%t_log.err x\n"
              "exec python -m slurm_jit.launch.runner finish /l \"$OUT_DIR\" --tasks 512 --srun-exit 0\n")
    paths = status.task_logs(script, "9")
    assert paths[0] == "task 0: /l/9_0_log.out, /l/9_0_log.err (with the batch script's lines)"
    assert len(paths) == status.MAX_LOG_LINES + 1 and paths[-1] == "... 512 tasks: /l/9_%t_log.out"
    assert status.task_logs("#!/bin/bash\nsrun python train.py\n", "9") == []  # a raw sbatch script: none


def test_the_function_entry_sets_argv_and_a_nonzero_int_is_the_exit_status(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    module = tmp_path / "entry_mod_for_cli.py"
    module.write_text("import sys\ndef main():\n    return sys.argv[1:]\ndef fails():\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert task.call_function("entry_mod_for_cli:main", ["--lr", "3e-4"]) == ["--lr", "3e-4"]
    with pytest.raises(SystemExit) as exited:
        task.call_function("entry_mod_for_cli:fails", [])
    assert exited.value.code == 3


def test_status_of_a_stop_without_a_step_does_not_print_step_none(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_jit.launch import progress

    progress.write(tmp_path, {"job_id": "142", "last_step": None, "history": [
        {"job_id": "142", "restart": 0, "cause": "finished", "step": None, "requeue": False,
         "reason": "every task exited 0 and wrote no stop record (no JitTrainer in it): done",
         "outcome": "not requeued"}]})
    monkeypatch.setattr(slurm, "runner", Gateway())
    (line,) = [line for line in status.report(str(tmp_path), None) if line.startswith("stopped:")]
    assert line == ("stopped:  finished (restart 0), not requeued: every task exited 0 and wrote no stop record "
                    "(no JitTrainer in it): done")


@pytest.mark.parametrize(("command", "in_use"), [
    ("{logs}/{name}", True),  # submitted by JitExecutor or this CLI, whatever its log folder
    ("/elsewhere/logs/{name}", True),
    ("{out}/slurm-jit/submit.sbatch", True),  # submitted by submit.py before it ran on JitExecutor
    ("/home/someone/else.sh", False),  # slurmctld reused the id (its state reset) for another job
])
def test_one_claim_sees_jobs_of_the_executor_and_of_the_older_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   command: str, in_use: bool) -> None:
    out = tmp_path / "out"
    output_claim.job_script_path(out, "5").parent.mkdir(parents=True)
    output_claim.job_script_path(out, "5").write_text("#!/bin/bash\n")
    path = command.format(logs=out / "slurm-jit" / "logs", name=output_claim.submission_name(out), out=out)
    monkeypatch.setattr(slurm, "runner", lambda argv, timeout_s: (
        f"JobId=5 JobName=a\n   JobState=RUNNING Reason=None\n   Command={path}\n"))
    assert (output_claim.live_job(out) is not None) == in_use


def test_a_retry_budget_over_max_requeues_is_said_to_be_bounded_by_it(tmp_path: Path) -> None:
    proc = cli("--dry-run", "--output-dir", str(tmp_path / "out"), *BASE, "--retry-on-hang", "1000000000",
               "--max-requeues", "2", *CMD)
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("  requeue:")]
    assert "1000000000 retries" in line and line.endswith("no more than 2 in all"), line
