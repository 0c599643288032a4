"""Shared fixtures: real checkpoints written by real DeepSpeed ranks (tiny GPT-2 from a config, 2 CPU ranks)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_jit import local_ranks, slurm

LOCAL_SLURM = Path(__file__).resolve().parents[1] / "tools" / "local-slurm"
CLUSTER_UP_TIMEOUT_S = 300  # a fresh CI machine apt-installs slurm-wlm and munge first; then up waits <= 60 s

RANK_TIMEOUT_S = 300  # the first DeepSpeed start on a fresh machine builds its CPU comm op (~80 s on 2 cores)


def run_ranks(out_dir: Path, *train_args: str, world_size: int = 2, env: dict[str, str] | None = None,
              timeout_s: float = RANK_TIMEOUT_S) -> list[int | None]:
    """Run slurm_jit.demo_train on ``world_size`` local ranks to the end; returns their exit codes."""
    ranks = local_ranks.start(["-m", "slurm_jit.demo_train", "--output-dir", str(out_dir), *train_args],
                              world_size, out_dir.parent / f"logs-{out_dir.name}", env=env)
    return ranks.wait(timeout_s)


def logs_of(out_dir: Path) -> str:
    log_dir = out_dir.parent / f"logs-{out_dir.name}"
    return "\n".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("rank*.log")))


@pytest.fixture(scope="session")
def plain_zero2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUT_DIR of a plain transformers.Trainer run, ZeRO-2, 2 ranks: checkpoint-3 and checkpoint-6, no manifest."""
    out = tmp_path_factory.mktemp("plain") / "out"
    codes = run_ranks(out, "--trainer", "plain", "--max-steps", "6", "--save-steps", "3")
    assert codes == [0, 0], logs_of(out)
    return out


@pytest.fixture(scope="session")
def jit_zero2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUT_DIR of a JitTrainer run, ZeRO-2, 2 ranks: periodic checkpoint-3, final checkpoint-6, with manifests."""
    out = tmp_path_factory.mktemp("jit") / "out"
    codes = run_ranks(out, "--max-steps", "6", "--save-steps", "3")
    assert codes == [0, 0], logs_of(out)
    return out


@pytest.fixture
def copy_run(tmp_path: Path):
    """Copy a session run's OUT_DIR into this test's tmp_path, so that the test may break it."""

    def copy(src: Path) -> Path:
        dst = tmp_path / "out"
        shutil.copytree(src, dst, symlinks=True)
        return dst

    return copy



def ensure_cluster() -> None:
    """``tools/local-slurm up`` (idempotent); skip when the cluster cannot come up, fail instead under ``CI``."""
    try:
        proc = subprocess.run([str(LOCAL_SLURM), "up"], capture_output=True, text=True,
                              timeout=CLUSTER_UP_TIMEOUT_S, check=False)
        message = (proc.stderr or proc.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        message = str(exc)
    if not slurm.available():
        message = f"local Slurm cluster not up: {message}"
        if "HINT:" not in message:
            message += ". HINT: run tools/local-slurm up as root"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def slurm_cluster() -> None:
    """The real local cluster, up."""
    ensure_cluster()


@pytest.fixture
def jobs() -> Iterator[list[str]]:
    """Job ids to scancel after the test, whatever happens."""
    ids: list[str] = []
    yield ids
    for job_id in ids:
        try:
            slurm.cancel(job_id)
        except slurm.SlurmError:
            pass  # already gone
