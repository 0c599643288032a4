"""Shared fixtures: real checkpoints written by real DeepSpeed ranks (tiny GPT-2 from a config, 2 CPU ranks),
uninterrupted reference runs, the local Slurm cluster, and the markers and timeouts every test gets."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import jit_helpers
import pytest
import xdist_units
from jit_helpers import losses, run_logged, run_to_end
from multinode_helpers import USE_LINE, local_slurm
from xdist_units import DEEPSPEED_FIXTURES

from slurm_jit import slurm

# No test that fakes Slurm reaches the real cluster from a process it starts (tests/helpers/slurm_guard.py).
pytest_plugins = ["slurm_guard"]

LOCAL_SLURM = Path(__file__).resolve().parents[1] / "tools" / "local-slurm"
CLUSTER_UP_TIMEOUT_S = 300  # a fresh CI machine apt-installs slurm-wlm and munge first; then up waits <= 60 s
# Per-test timeouts (pytest-timeout; setup included, so a session fixture's runs count in the first test that
# needs them). A hang fails one test instead of the CI run. Fast tests take well under a second each; a
# DeepSpeed test runs up to ~4 two-rank trainings (~15 s each idle, ~3x on a loaded 2-core host, plus ~80 s
# to build DeepSpeed's CPU comm op on a fresh machine); a Slurm test may wait CLUSTER_UP_TIMEOUT_S for the
# cluster and a few minutes for a job's cores.
TIMEOUT_FAST_S = 120
# Under tools/test's two workers a fast test runs at nice 10 beside the heavy ones (tests/helpers/xdist_units.py):
# when those take both cores it gets about a tenth of one.
TIMEOUT_FAST_XDIST_S = 600
TIMEOUT_DEEPSPEED_S = 900
TIMEOUT_SLURM_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`deepspeed` on every test that starts DeepSpeed ranks (its own or a fixture's), `slow` on every
    `deepspeed` or `slurm` test (so ``-m "not slow"`` is the fast subset), and a timeout by kind."""
    for item in items:
        if DEEPSPEED_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.deepspeed)
        kinds = {m.name for m in item.iter_markers()}
        if kinds & {"deepspeed", "slurm"}:
            item.add_marker(pytest.mark.slow)
        if "timeout" not in kinds:
            fast_s = TIMEOUT_FAST_XDIST_S if os.environ.get("PYTEST_XDIST_WORKER") else TIMEOUT_FAST_S
            timeout_s = max(fast_s, TIMEOUT_DEEPSPEED_S if "deepspeed" in kinds else 0,
                            TIMEOUT_SLURM_S if "slurm" in kinds else 0)
            item.add_marker(pytest.mark.timeout(timeout_s))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> xdist_units.HeavyFirstScheduling:
    """tools/test's two workers: the heavy files in one unit, first; the others beside them at a low priority."""
    return xdist_units.HeavyFirstScheduling(config, log)  # type: ignore[arg-type]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture (session ones too): the test's priority under the two workers (xdist_units.py)."""
    xdist_units.yield_the_cores(xdist_units.is_heavy_file(Path(item.path)))


@pytest.fixture(autouse=True)
def _no_leftover_ranks() -> Iterator[None]:
    """Ranks a test started and left running (it failed, or pytest-timeout interrupted it) are killed."""
    yield
    jit_helpers.kill_leftover_ranks()


def _logs_of(out_dir: Path) -> str:
    log_dir = out_dir.parent / f"logs-{out_dir.name}"
    return "\n".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("rank*.log")))


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


@pytest.fixture(scope="session")
def reference_losses(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[tuple[int, float]]]:
    """``reference_losses(args)``: per-step losses of an uninterrupted run of demo_train ``args``; each distinct
    argument list runs once per session, whichever tests ask for it."""
    cache: dict[tuple[str, ...], list[tuple[int, float]]] = {}

    def reference(args: list[str]) -> list[tuple[int, float]]:
        key = tuple(args)
        if key not in cache:
            out = tmp_path_factory.mktemp("reference") / "out"
            result = run_logged(out, list(args))
            assert result.codes == [0, 0], result.log[-4000:]
            cache[key] = losses(out)
            assert cache[key], f"reference run {args} logged no losses"
        return cache[key]

    return reference


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


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """The real local cluster, up (checked once per session; a test that takes it down brings it back)."""
    ensure_cluster()


@pytest.fixture
def jobs() -> Iterator[list[str]]:
    """Job ids to scancel after the test, whatever happens. Every job a test submits goes in here."""
    ids: list[str] = []
    yield ids
    for job_id in ids:
        try:
            slurm.cancel(job_id)
        except slurm.SlurmError:
            pass  # already gone


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Path]:
    """``tools/local-slurm up --nodes 2`` (idempotent); the gateway talks to it until the module ends.

    Skips when it cannot come up (not root, no network namespaces), fails instead under ``CI``."""
    try:
        proc = local_slurm("up", "--nodes", "2")
        message = (proc.stderr or proc.stdout).strip()
        confs = [line.removeprefix(USE_LINE) for line in proc.stdout.splitlines() if line.startswith(USE_LINE)]
        up = proc.returncode == 0 and len(confs) == 1
    except (OSError, subprocess.TimeoutExpired) as exc:
        message, up = str(exc), False
    if not up:
        message = f"two-node local Slurm cluster not up: {message}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", confs[0])
        assert slurm.available(), f"{confs[0]}: no controller answers"
        yield Path(confs[0])


@pytest.fixture
def two_node_jobs(two_nodes: Path, jobs: list[str]) -> list[str]:
    """Job ids to scancel on the two-node cluster after the test: conftest's ``jobs``, set up after (so torn
    down before) ``two_nodes``, whose SLURM_CONF is then still in force."""
    return jobs
