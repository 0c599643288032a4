"""Each system as a careful user sets it up: (a)'s USR1 trap that requeues, (b)'s TERM to the ranks and its
requeue after srun, (c)'s launcher options; the same training, lead and ranks for all three."""

from __future__ import annotations

import json
import subprocess
import sys
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
    assert "if ! /py -c " in script and str(p.out / "final-state.json") in script and "scontrol requeue" in script


@pytest.mark.parametrize(("state", "requeued"), [(None, True), ({"global_step": 1035}, True),
                                                 ({"global_step": SCHEDULE.work_steps}, False), ("not json", True),
                                                 ({"global_step": float(SCHEDULE.work_steps)}, True)])
def test_b_requeues_unless_the_training_reached_its_last_step(tmp_path: Path, state: object, requeued: bool) -> None:
    """Upstream's JIT stop returns from train(), so demo_train writes final-state.json then too (the full run's (b)
    was taken as finished at step 1035): the script reads the step. srun and scontrol stand in as scripts here."""
    p = paths(tmp_path)
    p.out.mkdir(parents=True)
    if state is not None:
        (p.out / "final-state.json").write_text(state if isinstance(state, str) else json.dumps(state))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", "exit 0"), ("scontrol", f'echo "$@" > {tmp_path / "scontrol.args"}')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(systems.batch_script("b", SCHEDULE, p, 3, python=sys.executable))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "77"}
    assert subprocess.run(["bash", str(script)], env=env, capture_output=True, check=False).returncode == 0
    called = (tmp_path / "scontrol.args").read_text().split() if (tmp_path / "scontrol.args").exists() else []
    assert called == (["requeue", "77"] if requeued else []), called


def test_finished_means_the_last_step_was_reached(tmp_path: Path) -> None:
    p = paths(tmp_path)
    assert not systems.finished(p, 1800)
    p.out.mkdir(parents=True)
    for state, done in (({"global_step": 1035}, False), ({"global_step": 1800}, True), ({"step": 1800}, False),
                        ([1800], False), ({"global_step": 1800.0}, False), ({"global_step": True}, False)):
        (p.out / "final-state.json").write_text(json.dumps(state))
        assert systems.finished(p, 1800) is done, state  # as the (b) script's test (the parametrized one above)
    (p.out / "final-state.json").write_text('{"global_step": 18')  # being written: not finished, no error
    assert not systems.finished(p, 1800) and systems.final_state(p, 1800) is None


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


def test_the_step_a_next_run_resumes_after(tmp_path: Path) -> None:
    """(a), (b): the highest checkpoint-N, complete or not (get_last_checkpoint); (c): the newest ckpt-check calls
    complete (none here: a bare directory is not one), so a fresh start."""
    p = paths(tmp_path)
    assert systems.resume_step("a", p) == 0  # no output directory yet
    for name in ("checkpoint-100", "checkpoint-1200", "checkpoint-x", "other-5000"):
        (p.out / name).mkdir(parents=True)
    (p.out / "checkpoint-9999").write_text("a file, not a checkpoint")
    assert systems.resume_step("a", p) == systems.resume_step("b", p) == 1200
    assert systems.resume_step("c", p) == 0
