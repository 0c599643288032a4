"""``python launch/submit.py``: --dry-run scripts against golden files (one per documented option), the plan,
the ckpt-check gate, bad input, and arguments that must reach sbatch and the ranks unchanged."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import plan_text
import pytest

from slurm_jit.launch import task
from slurm_jit.train import dist_env

ROOT = Path(__file__).resolve().parents[2]
SPEC_NAME = "launch-spec.json"  # where submit.py wrote the command before issue 17 (shared by every job: unsafe)
GOLDEN = Path(__file__).resolve().parents[1] / "helpers" / "golden"
OUT = "/nonexistent/slurm-jit-golden/out"  # never created: the gate sees a fresh start
BASE = ["--output-dir", OUT, "--python", "python", "--time", "30", "--signal-lead", "300"]
CMD = ["--", "python", "train.py", "--lr", "3e-4"]

CASES = {
    "minimal": [*BASE, *CMD],
    "nodes": [*BASE, "--nodes", "2", "--ntasks-per-node", "4", *CMD],
    "nodes-range": [*BASE, "--nodes", "1-2", "--ntasks-per-node", "4", *CMD],
    "resources": [*BASE, "--cpus-per-task", "8", "--mem", "64G", "--gpus-per-node", "4", *CMD],
    "accounting": [*BASE, "--partition", "gpu", "--account", "proj-1", "--qos", "high", *CMD],
    "time-hms": ["--output-dir", OUT, "--python", "python", "--time", "4:00:00", "--signal-lead", "300", *CMD],
    "time-days": ["--output-dir", OUT, "--python", "python", "-t", "1-12", "--signal-lead", "300", *CMD],
    "requeue": [*BASE, "--max-requeues", "2", "--retry-on-failure", "1", *CMD],
    "quarantine": [*BASE, "--quarantine", *CMD],
    "hang": [*BASE, "--retry-on-hang", "2", "--exclude-hung-node", *CMD],
    "grace-calc": ["--output-dir", OUT, "--python", "python", "--time", "30", "--step-time", "2m",
                   "--save-time", "2m", "--margin", "0", *CMD],
}


def submit(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``submit.py --dry-run ARGS`` (first, so that it cannot end up in the training command after --)."""
    return subprocess.run([sys.executable, str(ROOT / "launch" / "submit.py"), "--dry-run", *args],
                          capture_output=True,
                          text=True, check=False, timeout=60, cwd=cwd)


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_matches_golden(name: str) -> None:
    proc = submit(*CASES[name])
    assert proc.returncode == 0, proc.stderr
    golden = GOLDEN / f"submit-{name}.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(proc.stdout)
    assert proc.stdout == golden.read_text()


def test_config_file_gives_the_same_script_and_the_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(f'output_dir = "{OUT}"\npython = "python"\ntime = "4:00:00"\nsignal-lead = 300\n'
                      'nodes = 2\nntasks_per_node = 4\ncommand = ["python", "train.py", "--lr", "3e-4"]\n')
    proc = submit("--config", str(config), "--time", "30")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (GOLDEN / "submit-nodes.sbatch").read_text()


def test_a_node_range_from_the_config_gives_the_same_script(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text('nodes = "1-2"\nntasks_per_node = 4\n')
    proc = submit("--config", str(config), *BASE, *CMD)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (GOLDEN / "submit-nodes-range.sbatch").read_text()
    assert "plan: 1-2 node(s) x 4 task(s) = 4-8 ranks" in proc.stderr
    assert "  nodes:    --nodes 1-2: each start (the first and every requeue) gets 1 to 2 nodes" in proc.stderr


def test_plan_names_grace_terms_signal_policy_and_resume_point() -> None:
    plan = submit(*CASES["grace-calc"]).stderr
    assert "  grace:    step 120 s + save 120 s + kill_wait 3 s = 243 s\n" in plan
    assert "#SBATCH --signal=TERM@243 (no B:" in plan and "SLURM_JIT_SIGNAL_LEAD_S=243" in plan
    assert "up to 5 times" in plan and "never after scancel" not in plan  # the policy's conditions: --explain's
    assert "resume:   fresh start" in plan
    explained = " ".join(submit("--explain", *CASES["grace-calc"]).stderr.split())  # its lines wrapped
    assert "step 120 s: 1 x 120 s (--step-time)" in explained and "save 120 s: --save-time" in explained
    assert "never after scancel" in explained


@pytest.mark.parametrize(("args", "message"), [
    (["--time", "30", "--signal-lead", "60", "--", "python", "t.py"], "no --output-dir. HINT"),
    (["--output-dir", "o", "--signal-lead", "60", "--", "python", "t.py"], "no --time. HINT"),
    (["--output-dir", "o", "--time", "1", "--signal-lead", "60", "--", "python", "t.py"], "not shorter than"),
    (["--output-dir", "o", "--time", "soon", "--signal-lead", "60", "--", "t"], "cannot read --time=soon"),
    (["--output-dir", "o", "--time", "30", "--signal-lead", "60"], "no training command. HINT"),
    (["--output-dir", "o", "--time", "30", "--", "python", "t.py"], "no step time. HINT"),
    (["--output-dir", "o", "--time", "30", "--signal-lead", "60", "--partition", "a b", "--", "t"], "HINT"),
    (["--output-dir", "o", "--time", "30", "--signal-lead", "60", "--function", "nocolon"], "HINT"),
    (["--config", "/nonexistent.toml"], "cannot read config"),
    (["--bogus"], "HINT"),
    # Hostile input found by attacking the launcher (each accepted, silently changed or a traceback before):
    ([*BASE, "--nodes", "0", *CMD], "--nodes 0: must be a whole number, 1 or more"),  # was taken for 1
    ([*BASE, "--ntasks-per-node", "0", *CMD], "--ntasks-per-node 0: must be"),  # was taken for 1
    ([*BASE, "--nodes", "2-1", *CMD], "--nodes 2-1: MIN 2 is above MAX 1"),
    ([*BASE, "--nodes", "1.5", *CMD], "--nodes 1.5: not a node count or a MIN-MAX range"),
    ([*BASE, "--nodes", "1,2", *CMD], "--nodes 1,2: not a node count or a MIN-MAX range"),
    # sbatch's own options, once taken for this launcher's longer ones (argparse's prefix matching): the job's
    # total --ntasks 3 as 3 per node (3-6 ranks), --gpus 8 as 8 per node, --exclude NODE as --exclude-hung-node
    # (NODE then began the training command: "no --output-dir")
    ([*BASE, "--nodes", "1-2", "--ntasks", "3", *CMD], "unrecognized arguments: --ntasks"),
    ([*BASE, "--nodes", "2", "--gpus", "8", *CMD], "unrecognized arguments: --gpus"),
    ([*BASE, "--exclude", "node3", *CMD], "unrecognized arguments: --exclude"),
    ([*BASE, "--max-requeues", "-1", *CMD], "--max-requeues -1: must be a whole number, 0 or more"),
    ([*BASE, "--retry-on-failure", "-1", *CMD], "--retry-on-failure -1: must be"),
    ([*BASE, "--job-name", "", *CMD], "--job-name is empty"),
    (["--output-dir", OUT, "--time", "30", "--signal-lead", "60", "--python", "", *CMD], "--python is empty"),
    ([*BASE, "--", ""], "the training command's program is empty"),
    ([*BASE, "--function", ":"], "--function ':': not module:function"),
    ([*BASE, "--function", "os:"], "not module:function"),
    ([*BASE, "--function", "slurm_jit_no_such_module:main"], "no module slurm_jit_no_such_module"),
    ([*BASE, "--function", "slurm_jit.demo_train:no_such_function"], "defines no no_such_function"),
    # sbatch's command line wins over #SBATCH lines: these would silently replace what the plan says.
    ([*BASE, "--sbatch-arg=--signal=USR1@5", *CMD], "sets --signal, which submit.py writes itself"),
    ([*BASE, "--sbatch-arg=--time=5", *CMD], "sets --time"),
    ([*BASE, "--sbatch-arg=-t5", *CMD], "sets --time"),
    ([*BASE, "--sbatch-arg=--no-requeue", *CMD], "sets --no-requeue"),
])
def test_bad_input_is_one_line_with_a_hint(args: list[str], message: str, tmp_path: Path) -> None:
    proc = submit(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc
    assert message in proc.stderr and "HINT" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("line", "message"), [
    ('nodes = "two"', "nodes = 'two' is not an integer"),
    ('nodes = "1-2-3"', "nodes = '1-2-3' is not an integer"),
    ("nodes = true", "nodes = True is not an integer"),
    ("output_dir = 5", "output-dir = 5 is not a string"),  # was a TypeError traceback
    ('quarantine = "no"', "quarantine = 'no' is not true or false"),  # was bool("no"): quarantine on
    ('sbatch_arg = "--exclusive"', "sbatch-arg = '--exclusive' is not a list of strings"),  # was split in letters
    ('command = "python train.py"', "is not a list of strings"),
])
def test_config_value_of_the_wrong_type_is_refused(tmp_path: Path, line: str, message: str) -> None:
    config = tmp_path / "job.toml"
    config.write_text(line + "\n")
    proc = submit("--config", str(config), "--time", "30", "--signal-lead", "60", "--output-dir", OUT)
    assert proc.returncode == 2 and message in proc.stderr and "HINT" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_existing_function_entry_passes_the_check() -> None:
    proc = submit(*BASE, "--function", "slurm_jit.demo_train:main", "--", "--max-steps", "2")
    assert proc.returncode == 0, proc.stderr


def test_given_times_are_used_when_an_earlier_submit_left_a_state_folder_without_timing_records(
    tmp_path: Path,
) -> None:
    """A first job that crashed before its first step leaves OUT/slurm-jit/ with the spec and no timing log:
    the resubmit with --step-time/--save-time was refused with 'no timing log'."""
    out = tmp_path / "out"
    (out / "slurm-jit").mkdir(parents=True)
    (out / "slurm-jit" / SPEC_NAME).write_text('{"argv": ["python", "t.py"]}\n')
    proc = submit("--output-dir", str(out), "--time", "30", "--step-time", "2m", "--save-time", "2m", *CMD)
    assert proc.returncode == 0 and "#SBATCH --signal=TERM@" in proc.stdout, proc.stderr


def test_an_output_dir_that_cannot_be_written_is_one_line_before_sbatch(tmp_path: Path) -> None:
    """Not a dry run: the state folder is created before sbatch; sysfs refuses mkdir even to root."""
    out = "/sys/slurm-jit-no-such/out"
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "submit.py"), *BASE[2:], "--output-dir", out,
                           *CMD], capture_output=True, text=True, check=False, timeout=60, cwd=tmp_path,
                          env={**os.environ, "SLURM_CONF": str(tmp_path / "no-cluster.conf")})  # never submits
    assert proc.returncode == 2, proc.stderr
    assert f"cannot write to {out}: " in proc.stderr and "HINT" in proc.stderr and "Traceback" not in proc.stderr


def test_a_job_sbatch_refuses_is_not_blamed_on_a_down_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--nodes 10**20 passes our checks; sbatch refuses it: the hint said "is Slurm up?"."""
    from slurm_jit import slurm
    from slurm_jit.launch import submit as submit_module

    def runner(argv: list[str], timeout_s: float) -> str:
        raise slurm.SlurmError(f"{argv[0]} failed (exit 255): sbatch: error: \"{10**20}\" is not a valid node count")

    monkeypatch.setattr(slurm, "runner", runner)
    with pytest.raises(SystemExit) as exited:
        submit_module.submit_main(["--output-dir", str(tmp_path / "out"), "--time", "30", "--signal-lead", "60",
                                   "--nodes", str(10**20), *CMD])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "is not a valid node count" in err
    assert "HINT: sbatch refused the job" in err and "is Slurm up" not in err


def test_a_relative_output_dir_is_made_absolute_where_submit_runs(tmp_path: Path) -> None:
    """The job may start in another directory (--chdir, a different login node path): the script and the gate
    must not depend on it. Spaces and quotes in the path stay one shell word."""
    proc = submit("--output-dir", "runs/it's a \"test\"", "--time", "30", "--signal-lead", "60", *CMD, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out_line = next(line for line in proc.stdout.splitlines() if line.startswith("OUT_DIR="))
    assert shlex.split(out_line.removeprefix("OUT_DIR=")) == [f"{tmp_path}/runs/it's a \"test\""]


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    a_file = tmp_path / "out"
    a_file.write_text("not a directory")
    proc = submit("--output-dir", str(a_file), "--time", "30", "--signal-lead", "60", *CMD)
    assert proc.returncode == 2 and "Not a directory. HINT" in proc.stderr and "Traceback" not in proc.stderr
    assert a_file.read_text() == "not a directory"


def test_unknown_config_key_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text('tme = "30"\n')
    proc = submit("--config", str(config))
    assert proc.returncode == 2 and "unknown key(s) tme" in proc.stderr and "HINT" in proc.stderr


def test_gate_refuses_only_non_resumable_checkpoints_unless_quarantine(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "checkpoint-is-incomplete.txt").write_text("x")
    args = ["--output-dir", str(out), "--time", "30", "--signal-lead", "60", "--", "python", "t.py"]
    refused = submit(*args)
    assert refused.returncode == 1 and "no resumable checkpoint" in refused.stderr and "HINT" in refused.stderr
    assert refused.stdout == ""  # no script
    allowed = submit("--quarantine", *args)
    assert allowed.returncode == 0 and "--quarantine" in allowed.stdout
    assert (out / "checkpoint-4").is_dir()  # a dry run renames nothing
    gate = subprocess.run([sys.executable, "-m", "slurm_jit.launch.gate", str(out), "--quarantine"],
                          capture_output=True, text=True, check=False, timeout=60)
    assert gate.returncode == 0 and "checkpoint-4 -> checkpoint-4.incomplete" in gate.stdout
    assert (out / "checkpoint-4.incomplete").is_dir() and not (out / "checkpoint-4").exists()


def test_the_gate_refuses_a_bad_world_size_in_one_line_before_moving_anything(tmp_path: Path) -> None:
    """A job script edited by hand (--world-size 0 was taken as 'not asked', -1 planned a conversion to -1 ranks):
    one line with a HINT, exit 2, and --quarantine renames nothing."""
    out = tmp_path / "out"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "checkpoint-is-incomplete.txt").write_text("x")
    for bad in ("0", "-1", "abc", "2.5", str(10**12), ""):
        gate = subprocess.run([sys.executable, "-m", "slurm_jit.launch.gate", str(out), "--quarantine",
                               f"--world-size={bad}"], capture_output=True, text=True, check=False, timeout=60)
        assert gate.returncode == 2 and gate.stdout == "", (bad, gate)
        assert len(gate.stderr.splitlines()) == 1 and "HINT:" in gate.stderr, (bad, gate.stderr)
    assert (out / "checkpoint-4").is_dir()


HOSTILE = ["a b", "it's", 'say "hi"', "$(touch /tmp/slurm-jit-pwned)", "x; rm -rf ~", "`id`", "$HOME", "*",
           "new\nline", ""]


def test_job_name_and_extra_options_go_to_sbatch_as_argv(tmp_path: Path) -> None:
    name = HOSTILE[3] + HOSTILE[1]
    proc = submit(*BASE, "--job-name", name, "--sbatch-arg=--comment=a b; c", *CMD)
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(plan_text.value(proc.stderr, "sbatch:"))
    assert argv[:5] == ["sbatch", "--parsable", "--hold", "--job-name=$(touch /tmp/slurm-jit-pwned)it's",
                        "--comment=a b; c"] and len(argv) == 6
    assert name not in proc.stdout and "--job-name" not in proc.stdout  # never in an #SBATCH line


def test_hostile_arguments_reach_the_rank_unchanged(tmp_path: Path) -> None:
    """The spec a task reads, exec'd for real: the training process sees exactly the argv given."""
    seen = tmp_path / "argv.json"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"argv": [sys.executable, "-c",
                                         "import json,sys; json.dump(sys.argv[1:], open(sys.argv[1], 'w'))",
                                         str(seen), *HOSTILE]}))
    pwned = Path("/tmp/slurm-jit-pwned")
    pwned.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "slurm_jit.launch.task", str(spec)], check=True, timeout=60)
    assert json.loads(seen.read_text()) == [str(seen), *HOSTILE]
    assert not pwned.exists()


def test_function_entry_is_called_with_its_arguments(tmp_path: Path) -> None:
    module = tmp_path / "userjob.py"
    module.write_text("import json, os, sys\ndef main():\n"
                      "    json.dump([sys.argv[1:], os.environ.get('RANK')], open(sys.argv[1], 'w'))\n")
    spec = tmp_path / "spec.json"
    seen = tmp_path / "seen.json"
    spec.write_text(json.dumps({"function": "userjob:main", "args": [str(seen), "a b", "$(x)"]}))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}",
           "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}
    env.pop("RANK", None)
    subprocess.run([sys.executable, "-m", "slurm_jit.launch.task", str(spec)], check=True, timeout=60, env=env)
    assert json.loads(seen.read_text()) == [[str(seen), "a b", "$(x)"], "1"]


def test_bad_spec_is_one_line(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"argv": []}))
    proc = subprocess.run([sys.executable, "-m", "slurm_jit.launch.task", str(spec)], capture_output=True,
                          text=True, check=False, timeout=60)
    assert proc.returncode == 2 and "HINT" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_generated_and_raw_scripts_are_shellcheck_clean() -> None:
    scripts = [str(p) for p in sorted(GOLDEN.glob("submit-*.sbatch"))]
    scripts += [str(p) for p in sorted((ROOT / "sbatch").glob("*.sbatch"))]
    proc = subprocess.run(["shellcheck", "-s", "bash", *scripts], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_scripts_pass_grace_calc_check(name: str) -> None:
    golden = GOLDEN / f"submit-{name}.sbatch"
    lead = "243" if name == "grace-calc" else "300"
    proc = subprocess.run([sys.executable, "-m", "slurm_jit.grace.cli", "check", str(golden), "--step-time",
                           "1m", "--save-time", "1m", "--no-slurm"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"TERM@{lead}" in golden.read_text()


@pytest.mark.parametrize(("env", "expected"), [
    ({"SLURM_STEP_TASKS_PER_NODE": "2"}, 2),
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x3)", "SLURM_NODEID": "2"}, 4),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,2", "SLURM_NODEID": "1"}, 2),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_NODEID": "2"}, 1),
    ({"SLURM_TASKS_PER_NODE": "8"}, 8),
    ({}, None),
    ({"SLURM_STEP_TASKS_PER_NODE": "junk"}, None),
])
def test_local_world_size_from_slurm(env: dict[str, str], expected: int | None) -> None:
    assert dist_env.local_world_size(dict(env)) == expected


SRUN_TASK_ENV = {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                 "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_ID": "9",
                 "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"}


def test_srun_python_train_and_the_launcher_task_set_the_same_rank_variables() -> None:
    """``srun python train.py`` (dist_env.from_slurm, as demo_train calls it) and the launcher's task entry
    agree, LOCAL_WORLD_SIZE included: else accelerate gives a CPU rank other threads than a local run."""
    direct, through_task = dict(SRUN_TASK_ENV), dict(SRUN_TASK_ENV)
    assert dist_env.from_slurm(direct)
    task.set_rank_env(through_task)
    assert direct == through_task
    assert (direct["RANK"], direct["WORLD_SIZE"], direct["LOCAL_RANK"], direct["LOCAL_WORLD_SIZE"]) == \
        ("3", "4", "1", "2")


def test_the_plan_says_when_the_resume_converts_and_refuses_what_cannot_resume_on_that_many_ranks(
        tmp_path: Path) -> None:
    """Issue 13: a ZeRO-2 checkpoint of 2 ranks submitted on 1 (crafted by the real protocol writer; a timing log
    by the real writer with one earlier conversion): the plan names the conversion and its estimate, the job's gate
    gets the world size; one whose ZeRO stage no manifest records is refused in one line."""
    import ckpt_factory

    from slurm_jit import timing

    out = tmp_path / "out"
    ckpt = ckpt_factory.checkpoint(out, 5, world=2, deepspeed=True)
    log = timing.TimingLog(out, rank=0, world_size=2, run_id="r1")
    log.conversion(3, 30.0, 1000, from_world_size=1)
    log.close()
    args = ["--output-dir", str(out), "--time", "30", "--signal-lead", "60", "--", "python", "t.py"]
    one = submit(*args)
    assert one.returncode == 0, one.stderr
    elastic = plan_text.value(one.stderr, "elastic:")  # its lines joined: a long tmp path wraps it
    assert elastic.startswith(f"2 -> 1 ranks from {ckpt}: convert, once, at the start of the first job"), elastic
    assert "1 conversion in the timing log" in " ".join(one.stderr.split()), one.stderr
    assert 'gate "$OUT_DIR" --world-size 1 ||' in one.stdout
    # The timing log is the 2 ranks' (another world size's): given times size the 1-rank job.
    timed = submit("--output-dir", str(out), "--time", "30", "--step-time", "1s", "--save-time", "5s", "--",
                   "python", "t.py")
    assert timed.returncode == 0 and "elastic:  2 -> 1 ranks" in timed.stderr, timed.stderr
    two = submit("--ntasks-per-node", "2", *args)
    assert two.returncode == 0 and "elastic:" not in two.stderr, two.stderr
    unknown = tmp_path / "unknown"
    ckpt_factory.checkpoint(unknown, 5, world=2, deepspeed=True, zero_stage=None)
    refused = submit("--output-dir", str(unknown), *args[2:])
    assert refused.returncode == 1 and refused.stdout == "", refused
    last = refused.stderr.strip().splitlines()[-1]
    assert "ZeRO stage no manifest records" in last and "HINT: resume with 2 ranks" in last, refused.stderr


def test_status_and_submit_print_the_same_signal_lead_for_one_timing_log(tmp_path: Path) -> None:
    """status summed its own terms (no latency steps, kill_wait or teardown): TERM@55 where submit sized the job
    TERM@94 from the same log."""
    import re

    from slurm_jit import timing

    out = tmp_path / "out"
    for rank in range(2):  # the real writer: steps of 0.5 s with one of 2 s, a 20 s save and a JIT stop
        log = timing.TimingLog(out, rank=rank, world_size=2, run_id="r1")
        for step in range(1, 41):
            log.step(step, 2.0 if step == 20 else 0.5)
        log.agreement(40, mode="overlapped", allreduce_s=0.01, step_s=0.5, threshold_s=1.0, kill_wait_s=3.0)
        log.save(40, "jit", 20.0 + rank, 123_456)
        log.stop(40, signal_to_end_s=30.0, fields={"teardown_s": 4.0, "kill_wait_s": 3.0})
        log.close()
    submitted = submit("--output-dir", str(out), "--time", "30", "--ntasks-per-node", "2", *CMD)
    assert submitted.returncode == 0, submitted.stderr
    (lead,) = re.findall(r"#SBATCH --signal=TERM@(\d+)", submitted.stdout)
    status = subprocess.run([sys.executable, str(ROOT / "launch" / "submit.py"), "status", str(out)],
                            capture_output=True, text=True, check=False, timeout=60)
    assert status.returncode == 0, status.stderr
    assert re.findall(r"--signal=TERM@(\d+)", status.stdout) == [lead], status.stdout


def test_a_training_program_without_its_exec_bit_is_one_line_with_a_hint(tmp_path: Path) -> None:
    """execvp's PermissionError was a traceback in every rank; submit refuses it before sbatch, too."""
    program = tmp_path / "train.sh"
    program.write_text("#!/bin/sh\necho trained\n")
    program.chmod(0o644)
    spec = json.dumps({"argv": [str(program), "--lr", "3e-4"]})
    ran = subprocess.run([sys.executable, "-m", "slurm_jit.launch.task", "--spec", spec], capture_output=True,
                         text=True, check=False, timeout=60)
    assert ran.returncode == task.EXIT_BAD_SPEC and "Traceback" not in ran.stderr, ran.stderr
    (line,) = ran.stderr.splitlines()
    assert f"cannot run {program}: Permission denied" in line and f"HINT: make it executable (chmod +x {program})" \
        in line
    refused = submit("--output-dir", str(tmp_path / "out"), "--time", "30", "--signal-lead", "60", "--",
                     str(program))
    assert refused.returncode == 2 and f"chmod +x {program}" in refused.stderr and refused.stdout == "", refused


def test_a_submit_sbatch_refuses_leaves_the_directory_and_a_queued_jobs_command_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, every submit rewrote OUT_DIR/slurm-jit/launch-spec.json, even one sbatch refused: a queued or
    requeued job of the same directory ran the other command at its next start. The command is now in the job's
    own script (Slurm's copy), and a refused submit writes nothing the job reads."""
    from slurm_jit import slurm
    from slurm_jit.launch import submit as submit_module

    out = tmp_path / "out"
    (out / "slurm-jit").mkdir(parents=True)
    (out / "slurm-jit" / SPEC_NAME).write_text('{"argv": ["python", "first.py"]}\n')  # an older job's

    def runner(argv: list[str], timeout_s: float) -> str:
        raise slurm.SlurmError(f"{argv[0]} failed (exit 1): sbatch: error: Invalid --distribution specification")

    monkeypatch.setattr(slurm, "runner", runner)
    before = sorted(p.name for p in (out / "slurm-jit").iterdir())
    with pytest.raises(SystemExit):
        submit_module.submit_main(["--output-dir", str(out), "--time", "30", "--signal-lead", "60", "--",
                                   "python", "second.py"])
    assert "sbatch refused the job" in capsys.readouterr().err
    assert json.loads((out / "slurm-jit" / SPEC_NAME).read_text()) == {"argv": ["python", "first.py"]}
    assert sorted(p.name for p in (out / "slurm-jit").iterdir() if p.name not in ("submit.lock", "logs")) == before
    assert not list((out / "slurm-jit" / "logs").iterdir())  # neither the pickle nor the script is left
