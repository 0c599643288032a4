"""Shared fixtures: real checkpoints written by real DeepSpeed ranks (tiny GPT-2 from a config, 2 CPU ranks)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from jit_helpers import run_to_end

from slurm_jit import slurm

LOCAL_SLURM = Path(__file__).resolve().parents[1] / "tools" / "local-slurm"
CLUSTER_UP_TIMEOUT_S = 300  # a fresh CI machine apt-installs slurm-wlm and munge first; then up waits <= 60 s



def _logs_of(out_dir: Path) -> str:
    log_dir = out_dir.parent / f"logs-{out_dir.name}"
    return "\n".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("rank*.log")))


def flip_middle_byte(path: Path, mask: int = 0x01) -> None:
    """Damage a file without changing its size: only a checksum can tell."""
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= mask
    path.write_bytes(bytes(blob))


@pytest.fixture(scope="session")
def plain_zero2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUT_DIR of a plain transformers.Trainer run, ZeRO-2, 2 ranks: checkpoint-3 and checkpoint-6, no manifest."""
    out = tmp_path_factory.mktemp("plain") / "out"
    codes = run_to_end(out, ["--trainer", "plain", "--max-steps", "6", "--save-steps", "3"])
    assert codes == [0, 0], _logs_of(out)
    return out


@pytest.fixture(scope="session")
def jit_zero2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUT_DIR of a JitTrainer run, ZeRO-2, 2 ranks: periodic checkpoint-3, final checkpoint-6, with manifests."""
    out = tmp_path_factory.mktemp("jit") / "out"
    codes = run_to_end(out, ["--max-steps", "6", "--save-steps", "3"])
    assert codes == [0, 0], _logs_of(out)
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
