"""``python launch/submit.py --from OUT_DIR`` sizes the grace from an earlier run's timing log (as grace-calc
--from), and ``--python``: the job's interpreter, default the one running submit.py, shown in the plan, a missing
one, or one that cannot import slurm_jit, refused in one line. Real dry runs of the CLI (they need no Slurm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import slurm_jit
from slurm_jit import timing

ROOT = Path(__file__).resolve().parents[2]
SUBMIT = ROOT / "launch" / "submit.py"
CMD = ["--", "python", "train.py"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SUBMIT), "--dry-run", *args], capture_output=True, text=True,
                          check=False, timeout=60)


def _earlier_run(out: Path) -> None:
    """A timing log as a 2-rank run writes it: 3 s steps, one 7 s save."""
    for rank in (0, 1):
        log = timing.TimingLog(out, rank=rank, world_size=2, run_id="r1")
        for step in range(1, 30):
            log.step(step, 3.0)
        log.save(29, "jit", 7.0, 1000)
        log.close()


def test_from_takes_the_step_and_save_times_of_an_earlier_run(tmp_path: Path) -> None:
    earlier, out = tmp_path / "earlier", tmp_path / "out"
    _earlier_run(earlier)
    proc = cli("--output-dir", str(out), "--ntasks-per-node", "2", "--time", "30", "--from", str(earlier), "--explain",
               *CMD)
    assert proc.returncode == 0, proc.stderr
    assert "\n  grace:    step 3 s + save 7 s + kill_wait 3 s + margin 10 s = 23 s\n" in proc.stderr, proc.stderr
    assert "max of 27 steps over 1 run in the timing log" in " ".join(proc.stderr.split()), proc.stderr  # --explain
    config = tmp_path / "job.toml"
    config.write_text(f'from = "{earlier}"\n')
    by_config = cli("--config", str(config), "--output-dir", str(out), "--ntasks-per-node", "2", "--time", "30", *CMD)
    assert by_config.returncode == 0 and "save 7 s" in by_config.stderr, by_config.stderr


def test_from_a_directory_without_a_timing_log_is_one_line(tmp_path: Path) -> None:
    proc = cli("--output-dir", str(tmp_path / "out"), "--time", "30", "--from", str(tmp_path), *CMD)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert "--from" in line and "no timing log" in line and "HINT:" in line


def test_the_job_runs_this_python_unless_told_and_the_plan_says_which(tmp_path: Path) -> None:
    proc = cli("--output-dir", str(tmp_path / "out"), "--time", "30", "--signal-lead", "60", *CMD)
    assert proc.returncode == 0, proc.stderr
    assert f"  python:   {sys.executable} " in proc.stderr
    assert "srun --unbuffered" in proc.stdout and f"{sys.executable} -u -m slurm_jit.launch.runner" in proc.stdout


def test_a_missing_or_not_executable_python_is_refused_in_one_line(tmp_path: Path) -> None:
    not_executable = tmp_path / "python"
    not_executable.write_text("#!/bin/sh\n")
    for python in (str(tmp_path / "no-such-python"), str(not_executable), "no-such-python-on-path"):
        proc = cli("--output-dir", str(tmp_path / "out"), "--time", "30", "--signal-lead", "60", "--python",
                   python, *CMD)
        assert proc.returncode == 2 and proc.stdout == "", (python, proc.stdout)
        (line,) = proc.stderr.splitlines()
        assert f"--python {python}" in line and "HINT:" in line, line


def test_a_python_that_cannot_import_slurm_jit_is_refused_in_one_line(tmp_path: Path) -> None:
    venv = tmp_path / "other venv"  # another project's venv, a space in its path
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    src = str(Path(slurm_jit.__file__).parents[1])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the job's env: slurm_jit not on a path
    submit = f"import sys; sys.path.insert(0, {src!r}); from slurm_jit.launch.submit import main; main()"
    for python in (str(venv / "bin" / "python"), "/bin/ls"):
        proc = subprocess.run([sys.executable, "-c", submit, "--dry-run", "--output-dir", str(tmp_path / "out"),
                               "--time", "30", "--signal-lead", "60", "--python", python, *CMD],
                              capture_output=True, text=True, check=False, timeout=120, env=env)
        assert proc.returncode == 2 and proc.stdout == "", (python, proc.stdout, proc.stderr)
        (line,) = proc.stderr.splitlines()
        assert f"--python {python}: cannot import slurm_jit" in line and "HINT: pip install" in line, line
