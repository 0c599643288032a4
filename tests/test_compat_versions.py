"""The stop/resume scenario on the lowest transformers of the supported range (issue 12, item 5).

The installed transformers is the newest of the range (a fresh install resolves it) and every other DeepSpeed test
runs on it. This one installs the range's lowest (``compat.LOWEST_TRANSFORMERS``) without dependencies into an
overlay directory under a cache (``SLURM_JIT_TEST_CACHE``, default ``~/.cache/slurm-jit``; kept across runs), puts it
first on the ranks' PYTHONPATH, and runs train, SIGTERM, JIT checkpoint, resume, finish on 2 DeepSpeed ranks.
Without network (pip cannot fetch it) the test skips with the reason: it never passes without running.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from jit_helpers import assert_jit_stop, ckpt_check, losses, run_and_signal, run_logged

from slurm_jit.train import compat, stop_record

PIP_TIMEOUT_S = 600  # a ~12 MB wheel; a stalled download fails the install (a skip), not the test run
MAX_STEPS = 8
ARGS = ["--max-steps", str(MAX_STEPS), "--kill-wait", "0", "--step-sleep", "0.1", "--save-steps", "3"]


def _overlay(version: str) -> Path:
    """transformers==version alone in a directory (the venv supplies its dependencies), installed once."""
    cache = Path(os.environ.get("SLURM_JIT_TEST_CACHE", Path.home() / ".cache" / "slurm-jit"))
    target = cache / f"transformers-{version}"
    if (target / "transformers" / "__init__.py").exists():
        return target
    partial = cache / f".transformers-{version}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial),
                               f"transformers=={version}"], capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        reason = "timed out" if done is None else (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        pytest.skip(f"cannot install transformers=={version} into {target} (no network?): {reason}")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)  # a killed install leaves a .partial, never a half overlay taken as done
    return target


def _imported_version(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip()


@pytest.mark.deepspeed
def test_stop_and_resume_on_the_lowest_transformers_of_the_range(tmp_path: Path) -> None:
    version = compat.LOWEST_TRANSFORMERS
    overlay = _overlay(version)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(overlay), os.environ.get("PYTHONPATH", "")])}
    assert _imported_version(env) == version  # the overlay, not the venv's newest, is what the ranks import

    out = tmp_path / "out"
    stopped = run_and_signal(out, ARGS, [(0, 0.0), (1, 0.0)], after_steps=4, signum=signal.SIGTERM, env=env)
    ckpt = assert_jit_stop(out, stopped)
    # written by the ranks' transformers (save_pretrained stamps its version into the model config)
    assert json.loads((ckpt / "config.json").read_text())["transformers_version"] == version
    resumed = run_logged(out, [*ARGS, "--resume"], env=env)
    assert resumed.codes == [0, 0], resumed.log[-4000:]
    assert f"resuming from {ckpt} " in resumed.log, resumed.log[-4000:]
    assert [s for s, _ in losses(out)] == list(range(1, MAX_STEPS + 1))
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished", record
    assert ckpt_check(out).returncode == 0
