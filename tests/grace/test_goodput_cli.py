"""``grace-calc goodput``: each system's goodput and the advised save_steps, from given numbers or a real timing log;
every bad input one line and exit 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from grace_helpers import grace_calc

from slurm_jit import timing
from slurm_jit.grace import cli as grace_cli
from slurm_jit.grace import goodput as gp

JOB = ("goodput", "--gpus", "16384", "--time-limit", "24h", "--restart", "10m")
GIVEN = (*JOB, "--step-time", "10s", "--save-time", "1m")


def exit_code(argv: list[str]) -> int:
    """grace-calc's exit code for ``argv``, run in this process (argparse's own errors exit through SystemExit)."""
    try:
        return grace_cli.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert grace_cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_each_system_at_its_advised_interval(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, *GIVEN)
    rows = {r["system"]: r for r in out["systems"]}
    assert out["unwarned_per_h"] == pytest.approx(419 / (54 * 24))  # Llama 3's rate at 16,384 GPUs
    young = math.sqrt(2 * 60 / out["unwarned_per_h"] * 3600)  # (b), (c): sqrt(2 x save x MTBF), 10 s steps
    assert rows["b"]["young_interval_s"] == pytest.approx(young)
    assert rows["b"]["save_steps"] == rows["b"]["advised_save_steps"] == round(young / 10)
    for key, row in rows.items():
        costs = gp.Costs(**{k: (math.inf if v is None else v) for k, v in row["costs"].items()})
        system = {s.key: s for s in gp.SYSTEMS}[key]
        assert row["goodput"] == gp.expected(costs, system, gp.Failures(gpus=16384)).goodput
    assert rows["c"]["costs"]["hang_detect_s"] == 314.0  # the watchdog's auto bound, 300 s, + its firing
    assert rows["a"]["costs"]["hang_detect_s"] is None  # until the time limit
    assert rows["c"]["goodput"] > rows["b"]["goodput"]  # the same saves, crashes ended by the watchdog


def test_text_names_the_failure_model_and_the_advice(capsys: pytest.CaptureFixture[str]) -> None:
    assert grace_cli.main([*GIVEN, "--save-steps", "100", "--hang-fraction", "0.1"]) == 0
    text = capsys.readouterr().out
    assert "one every 3.09 h" in text
    assert "from Llama 3's 419 unexpected interruptions in 54 days on 16,384 GPUs" in text
    assert "(a) Trainer, periodic saves" in text and "(c) JitTrainer" in text
    assert "       100 " in text  # evaluated at the given interval; the advice beside it


def test_from_a_timing_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real timing-log files (the trainer's writer): the median step (warm-up left out), the mean periodic save of
    the slowest rank, the async snapshots' staging and their full time."""
    for rank, slower in ((0, 0.0), (1, 0.5)):
        log = timing.TimingLog(tmp_path, rank=rank, world_size=2, run_id="r1")
        for step, dur in enumerate([9.0, 9.0, 2.0, 2.0, 3.0, 2.0, 2.0], start=1):
            log.step(step, dur)
        log.save(4, "periodic", 10.0 + slower, 1000)
        log.save(6, "periodic", 20.0 + slower, 1000)
        log.save_blocked(8, "periodic", 1.0, 1000, {"stage": 1.0})
        log.save_background(8, "periodic", 29.0, 1000, {})
        log.close()
    out = run_json(capsys, *JOB, "--from", str(tmp_path))
    costs = {r["system"]: r["costs"] for r in out["systems"]}
    assert costs["a"]["step_s"] == 2.0 and costs["a"]["save_s"] == 15.5
    assert (costs["c"]["save_blocked_s"], costs["c"]["save_s"]) == (1.0, 30.0)
    assert "median of 5 steps" in out["sources"]["step"] and "2 periodic saves" in out["sources"]["save"]
    given = run_json(capsys, *JOB, "--from", str(tmp_path), "--step-time", "4s")  # given beats the log
    assert given["systems"][0]["costs"]["step_s"] == 4.0


@pytest.mark.parametrize(("args", "says"), [
    (("--gpus", "-1"), "--gpus: cannot read '-1'"), (("--gpus", "0"), "--gpus: cannot read '0'"),
    (("--gpus", "nan"), "--gpus: cannot read 'nan'"), (("--gpus", "inf"), "--gpus: cannot read 'inf'"),
    (("--gpus", "many"), "--gpus: cannot read 'many'"), (("--gpus", "2.5"), "--gpus: cannot read '2.5'"),
    (("--mtbf-gpu-hours", "0"), "--mtbf-gpu-hours: cannot read '0'"),
    (("--mtbf-gpu-hours", "-5"), "--mtbf-gpu-hours: cannot read '-5'"),
    (("--mtbf-gpu-hours", "NaN"), "--mtbf-gpu-hours: cannot read 'NaN'"),
    (("--mtbf-gpu-hours", "inf"), "--mtbf-gpu-hours: cannot read 'inf'"),
    (("--mtbf-node-hours", "x"), "--mtbf-node-hours: cannot read 'x'"),
    (("--time-limit", "0"), "--time-limit: must be more than 0 s"),
    (("--time-limit", "-1h"), "--time-limit"), (("--time-limit", "inf"), "cannot read 'inf'"),
    (("--time-limit", "nan"), "--time-limit: cannot read 'nan'"), (("--restart", "soon"), "--restart: cannot read"),
    (("--step-time", "0"), "--step-time: must be more than 0 s"), (("--save-time", "-3"), "--save-time: cannot read"),
    (("--hang-fraction", "1.5"), "hang fraction 1.5: a share, 0 to 1"),
    (("--hang-fraction", "nan"), "--hang-fraction: cannot read 'nan'"),
    (("--preemptions-per-day", "-1"), "--preemptions-per-day: cannot read '-1'"),
    (("--save-steps", "0"), "--save-steps: cannot read '0'"), (("--snapshot-steps", "1e3"), "cannot read '1e3'"),
    (("--stop-time", "25h"), "does not fit in the time limit"),
    (("--gpus-per-node", "0", "--mtbf-node-hours", "100"), "--gpus-per-node: cannot read '0'"),
])
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], says: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv = list(GIVEN)
    for option, value in zip(args[::2], args[1::2], strict=True):
        if option in argv:
            argv[argv.index(option) + 1] = value
        else:
            argv += [option, value]
    assert exit_code(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "HINT:" in captured.err and says in captured.err, captured.err


def test_missing_options_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code(["goodput", "--time-limit", "24h", "--restart", "5m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gpus" in err and "HINT:" in err
    assert grace_cli.main([*JOB]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no step time. HINT: give --step-time, or --from OUT_DIR" in err


def test_from_a_directory_without_a_timing_log_is_one_line(tmp_path: Path) -> None:
    proc = grace_calc(*JOB, "--from", str(tmp_path))  # the real command: no traceback, one line, exit 2
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no timing log in" in proc.stderr and "HINT:" in proc.stderr


def test_goodput_help_and_the_other_commands_unchanged() -> None:
    proc = grace_calc("goodput", "--help")
    assert proc.returncode == 0 and "--mtbf-gpu-hours" in proc.stdout and "--hang-fraction" in proc.stdout
    assert "50,677 h" in proc.stdout  # the default MTBF, and where it comes from
    sized = grace_calc("--step-time", "2m", "--save-time", "2m", "--margin", "0", "--no-slurm")
    assert sized.returncode == 0 and "--signal=TERM@243" in sized.stdout
