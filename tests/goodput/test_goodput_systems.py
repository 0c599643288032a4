"""Each system as a careful user sets it up: (a)'s USR1 trap that requeues, (b)'s TERM to the ranks and its
requeue after srun, (c)'s launcher options; the same training, lead and ranks for all three."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from slurm_jit.goodput import systems
from slurm_jit.goodput.schedule import make_schedule

SCHEDULE = make_schedule(1)


def paths(tmp_path: Path) -> systems.Paths:
    return systems.Paths.under(tmp_path, "x", reference=False)


def test_a_traps_the_warning_in_the_batch_shell_and_requeues(tmp_path: Path) -> None:
    script = systems.batch_script("a", SCHEDULE, paths(tmp_path), 3, python="/py")
    assert "#SBATCH --signal=B:USR1@30" in script and "#SBATCH --time=3" in script
    assert "trap '" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script and "' USR1" in script
    assert "&\nwait" in script  # srun in the background: bash runs a trap only between commands
    assert "--trainer plain" in script and "--upstream-jit" not in script and "--save-steps 100" in script


def test_b_signals_the_ranks_and_requeues_when_srun_ends_before_the_training(tmp_path: Path) -> None:
    p = paths(tmp_path)
    script = systems.batch_script("b", SCHEDULE, p, 3, python="/py")
    assert "#SBATCH --signal=TERM@30" in script and "trap" not in script
    assert "--trainer plain --upstream-jit" in script
    assert f"if [ ! -f {p.out / 'final-state.json'} ]; then" in script and "scontrol requeue" in script


@pytest.mark.parametrize("key", ["a", "b"])
def test_the_scripts_are_valid_bash(tmp_path: Path, key: str) -> None:
    script = tmp_path / "job.sh"
    script.write_text(systems.batch_script(key, SCHEDULE, paths(tmp_path), 3))
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0


def test_c_goes_through_the_launcher_with_retries_and_sized_watchdog(tmp_path: Path) -> None:
    argv = systems.submit_argv(SCHEDULE, paths(tmp_path), 3, python="/py")
    assert argv[1].endswith("launch/submit.py")
    for pair in (["--time", "3"], ["--signal-lead", "30"], ["--retry-on-failure", "5"], ["--retry-on-hang", "5"]):
        assert " ".join(pair) in " ".join(argv)
    training = argv[argv.index("--") + 1:]
    assert training[:4] == ["/py", "-u", "-m", "slurm_jit.goodput.train"]
    assert "--async-periodic-saves" in training and "--resume" in training
    assert training[training.index("--save-steps") + 1] == "10"  # K / 10
    assert training[training.index("--hang-timeout") + 1] == "20"


def test_every_system_trains_the_same_steps_on_the_same_ranks(tmp_path: Path) -> None:
    for key in "abc":
        argv = systems.training_argv(key, SCHEDULE, paths(tmp_path))
        assert argv[argv.index("--max-steps") + 1] == str(SCHEDULE.work_steps)
        assert argv[argv.index("--step-sleep") + 1] == "0.1"
    assert f"#SBATCH --ntasks={SCHEDULE.world_size}" in systems.batch_script("a", SCHEDULE, paths(tmp_path), 3)
    assert systems.submit_argv(SCHEDULE, paths(tmp_path), 3)[7] == str(SCHEDULE.world_size)


def test_an_unknown_system_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(systems.SubmitError, match="HINT: one of a, b, c"):
        systems.training_argv("d", SCHEDULE, paths(tmp_path))
    with pytest.raises(systems.SubmitError, match="launch/submit.py"):
        systems.batch_script("c", SCHEDULE, paths(tmp_path), 3)


def test_the_reference_has_no_faults_file_and_the_chain_has_the_schedules(tmp_path: Path) -> None:
    ref, chain = systems.Paths.under(tmp_path, "c", True), systems.Paths.under(tmp_path, "c", False)
    systems.prepare(ref, SCHEDULE, reference=True)
    systems.prepare(chain, SCHEDULE, reference=False)
    assert not (ref.events / "faults.json").exists()
    assert (chain.events / "faults.json").read_text() == json.dumps(SCHEDULE.faults())
