"""Every option ``python launch/submit.py`` names in its plan or in a refusal's HINT is one it has (or sbatch's,
for the ``#SBATCH`` lines it explains): a newcomer who types what the plan says gets no "unrecognized
arguments". Checked mechanically over the plan and refusals of several real dry runs, against the real parser."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from slurm_jit import timing
from slurm_jit.grace import goodput_cli
from slurm_jit.launch import sbatch_options, submit

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
CMD = ["--", "python", "train.py"]
AFTER_DASHES = re.compile(r"(^|\s)-- \S.*$", re.MULTILINE)  # an example training command's own options


GOODPUT_COMMAND = re.compile(r"grace-calc goodput [^.;\n]*(?:\.\d[^.;\n]*)*")  # the saves: line's HINT, to its end


def _known() -> set[str]:
    parser = submit._parser()
    ours = {s for action in parser._actions for s in action.option_strings}
    return ours | {f"--{name}" for name in sbatch_options.LONG_OPTIONS}


def _goodput_known() -> set[str]:
    parser = goodput_cli.build_parser(argparse.ArgumentParser)
    return {s for action in parser._actions for s in action.option_strings}


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    try:
        submit.submit_main(["--dry-run", *argv])
    except SystemExit:
        pass
    captured = capsys.readouterr()
    return captured.err  # the plan and every refusal (the batch script on stdout is submitit's and sbatch's)


def _timing_log(out: Path) -> None:
    for rank in (0, 1):
        log = timing.TimingLog(out, rank=rank, world_size=2, run_id="r1")
        for step in range(1, 20):
            log.step(step, 0.5)
        log.save(19, "jit", 1.0, 1000)
        log.close()


def test_every_option_the_plan_and_its_refusals_name_exists(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    earlier = tmp_path / "earlier"
    _timing_log(earlier)
    out = str(tmp_path / "out")
    runs = [
        ["--output-dir", out, "--time", "30", "--step-time", "5s", "--save-time", "30s", *CMD],
        ["--output-dir", out, "--time", "30", "--from", str(earlier), *CMD],
        ["--output-dir", str(earlier), "--time", "30", *CMD],
        ["--output-dir", out, "--time", "30", *CMD],  # no step time: the HINT names the ways to give one
        ["--output-dir", out, "--time", "30", "--step-time", "5s", *CMD],  # no save time
        ["--output-dir", out, "--time", "1", "--step-time", "5m", "--save-time", "5m", *CMD],  # lead > limit
        ["--output-dir", out, "--time", "30", "--signal-lead", "60", "--python", "/no/such/python", *CMD],
        ["--output-dir", out, "--time", "30", "--signal-lead", "60"],  # no command
        ["--time", "30", "--signal-lead", "60", *CMD],  # no --output-dir
    ]
    known = _known()
    for argv in runs:
        text = _run(capsys, argv)
        assert text.strip(), argv
        text = AFTER_DASHES.sub("", text.replace(out, "OUT").replace(str(earlier), "EARLIER"))
        for command in GOODPUT_COMMAND.findall(text):  # grace-calc goodput's own options, against its parser
            named = set(OPTION.findall(command))
            assert named <= _goodput_known(), (f"named but not an option of grace-calc goodput: "
                                              f"{sorted(named - _goodput_known())}", argv, command)
        text = GOODPUT_COMMAND.sub("", text)
        named = set(OPTION.findall(text))
        assert named <= known, (f"named but not an option of {submit.PROG}: {sorted(named - known)}", argv, text)
