"""The launcher's plan fits one screen (issue #41 item 4): tools/demo's submit prints at most 20 lines of at most
160 characters, a line per fact, with the few facts that matter (``TERM@N``, the job id, its log) on lines of their
own; numbers rounded as a person reads them; the save advice said as what to do; the arithmetic and the reasoning
behind ``--explain``. The submit is real down to the Slurm gateway, faked at its one boundary."""

from __future__ import annotations

from pathlib import Path

import fake_slurm
import pytest

from slurm_jit import slurm, timing
from slurm_jit.launch import submit

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES, MAX_CHARS = 20, 160  # the "one screen"
REPO = "/home/someone/src/slurm-jit-checkout"  # 36 characters: where the repository is, as the check reads it
# tools/demo's submit (its OUT is $ROOT/demo-out/run-<date>-<time>), and its training's arguments
DEMO_OPTIONS = ["--job-name", "slurm-jit-demo", "--ntasks-per-node", "2", "--cpus-per-task", "1", "--time", "3",
                "--step-time", "5s", "--save-time", "30s", "--max-requeues", "4"]
DEMO_TRAIN = ["--resume", "--max-steps", "1500", "--save-steps", "500", "--step-sleep", "0.1"]
OP = "deepspeed_shm_comm"


def _demo_is_still_called_so() -> None:
    demo = (ROOT / "tools" / "demo").read_text()
    for part in (DEMO_OPTIONS[:4], DEMO_OPTIONS[4:]):  # the two lines of its submit
        assert " ".join(part) in demo, "tools/demo changed: update DEMO_OPTIONS"
    assert 'TRAIN=(--max-steps 1500 --save-steps 500 --step-sleep 0.1)' in demo, "tools/demo changed: DEMO_TRAIN"


def _demo_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *,
               built: bool, extra: tuple[str, ...] = ()) -> list[str]:
    """The lines tools/demo's submit prints with the demo's OUT and the extensions directory under tmp_path, read as
    they print where the repository is at :data:`REPO`: a path of a fixed, ordinary length, so that the check does
    not depend on where this checkout or pytest's tmp_path is (CI's clone at /check/work/main once pushed lines
    past the width that /work/main kept; xdist's tmp paths are longer still). A longer path wraps; a single path
    word longer than a line stays whole."""
    _demo_is_still_called_so()
    out = tmp_path / "demo-out" / "run-20261202-070809"
    ext = tmp_path / ".cache" / "torch_extensions"
    if built:
        op = ext / "py311_cpu" / OP
        op.mkdir(parents=True)
        (op / f"{OP}.so").write_bytes(b"\x7fELF")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    monkeypatch.setattr(slurm, "runner", fake_slurm.SubmitGateway())
    with pytest.raises(SystemExit) as exited:
        submit.main(["--output-dir", str(out), *DEMO_OPTIONS, *extra, "--", "python", "-m", "slurm_jit.demo_train",
                     "--output-dir", str(out), *DEMO_TRAIN])
    printed = capsys.readouterr()
    assert exited.value.code == 0, printed.err
    return printed.out.replace(str(tmp_path), REPO).splitlines()


@pytest.mark.parametrize("built", [True, False], ids=["op-built", "op-not-built"])
def test_the_demo_s_plan_fits_one_screen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str], built: bool) -> None:
    lines = _demo_plan(tmp_path, monkeypatch, capsys, built=built)
    longest = max(lines, key=len)
    assert len(lines) <= MAX_LINES and len(longest) <= MAX_CHARS, \
        f"{len(lines)} lines, the longest {len(longest)} characters:\n" + "\n".join(lines)
    assert [line for line in lines if line.startswith("  signal:   #SBATCH --signal=TERM@48 ")], lines
    at = next(i for i, line in enumerate(lines) if line.startswith("submitted job 4242; log"))  # the job id, its log
    log = " ".join(lines[at:at + 2]) if lines[at].endswith(" log") else lines[at]
    assert log.split()[-1] == f"{REPO}/demo-out/run-20261202-070809/slurm-jit/logs/4242_0_log.out", lines
    # 2 ranks, 3 minutes: Young's interval is hours, an unwarned failure ends one allocation in hundreds of thousands
    (saves,) = [line for line in lines if line.startswith("  saves:    ")]
    assert saves.startswith("  saves:    no periodic save needed: the JIT stop covers each allocation's end ("), saves


def test_explain_says_the_arithmetic_and_the_reasoning_in_lines_of_one_screen_s_width(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    lines = _demo_plan(tmp_path, monkeypatch, capsys, built=True, extra=("--explain",))
    assert max(len(line) for line in lines) <= MAX_CHARS, "\n".join(lines)
    text = "\n".join(lines)
    for said in ("1 x 5 s (--step-time): the stop comes after the step the signal lands in",  # the step term's why
                 "the JitTrainer aborts an evaluation a stop lands in",
                 "20% of step+eval+save+teardown, at least 10 s",
                 "Young's interval", "Llama 3's rate per GPU", "grace-calc goodput",  # the save advice's
                 "never after scancel", "the checkpoint passes ckpt-check"):  # the requeue policy's
        assert said in " ".join(text.split()), text  # wrapped lines read as one text


def test_measured_times_are_rounded_as_a_person_reads_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's run: steps of 0.271128 s and saves of 0.241 s from an earlier run's timing log (--from)."""
    earlier = tmp_path / "earlier"
    for rank in (0, 1):
        log = timing.TimingLog(earlier, rank=rank, world_size=2, run_id="r1")
        for step in range(1, 31):
            log.step(step, 0.271128)
        log.save(30, "periodic", 0.241, 1000)
        log.close()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.raises(SystemExit):
        submit.main(["--dry-run", "--output-dir", str(tmp_path / "out"), "--ntasks-per-node", "2", "--time", "3",
                     "--from", str(earlier), "--", "python", "train.py"])
    err = capsys.readouterr().err
    (grace,) = [line for line in err.splitlines() if line.startswith("  grace:    ")]
    # steps under 0.5 s: the stop can come one step later (2 steps); 2 x 0.271128 + 0.241 + 3 + 10 = 13.783256 s
    assert "step 2 x 0.27 s + save 0.24 s + kill_wait 3 s + margin 10 s = 13.8 s" in grace, grace
    assert "0.271128" not in err and "13.78" not in err, err
    assert "  signal:   #SBATCH --signal=TERM@14 " in err, err


def test_a_job_that_can_fail_before_its_end_is_told_its_save_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """1,024 GPUs for a day: an unwarned failure every ~49 h, Young's interval ~45 min: periodic saves pay."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.raises(SystemExit):
        submit.main(["--dry-run", "--output-dir", str(tmp_path / "out"), "--nodes", "128", "--ntasks-per-node", "8",
                     "--gpus-per-node", "8", "--time", "24:00:00", "--step-time", "1s", "--save-time", "20s", "--",
                     "python", "train.py"])
    err = capsys.readouterr().err
    (saves,) = [line for line in err.splitlines() if line.startswith("  saves:    ")]
    assert saves.startswith("  saves:    save_steps 2670 "), saves  # sqrt(2 x 20 s x 49.5 h) / 1 s
    assert len(saves) <= MAX_CHARS, saves
