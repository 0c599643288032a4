"""What ``python launch/submit.py`` hands sbatch: extra arguments read as sbatch's getopt_long reads them (owned
options refused however spelled), the exact sbatch argv in the dry run, output directories sbatch's ``--output``
pattern or the job's records cannot carry, and an sbatch that does not answer."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import plan_text
import pytest

from slurm_jit.launch import sbatch_options

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--python", "python", "--time", "30", "--signal-lead", "300"]
CMD = ["--", "python", "train.py"]


def dry_run(out: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "launch" / "submit.py"), "--dry-run", "--output-dir",
                           str(out), *BASE, *args, *CMD], capture_output=True, text=True, check=False, timeout=60)


def submission(out: Path) -> str:
    """The script's path in the sbatch argv: JitExecutor's, in the log folder, one name per output directory."""
    from slurm_jit.launch import output_claim

    return f"{out}/slurm-jit/logs/{output_claim.submission_name(out)}"


def sbatch_line(stderr: str) -> list[str]:
    return shlex.split(plan_text.value(stderr, "sbatch:"))


@pytest.mark.parametrize(("extra", "owned"), [
    (["--sig=B:USR1@600"], "--signal"),  # getopt_long takes a unique prefix for the option
    (["--no-requ"], "--no-requeue"),
    (["--open=truncate"], "--open-mode"),
    (["--out=/dev/null"], "--output"),
    (["--err=/dev/null"], "--error"),
    (["-vt1"], "--time"),  # a cluster of short options: -v -t 1
    (["-Qo/dev/null"], "--output"),
    (["-W"], "--wait"),
    (["--array=0-3"], "--array"),
    (["--tasks-per-node=8"], "--tasks-per-node"),  # sbatch's hidden alias of --ntasks-per-node
    (["--tasks=8"], "--tasks-per-node"),
    (["--wait"], "--wait"),
    (["--requeue"], "--requeue"),
    (["--test-only"], "--test-only"),
    (["-t", "5"], "--time"),  # the value in the next argument
    (["--comment", "--sig=USR1@5"], "--signal"),  # a value that looks like an owned option: refused all the same
])
def test_an_owned_sbatch_option_is_refused_however_it_is_spelled(tmp_path: Path, extra: list[str],
                                                                  owned: str) -> None:
    proc = dry_run(tmp_path / "out", *(f"--sbatch-arg={arg}" for arg in extra))
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert f"sets {owned}, which submit.py writes itself" in proc.stderr and "HINT" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("extra", "message"), [
    (["train.py"], "is not an sbatch option: sbatch would take it for the batch script"),
    (["--"], "is not an sbatch option"),
    (["--comment"], "--sbatch-arg=--comment needs a value"),  # it would swallow the script's path
    (["-C"], "--sbatch-arg=-C needs a value"),
    # sbatch refuses an ambiguous prefix; so do we when it could be an owned option, saying why
    (["--no"], "--sbatch-arg=--no is an ambiguous prefix of --no-kill, --no-requeue, --nodefile, --nodelist, "
               "--nodes: it could set --no-requeue"),
])
def test_an_extra_argument_sbatch_would_take_for_the_script_is_refused(tmp_path: Path, extra: list[str],
                                                                        message: str) -> None:
    proc = dry_run(tmp_path / "out", *(f"--sbatch-arg={arg}" for arg in extra))
    assert proc.returncode == 2 and message in proc.stderr and "HINT" in proc.stderr, proc


@pytest.mark.parametrize("extra", [
    ["--exclusive"], ["--gpus=2"], ["--mem-per-cpu=1G"], ["--time-min=5"], ["--wait-all-nodes=1"], ["--nice"],
    ["-C", "a100"], ["--constraint", "a100"], ["-vv"], ["-H"], ["--comment=--signal is mine"],
])
def test_options_the_launcher_does_not_own_pass_in_the_exact_sbatch_argv(tmp_path: Path,
                                                                         extra: list[str]) -> None:
    out = tmp_path / "out"
    proc = dry_run(out, *(f"--sbatch-arg={arg}" for arg in extra))
    assert proc.returncode == 0, proc.stderr
    assert sbatch_line(proc.stderr) == ["sbatch", "--parsable", "--hold", "--job-name=slurm-jit", *extra,
                                        submission(out)]


def test_the_dry_run_shows_the_exact_sbatch_argv_job_name_and_log_included(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = dry_run(out, "--job-name", "gpt; $(x) 'q'", "--sbatch-arg=--exclusive")
    assert proc.returncode == 0, proc.stderr
    assert sbatch_line(proc.stderr) == ["sbatch", "--parsable", "--hold", "--job-name=gpt; $(x) 'q'",
                                        "--exclusive", submission(out)]
    assert "#SBATCH --output=" in proc.stdout and "--job-name" not in proc.stdout  # the log: in the script


def test_a_percent_in_the_output_dir_reaches_sbatch_escaped(tmp_path: Path) -> None:
    """sbatch expands %j, %x, %u ... in --output: the log of OUT=run-50%x would land in run-50<job name>."""
    out = tmp_path / "run-50%x %u"
    proc = dry_run(out)
    assert proc.returncode == 0, proc.stderr
    assert f"#SBATCH --output='{tmp_path}/run-50%%x %%u/slurm-jit/logs/%j_0_log.out'" in proc.stdout
    assert f"--output '{tmp_path}/run-50%%x %%u/slurm-jit/logs/%j_%t_log.out'" in proc.stdout  # srun's
    assert f"OUT_DIR={shlex.quote(str(out))}" in proc.stdout  # the shell gets it unescaped


@pytest.mark.parametrize("tag", ["%j", "%t", "%A", "%a"])
def test_a_submitit_tag_in_the_output_dir_is_refused(tmp_path: Path, tag: str) -> None:
    """The log folder (OUT_DIR/slurm-jit/logs) is submitit's pattern: %j and %t in it are the job id and task,
    so the logs of OUT=run%j would land in run<id> (and %A/%a are array tags)."""
    proc = dry_run(tmp_path / f"run-50{tag}")
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert "holds %j, %t, %A or %a" in proc.stderr and "HINT" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("name", ["back\\slash", "new\nline", "tab\there", "esc\x1b[31m", "cr\r", "nul\x7f",
                                  "sep\u2028x"])
def test_an_output_dir_with_a_backslash_or_a_control_character_is_refused_at_submit(tmp_path: Path,
                                                                                   name: str) -> None:
    """A backslash turns off every replacement in sbatch's --output (slurm-%j.out, literally); a line break made
    ``status JOBID`` raise on the job's OUT_DIR= line."""
    proc = dry_run(tmp_path / name)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert "--output-dir" in proc.stderr and "HINT" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("name", ["two\nlines", "bell\a"])
def test_a_job_name_with_a_control_character_is_refused(tmp_path: Path, name: str) -> None:
    """``scontrol show job`` prints the name unescaped: a line break could forge the JobState line."""
    proc = dry_run(tmp_path / "out", "--job-name", name)
    assert proc.returncode == 2 and "--job-name" in proc.stderr and "HINT" in proc.stderr, proc


def test_an_sbatch_that_does_not_answer_may_have_queued_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The gateway's timeout (60 s, faked at its one boundary): slurmctld may have queued the job all the same."""
    from slurm_jit import slurm
    from slurm_jit.launch import submit

    def runner(argv: list[str], timeout_s: float) -> str:
        if argv[0] == "sbatch":
            raise slurm.SlurmError(f"{' '.join(argv)} did not answer within {timeout_s:.0f} s")
        raise slurm.SlurmError(f"{' '.join(argv)} failed (exit 1): Invalid job id specified")

    monkeypatch.setattr(slurm, "runner", runner)
    with pytest.raises(SystemExit) as exited:
        submit.submit_main(["--output-dir", str(tmp_path / "out"), *BASE, "--job-name", "gpt", *CMD])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "did not answer within 60 s" in err, err
    assert "the job may have been queued" in err and "squeue --me --name=gpt" in err and "is Slurm up" not in err


def test_the_long_option_table_tells_exact_names_from_prefixes() -> None:
    assert sbatch_options.long_option("gpus") == ("gpus", ["gpus"])  # exact, though a prefix of --gpus-per-node
    assert sbatch_options.long_option("sig") == ("signal", ["signal"])
    assert sbatch_options.long_option("mem-per")[0] is None  # ambiguous: --mem-per-cpu, --mem-per-gpu


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_the_long_option_table_holds_every_option_this_sbatch_knows() -> None:
    """sbatch lists the candidates of an ambiguous prefix: every one of them must be in the table, or a prefix
    could reach an owned option the table does not know of (as --tasks-per-node, a hidden alias, did)."""
    import string

    from slurm_jit import slurm

    known: set[str] = set()
    assert slurm.available()
    for letter in string.ascii_lowercase:
        proc = subprocess.run(["sbatch", "--test-only", f"--{letter}", "--wrap=true"], capture_output=True,
                              text=True, check=False, timeout=60)
        if "possibilities:" in proc.stderr:
            known.update(w.strip("'-") for w in proc.stderr.split("possibilities:")[1].split()[:200]
                         if w.startswith("'--"))
    assert len(known) > 50
    assert sorted(known - set(sbatch_options.LONG_OPTIONS)) == []


@pytest.mark.parametrize(("name", "owned"), [("SBATCH_NO_REQUEUE", "--no-requeue"), ("SBATCH_SIGNAL", "--signal"),
                                             ("SBATCH_TIMELIMIT", "--time"), ("SBATCH_OPEN_MODE", "--open-mode")])
def test_an_sbatch_variable_that_would_override_the_scripts_options_is_refused(tmp_path: Path, name: str,
                                                                               owned: str) -> None:
    """sbatch takes SBATCH_* input variables over #SBATCH lines (checked on 22.05: SBATCH_NO_REQUEUE=1 made a
    script with #SBATCH --requeue a job with Requeue=0, SBATCH_TIMELIMIT=2 one with a 2-minute limit)."""
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "submit.py"), "--dry-run", "--output-dir",
                           str(tmp_path / "out"), *BASE, *CMD], capture_output=True, text=True, check=False,
                          timeout=60, env={**os.environ, name: "1"})
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert f"{name} ({owned}) set in the environment" in proc.stderr and f"HINT: unset {name}" in proc.stderr


def test_a_recorded_job_id_now_given_to_another_job_does_not_hold_the_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """slurmctld's state reset (job ids start over): job 5 now runs someone else's script."""
    from slurm_jit import slurm
    from slurm_jit.launch import output_claim

    out = tmp_path / "run a"
    output_claim.job_script_path(out, "5").parent.mkdir(parents=True)
    output_claim.job_script_path(out, "5").write_text("#!/bin/bash\n")
    command = {"path": "/home/someone else/job.sh"}

    def runner(argv: list[str], timeout_s: float) -> str:
        return f"JobId=5 JobName=a\n   JobState=RUNNING Reason=None\n   Command={command['path']}\n"

    monkeypatch.setattr(slurm, "runner", runner)
    output_claim.check_free(out)
    command["path"] = f"{out}/slurm-jit/submit.sbatch"
    with pytest.raises(ValueError, match=r"is in use by job 5 \(RUNNING\).*HINT"):
        output_claim.check_free(out)


def test_a_live_job_holds_its_directory_under_every_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same directory through a symbolic link: the job's Command names the other path."""
    from slurm_jit import slurm
    from slurm_jit.launch import output_claim

    real, alias = tmp_path / "real", tmp_path / "alias"
    output_claim.job_script_path(real, "7").parent.mkdir(parents=True)
    output_claim.job_script_path(real, "7").write_text("#!/bin/bash\n")
    alias.symlink_to(real)

    def runner(argv: list[str], timeout_s: float) -> str:
        return f"JobId=7 JobName=a\n   JobState=PENDING Reason=None\n   Command={real}/slurm-jit/submit.sbatch\n"

    monkeypatch.setattr(slurm, "runner", runner)
    with pytest.raises(ValueError, match=r"is in use by job 7 \(PENDING\)"):
        output_claim.check_free(alias)
