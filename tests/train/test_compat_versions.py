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
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from jit_helpers import assert_stop_checkpoint, ckpt_check, losses, run_and_signal, run_logged
from transformers_overlay import PIP_TIMEOUT_S
from transformers_overlay import overlay as _overlay

from slurm_jit.train import compat, stop_record

MAX_STEPS = 8
HELPERS = Path(__file__).resolve().parents[1] / "helpers"  # the overlay race imports transformers_overlay from it
ARGS = ["--max-steps", str(MAX_STEPS), "--kill-wait", "0", "--step-sleep", "0.1", "--save-steps", "3"]


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
    ckpt = assert_stop_checkpoint(out, stopped, save_steps=int(ARGS[ARGS.index("--save-steps") + 1]))
    # written by the ranks' transformers (save_pretrained stamps its version into the model config)
    assert json.loads((ckpt / "config.json").read_text())["transformers_version"] == version
    resumed = run_logged(out, [*ARGS, "--resume"], env=env)
    assert resumed.codes == [0, 0], resumed.log[-4000:]
    assert f"resuming from {ckpt} " in resumed.log, resumed.log[-4000:]
    assert [s for s, _ in losses(out)] == list(range(1, MAX_STEPS + 1))
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished", record
    assert ckpt_check(out).returncode == 0


OVERLAY_RACE = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from transformers_overlay import overlay
init = overlay(sys.argv[2]) / "transformers" / "__init__.py"
print(os.stat(init).st_ino, flush=True)
"""


@pytest.mark.slow  # a pip install: not in the fast subset
@pytest.mark.timeout(PIP_TIMEOUT_S + 60)
def test_concurrent_runs_install_the_overlay_once_and_never_replace_it_under_each_other(tmp_path: Path) -> None:
    """Two runs on one machine (two worktrees, two CI jobs) start with an empty cache (~15 s: one pip install).
    Before: both installed, and the later one deleted and replaced the overlay the first run's ranks were
    importing; the .partial of a killed run stayed in the cache forever."""
    cache = tmp_path / "cache"
    (cache / ".transformers-0.0.partial-1" / "transformers").mkdir(parents=True)  # left by a killed run
    env = {**os.environ, "SLURM_JIT_TEST_CACHE": str(cache)}
    command = [sys.executable, "-c", OVERLAY_RACE, str(HELPERS), compat.LOWEST_TRANSFORMERS]
    runs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    try:
        outputs = [run.communicate(timeout=PIP_TIMEOUT_S) for run in runs]
    finally:
        for run in runs:
            run.kill()  # no-op on an exited one; a hung install must not outlive the test
    if any("Skipped" in err for _, err in outputs):
        pytest.skip(f"cannot install transformers=={compat.LOWEST_TRANSFORMERS}: {outputs[0][1].strip()[-300:]}")
    assert [run.returncode for run in runs] == [0, 0], outputs
    final = os.stat(cache / f"transformers-{compat.LOWEST_TRANSFORMERS}" / "transformers" / "__init__.py").st_ino
    assert [int(out) for out, _ in outputs] == [final, final], (outputs, final)
    assert not list(cache.glob(".transformers-*.partial-*")), list(cache.iterdir())
