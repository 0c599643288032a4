"""``grace-calc`` as users run it: a subprocess, its stdout, stderr and exit code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from grace_helpers import EXAMPLE_SIZING, EXPECTED, SBATCH, TINY_SIZING, grace_calc

from slurm_jit import timing
from slurm_jit.grace import calc as grace


def write_log(out: Path, world_size: int = 2, steps: int = 30, save_s: float | None = 4.0) -> None:
    """A timing log written by the real writer: steps of 0.5 s with one of 2 s, one save, one evaluation."""
    for rank in range(world_size):
        log = timing.TimingLog(out, rank=rank, world_size=world_size, run_id="r1")
        for step in range(1, steps + 1):
            log.step(step, 2.0 if step == steps // 2 else 0.5)
        log.evaluation(10, 1.5, aborted=False)
        if save_s is not None:
            log.save(steps, "jit", save_s + rank, 123_456)
        log.close()


def test_docs_example_prints_243() -> None:
    exe = Path(sys.executable).parent / "grace-calc"
    argv = ("--step-time", "2m", "--save-time", "2m", "--margin", "0", "--no-slurm")
    proc = grace_calc(*argv, script=exe.exists())
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["--signal=TERM@243", "#SBATCH --signal=TERM@243"]
    assert lines[2] == "export SLURM_JIT_SIGNAL_LEAD_S=243"
    assert "needed        243.00  --signal lead N = 243 s (rounded up)" in proc.stdout
    assert "up to 60 s early" in proc.stdout and "KillWait" in proc.stdout
    assert proc.stderr == ""


def test_json_has_the_terms_and_the_default_margin() -> None:
    proc = grace_calc("--step-time", "2m", "--save-time", "2m", "--eval-time", "30s", "--no-slurm", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["signal_lead_s"] == 120 + 30 + 120 + 3 + 54  # margin: 20 % of 270 s
    assert out["option"] == "--signal=TERM@327"
    assert {t["name"]: t["seconds"] for t in out["terms"]} == {
        "step": 120, "eval": 30, "save": 120, "kill_wait": 3, "teardown": 0, "margin": 54}
    assert out["cluster"]["kill_wait_s"] == 30 and out["cluster"]["grace_time_s"] is None


def bad_inputs(tmp_path: Path) -> list[list[str]]:
    broken = tmp_path / "broken"
    write_log(broken)
    path = timing.timing_path(broken, 0)
    path.write_text("{not json\n" + path.read_text())
    two_ranks = tmp_path / "ws2"
    write_log(two_ranks, world_size=2)
    no_signal = tmp_path / "no-signal.sbatch"
    no_signal.write_text("#!/bin/bash\n#SBATCH --time=10\nsrun python t.py\n")
    ok = ["--save-time", "2m", "--no-slurm"]
    return [
        ["--step-time", "", *ok], ["--step-time", "-5", *ok], ["--step-time", "nan", *ok],
        ["--step-time", "NaN", *ok],
        ["--step-time", "0", *ok], ["--step-time", "0s", *ok], ["--step-time", "abc", *ok],
        ["--step-time", "inf", *ok], ["--step-time", "2m", "--save-time", "2x", "--no-slurm"],
        ["--step-time", "2m", "--no-slurm"], ["--save-time", "2m", "--no-slurm"],
        ["--step-time", "2m", *ok, "--margin", "lots"], ["--step-time", "2m", *ok, "--margin", "-1%"],
        ["--step-time", "2m", *ok, "--kill-wait", "-1"], ["--step-time", "2m", *ok, "--eval-time", "0"],
        ["--step-time", "99999h", *ok], ["--bogus"], ["--step-time"],
        ["--from", str(tmp_path / "no-such-run"), "--no-slurm"], ["--from", str(broken), "--no-slurm"],
        ["--from", str(two_ranks), "--world-size", "4", "--no-slurm"],
        ["--from", str(two_ranks), "--world-size", "0", "--no-slurm"],
        ["--step-time", "2m", "--ckpt-bytes", "1GB", "--no-slurm"],
        ["--step-time", "2m", "--probe", str(tmp_path), "--no-slurm"],
        ["--step-time", "2m", "--ckpt-bytes", "1GB", "--probe", str(tmp_path / "nope"), "--no-slurm"],
        ["--step-time", "2m", "--params", "lots", "--write-bandwidth", "1GB/s", "--no-slurm"],
        ["--step-time", "2m", "--params", "7B", "--write-bandwidth", "-1GB/s", "--no-slurm"],
        ["--step-time", "2m", "--ckpt-bytes", "1e400", "--write-bandwidth", "1GB/s", "--no-slurm"],
        ["check", "--step-time", "1s", "--save-time", "1s"],
        ["check", str(tmp_path / "missing.sbatch"), "--step-time", "1s", "--save-time", "1s", "--no-slurm"],
        ["check", str(no_signal), "--step-time", "1s", "--save-time", "1s", "--no-slurm"],
        ["check", str(SBATCH / "train-tiny.sbatch"), "--no-slurm"],
    ]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for argv in bad_inputs(tmp_path):
        proc = grace_calc(*argv)
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr, argv
        assert proc.stdout == "", argv
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("grace-calc: error: "), (argv, proc.stderr)
        assert "HINT" in lines[0], (argv, proc.stderr)


def test_wrong_world_size_from_the_environment(tmp_path: Path) -> None:
    write_log(tmp_path, world_size=2)
    proc = grace_calc("--from", str(tmp_path), "--no-slurm", env={"WORLD_SIZE": "8"})
    assert proc.returncode == 2 and "written with world size [2], not 8" in proc.stderr
    assert grace_calc("--from", str(tmp_path), "--no-slurm", env={"SLURM_NTASKS": "2"}).returncode == 0


def test_from_a_timing_log(tmp_path: Path) -> None:
    write_log(tmp_path, world_size=2)
    proc = grace_calc("--from", str(tmp_path), "--no-slurm", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    terms = {t["name"]: t for t in out["terms"]}
    # The longest step (2 s), the slowest rank's save (4 + 1 s), the evaluation (1.5 s).
    assert (terms["step"]["seconds"], terms["save"]["seconds"], terms["eval"]["seconds"]) == (2.0, 5.0, 1.5)
    # 30 steps - 2 warm-up, each counted once whichever of the 2 ranks recorded it
    assert terms["step"]["source"].startswith("1 x 2 s (max of 28 steps over 1 run in the timing log): the stop "
                                              "comes after the step the signal lands in")
    assert out["samples"]["world_sizes"] == [2] and out["samples"]["evals"] == 1
    assert out["signal_lead_s"] == 22  # 2 + 1.5 + 5 + 3 + 10 = 21.5, rounded up
    given = json.loads(grace_calc("--from", str(tmp_path), "--no-slurm", "--json", "--save-time", "1m",
                                  "--no-eval").stdout)
    assert {t["name"]: t["seconds"] for t in given["terms"]}["save"] == 60  # given beats measured
    assert {t["name"]: t["source"] for t in given["terms"]}["eval"] == "--no-eval"


def test_probe_estimates_the_save_when_none_was_measured(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_log(run, save_s=None)
    probe_dir = tmp_path / "fs"
    probe_dir.mkdir()
    proc = grace_calc("--from", str(run), "--ckpt-bytes", "2MB", "--probe", str(probe_dir),
                      "--probe-size", "1MiB", "--no-slurm", "--json")
    assert proc.returncode == 0, proc.stderr
    save = {t["name"]: t for t in json.loads(proc.stdout)["terms"]}["save"]
    assert save["seconds"] > 0 and "estimate: 1.9 MiB (--ckpt-bytes)" in save["source"]
    assert f"--probe {probe_dir}: 1.0 MiB written and fsynced" in save["source"]
    assert list(probe_dir.iterdir()) == []


def test_params_estimate_over_a_given_bandwidth() -> None:
    proc = grace_calc("--step-time", "10s", "--params", "1B", "--write-bandwidth", "1GB/s",
                      "--zero-stage", "2", "--world-size", "8", "--nodes", "2", "--no-slurm", "--json")
    assert proc.returncode == 0, proc.stderr
    save = {t["name"]: t for t in json.loads(proc.stdout)["terms"]}["save"]
    assert save["seconds"] == 8.0  # rank 0's node: 2 B weights + 12 B optimizer state * 4/8 ranks, 1e9 params


def test_every_example_script_has_an_expectation() -> None:
    found = {str(p.relative_to(SBATCH)) for p in SBATCH.rglob("*.sbatch")}
    assert found == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_check_example_scripts(name: str) -> None:
    code, text = EXPECTED[name]
    sizing = EXAMPLE_SIZING if name.startswith("examples/") else TINY_SIZING
    proc = grace_calc("check", str(SBATCH / name), *sizing, "--no-slurm")
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert text in (proc.stdout if code < 2 else proc.stderr)
    assert "Traceback" not in proc.stderr


def test_check_json() -> None:
    script = SBATCH / "examples/bad-torchrun.sbatch"
    proc = grace_calc("check", str(script), *EXAMPLE_SIZING, "--no-slurm", "--json")
    assert proc.returncode == 1
    check = json.loads(proc.stdout)["check"]
    assert check["exit_code"] == 1 and check["script"].endswith("bad-torchrun.sbatch")
    assert [f["level"] for f in check["findings"]].count("fail") == 1


@pytest.mark.deepspeed
def test_from_a_real_run(jit_zero2_run: Path) -> None:
    """--from on the output directory of a real JitTrainer run (2 DeepSpeed ranks, saves at steps 3 and 6)."""
    proc = grace_calc("--from", str(jit_zero2_run), "--no-slurm", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    summary = timing.load_summary(jit_zero2_run)
    terms = {t["name"]: t["seconds"] for t in out["terms"]}
    modes = {r["mode"] for r in timing.read_records(jit_zero2_run) if r["event"] == "agreement"}
    assert len(modes) == 1  # recorded once per run, after warm-up, the same on both ranks
    assert terms["step"] == pytest.approx(grace.LATENCY_STEPS[modes.pop()] * summary.step_max_s)
    assert terms["save"] == max(s.max_dur_s for s in summary.saves.values())
    assert out["samples"]["world_sizes"] == [2] and out["samples"]["steps"] == summary.n_steps > 0
    proc = grace_calc("--from", str(jit_zero2_run), "--world-size", "4", "--no-slurm")
    assert proc.returncode == 2 and "world size [2], not 4" in proc.stderr
    ok = grace_calc("check", str(SBATCH / "train-tiny.sbatch"), "--from", str(jit_zero2_run), "--no-slurm")
    assert ok.returncode == 0, ok.stdout + ok.stderr
