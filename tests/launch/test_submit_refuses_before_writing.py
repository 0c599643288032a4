"""``python launch/submit.py`` refuses what sbatch or every rank would refuse (or what would never get its warning)
before anything is written: exit 2, one line with a HINT, no ``OUT/slurm-jit/``, no sbatch call; a dry run says
the same. The Slurm gateway is faked at its one boundary (a refusal must never reach it)."""

from __future__ import annotations

from pathlib import Path

import fake_slurm
import pytest

from slurm_jit import slurm
from slurm_jit.launch import submit

BASE = ["--time", "30", "--signal-lead", "60"]
CMD = ["--", "python", "train.py"]


Gateway = fake_slurm.SubmitGateway


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    with pytest.raises(SystemExit) as exited:
        submit.main(argv)
    return exited.value.code, capsys.readouterr().err


REFUSED = {
    # no time limit: Slurm never sends the --signal warning (the lead check was skipped; 00 alone was refused)
    "time 0": (["--time", "0", "--signal-lead", "60", *CMD], "--time 0: no time limit"),
    "time UNLIMITED": (["--time", "UNLIMITED", "--signal-lead", "60", *CMD], "--time UNLIMITED: no time limit"),
    "time INFINITE": (["--time", "infinite", "--signal-lead", "60", *CMD], "--time infinite: no time limit"),
    "time 00": (["--time", "00", "--signal-lead", "60", *CMD], "--time 00: no time limit"),
    # sbatch's refusals, once only after OUT/slurm-jit/ and its lock were written
    "cpus 0": ([*BASE, "--cpus-per-task", "0", *CMD], "--cpus-per-task 0: must be a whole number, 1 or more"),
    "gpus -1": ([*BASE, "--gpus-per-node", "-1", *CMD], "--gpus-per-node -1: not sbatch's [type:]count"),
    "mem abc": ([*BASE, "--mem", "abc", *CMD], "--mem abc: not a memory size sbatch reads"),
    "mem 1.5G": ([*BASE, "--mem", "1.5G", *CMD], "--mem 1.5G: not a memory size"),
    # a program every rank would fail to exec (a real submit said so with exit 1, a dry run not at all)
    "missing program": ([*BASE, "--", "./nosuch"], "the training program ./nosuch: no such program"),
    "missing on PATH": ([*BASE, "--", "slurm-jit-no-such-program"], "slurm-jit-no-such-program: not found on PATH"),
    "a file here, no run bit": ([*BASE, "--", "s.py"], "s.py: a file here, but a program without a / is looked up "
                                                         "on PATH"),
    "a path, no run bit": ([*BASE, "--", "./s.py"], "the training program ./s.py is not executable"),
    # what --signal-lead overrides is still read: a typo is refused, not dropped unseen
    "lead with a missing --from": ([*BASE, "--from", "/nonexistent/run", *CMD], "--from /nonexistent/run: no timing"),
    "lead with --margin abc": ([*BASE, "--margin", "abc", *CMD], "--margin: cannot read 'abc'"),
    "lead with --step-time zz": ([*BASE, "--step-time", "zz", *CMD], "--step-time: cannot read 'zz'"),
    "lead with --save-time 0": ([*BASE, "--save-time", "0", *CMD], "--save-time: must be more than 0 s"),
}


@pytest.mark.parametrize("dry_run", [False, True], ids=["submit", "dry-run"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_bad_option_or_program_is_refused_before_anything_is_written(
        case: str, dry_run: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    args, message = REFUSED[case]
    (tmp_path / "s.py").write_text("print('trained')\n")
    (tmp_path / "s.py").chmod(0o644)
    monkeypatch.chdir(tmp_path)
    gateway = Gateway()
    monkeypatch.setattr(slurm, "runner", gateway)
    out = tmp_path / "out"
    code, err = run_main([*(["--dry-run"] if dry_run else []), "--output-dir", str(out), *args], capsys)
    assert code == submit.EXIT_ERROR, err
    (line,) = err.splitlines()
    assert message in line and "HINT: " in line, line
    assert not (out / "slurm-jit").exists() and gateway.calls == []


@pytest.mark.parametrize(("option", "value", "directive"), [
    ("--mem", "64GB", "#SBATCH --mem=64GB"),  # str_to_mbytes takes a B after the unit
    ("--mem", "0", "#SBATCH --mem=0"),  # sbatch(1): all the node's memory
    ("--gpus-per-node", "0", "#SBATCH --gpus-per-node=0"),
    ("--gpus-per-node", "a100:4", "#SBATCH --gpus-per-node=a100:4"),
    ("--cpus-per-task", "1", "#SBATCH --cpus-per-task=1"),
])
def test_the_values_sbatch_takes_are_still_taken(option: str, value: str, directive: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(slurm, "runner", Gateway())
    with pytest.raises(SystemExit) as exited:
        submit.main(["--dry-run", "--output-dir", str(tmp_path / "out"), *BASE, option, value, *CMD])
    captured = capsys.readouterr()
    assert exited.value.code == 0, captured.err
    assert directive in captured.out.splitlines()


def test_the_plan_says_what_an_explicit_signal_lead_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(slurm, "runner", Gateway())
    code, err = run_main(["--dry-run", "--output-dir", str(tmp_path / "out"), *BASE, "--step-time", "2m",
                          "--margin", "10%", *CMD], capsys)
    assert code == 0, err
    (line,) = [line for line in err.splitlines() if line.startswith("  grace:")]
    assert line == ("  grace:    given 60 s (--signal-lead; it overrides --step-time 2m, --margin 10% (not used)) "
                    "= 60 s"), line
