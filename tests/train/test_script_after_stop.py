"""A script in the shape of transformers' examples (tests/helpers/hf_script.py: HfArgumentParser, the work after
``train()``, ``logging_steps`` > 1), stopped by a real SIGTERM and resumed: after the JIT stop nothing of the
script's end runs (the process exits once the checkpoint and the stop record are written), and every value the
resumed run logs (each window's loss, the final ``train_loss``) equals the uninterrupted run's, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from jit_helpers import logged, run_demo

from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "hf_script.py"
RUN_TIMEOUT_S = 300
MAX_STEPS = 12


def _run(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(SCRIPT), "--output_dir", str(out), "--max_steps", str(MAX_STEPS),
            "--per_device_train_batch_size", "4", "--save_strategy", "no", "--use_cpu", "true",
            "--report_to", "none", "--disable_tqdm", "true", "--seed", "3", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)


def _logged(out: Path) -> list[dict[str, float]]:
    """Every value the run logged, but the timings (train_runtime, *_per_second) and the token throughput."""
    history = json.loads((out / "log-history.json").read_text())
    return [{k: v for k, v in entry.items() if "runtime" not in k and "per_second" not in k} for entry in history]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, float]]]:
    """Uninterrupted runs, one per logging_steps."""
    logged = {}
    for logging_steps in (1, 7, 10):
        out = tmp_path_factory.mktemp(f"reference-{logging_steps}")
        done = _run(out, "--logging_steps", str(logging_steps))
        assert done.returncode == 0, done.stderr[-3000:]
        logged[logging_steps] = _logged(out)
    return logged


@pytest.mark.slow
# A stop lands after the signal's step, or one step later where the ranks read their stop rounds overlapped (steps
# under 0.5 s, these: ~20 ms): signalled at step 6 with logging_steps 7 it stops at the window's last step
@pytest.mark.parametrize(("logging_steps", "signal_at"), [(1, 4), (7, 4), (7, 6), (10, 3)],
                         ids=["log-1", "log-7-inside", "log-7-at-window-end", "log-10"])
def test_a_jit_stop_ends_the_script_and_the_resume_logs_what_the_uninterrupted_run_logs(
        tmp_path: Path, references: dict[int, list[dict[str, float]]], logging_steps: int, signal_at: int) -> None:
    out = tmp_path / "out"
    stopped = _run(out, "--logging_steps", str(logging_steps), "--signal_at_step", str(signal_at))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "the process exits now (status 0)" in stopped.stderr, stopped.stderr[-3000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["step"] in (signal_at, signal_at + 1), record
    assert protocol.inspect(Path(record["checkpoint"]), record["step"]).status is protocol.Status.COMPLETE
    # nothing of the script's end: before, train() returned and the script saved a "final" model and its metrics
    assert not (out / "model.safetensors").exists() and not (out / "train_results.json").exists()
    assert not (out / "log-history.json").exists()
    resumed = _run(out, "--logging_steps", str(logging_steps))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (out / "model.safetensors").exists() and (out / "train_results.json").exists()
    assert _logged(out) == references[logging_steps]  # before: the first window after the resume differed


@pytest.mark.slow
def test_an_epoch_logging_run_logs_no_partial_window_at_the_stop(tmp_path: Path) -> None:
    """logging_strategy=epoch: upstream's end-of-epoch call after the stop logged the window so far (a loss the
    uninterrupted run never logs, to every tracker)."""
    args = ("--logging_strategy", "epoch", "--samples", "32")  # 8 steps an epoch, 12 steps
    reference, out = tmp_path / "reference", tmp_path / "out"
    assert _run(reference, *args).returncode == 0
    stopped = _run(out, *args, "--signal_at_step", "4")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "'loss'" not in stopped.stdout + stopped.stderr, stopped.stdout[-2000:]
    assert _run(out, *args).returncode == 0
    assert _logged(out) == _logged(reference)


@pytest.mark.slow
def test_a_users_own_train_loss_is_logged_as_given(tmp_path: Path) -> None:
    """Only upstream's end-of-training summary has its train_loss made the chain's; a subclass that logs a value
    of its own under that name keeps it (the first review: it was rewritten to the chain's running mean)."""
    out = tmp_path / "out"
    done = _run(out, "--logging_steps", "5", "--user_train_loss_every", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    own = [e["train_loss"] for e in _logged(out) if "train_loss" in e and "total_flos" not in e]
    assert own == [123.0, 123.0, 123.0], _logged(out)


@pytest.mark.slow
def test_with_exit_after_jit_stop_off_train_returns_and_the_script_checks_jit_stopped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    stopped = _run(out, "--logging_steps", "7", "--signal_at_step", "5", "--return_after_stop", "true")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "the process exits now" not in stopped.stderr
    assert (out / "returned-after-stop").exists()  # train() returned and trainer.jit_stopped said so
    assert not (out / "train_results.json").exists()
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["step"] in (5, 6), record


@pytest.mark.slow
@pytest.mark.deepspeed
def test_two_deepspeed_ranks_resume_each_ranks_loss_window(tmp_path: Path) -> None:
    """ZeRO-2 on 2 ranks, logging_steps 7, a stop inside the second window (step 9 or 10): each rank's own loss sum is
    put back, so the gathered mean of the window ending at step 14, the final train_loss and every other value
    rank 0 logged equal the uninterrupted run's. A JIT stop logs no end-of-training summary."""
    args = ["--zero-stage", "2", "--max-steps", "16", "--kill-wait", "0", "--targ", "logging_steps=7"]
    reference, out = tmp_path / "reference", tmp_path / "out"
    run_demo(reference, args, 2)
    run_demo(out, [*args, "--signal-self-at-step", "9"], 2)
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["step"] in (9, 10), record
    assert not any("train_loss" in entry for entry in logged(out))  # before: the stop logged a training summary
    run_demo(out, [*args, "--resume"], 2)
    expected = logged(reference)
    assert [e["step"] for e in expected if "loss" in e] == [7, 14] and "train_loss" in expected[-1], expected
    assert logged(out) == expected
