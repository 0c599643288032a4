"""Each job start's own copy of DeepSpeed's built ops (launch/ops.py): what is copied, what a job's build publishes
to the shared directory, which copies a node removes. Real directories laid out as torch's builder leaves them; the
job that loads from a copy past a real lock is tests/integration/test_ops_copy_on_slurm.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import disk_helpers
import pytest
import unprivileged

from slurm_jit.launch import ops

OP = ops.CPU_COMM_OP


def built_op(root: Path, name: str = OP, mtime_s: float | None = None) -> Path:
    """An op directory as a finished build leaves it: sources' objects, the library, ninja's files."""
    op = root / name
    op.mkdir(parents=True)
    for file in ("build.ninja", ".ninja_log", ".ninja_deps", "shm.o", f"{name}.so"):
        (op / file).write_bytes(file.encode())
        if mtime_s is not None:
            os.utime(op / file, (mtime_s, mtime_s))
    return op


@pytest.fixture
def world_traversable_tmp() -> Iterator[Path]:
    """A directory user nobody may enter (pytest's tmp_path sits under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="ops-copy-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def test_the_copy_leaves_the_lock_out_and_keeps_file_times(tmp_path: Path) -> None:
    an_hour_ago = time.time() - 3600
    built_op(tmp_path / "shared", mtime_s=an_hour_ago)
    (tmp_path / "shared" / OP / ops.LOCK).touch()  # a build of another job, in flight or cut off
    made, skipped = ops.job_copy(tmp_path / "shared", tmp_path / "copies" / "7.0")
    assert made and skipped == []
    copy = tmp_path / "copies" / "7.0" / OP
    assert not (copy / ops.LOCK).exists()
    theirs = tmp_path / "shared" / OP / f"{OP}.so"
    assert (copy / f"{OP}.so").stat().st_mtime_ns == theirs.stat().st_mtime_ns  # ninja's "no work to do" reads them
    assert ops.job_copy(tmp_path / "shared", tmp_path / "copies" / "7.0") == (False, [])  # the node's one copy


def test_an_op_built_by_the_job_is_published_where_the_shared_dir_has_none(tmp_path: Path) -> None:
    shared, copy = tmp_path / "shared", tmp_path / "copies" / "7.0"
    built_op(shared, mtime_s=time.time() - 3600)
    ops.job_copy(shared, copy)
    time.sleep(0.01)
    built_op(copy, "cpu_adam")  # built by the job's ranks, after the copy
    assert ops.publish(copy, shared) == (["cpu_adam"], [])
    assert (shared / "cpu_adam" / "cpu_adam.so").read_bytes() == b"cpu_adam.so"
    assert not list(shared.glob(".*.tmp"))
    assert ops.publish(copy, shared) == ([], ["cpu_adam"])  # now the shared one is there: never overwritten


def test_an_op_rebuilt_in_the_copy_is_said_and_the_shared_one_left(tmp_path: Path) -> None:
    shared, copy = tmp_path / "shared", tmp_path / "copies" / "7.0"
    built_op(shared, mtime_s=time.time() - 3600)
    ops.job_copy(shared, copy)
    time.sleep(0.01)
    (copy / OP / f"{OP}.so").write_bytes(b"rebuilt by another ninja")
    assert ops.publish(copy, shared) == ([], [OP])
    assert (shared / OP / f"{OP}.so").read_bytes() == f"{OP}.so".encode()


def test_a_build_cut_off_in_the_copy_is_not_published(tmp_path: Path) -> None:
    shared, copy = tmp_path / "shared", tmp_path / "copies" / "7.0"
    shared.mkdir()
    ops.job_copy(shared, copy)
    time.sleep(0.01)
    (built_op(copy) / ops.LOCK).touch()
    assert ops.publish(copy, shared) == ([], [])
    assert not (shared / OP).exists()


def test_a_node_removes_the_copies_of_jobs_no_longer_running(tmp_path: Path) -> None:
    for name in ("5.0", "5.1", "6.0", ".8.123.tmp"):
        (tmp_path / name).mkdir()
    assert sorted(p.name for p in ops.prune_copies(tmp_path, {"6"})) == ["5.0", "5.1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".8.123.tmp", "6.0"]


def test_the_shared_dir_is_the_one_torch_builds_in() -> None:
    from torch.utils import cpp_extension

    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    saved = os.environ.pop("TORCH_EXTENSIONS_DIR", None)
    try:
        theirs = Path(cpp_extension._get_build_directory(OP, verbose=False)).parent
    finally:
        if saved is not None:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved
    assert ops.torch_build_root(env) == theirs
    assert ops.torch_build_root({**env, "TORCH_EXTENSIONS_DIR": "/x/ext"}) == Path("/x/ext")


def test_a_file_gone_under_every_try_leaves_its_op_to_the_job_and_copies_the_rest(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    built_op(shared)
    (built_op(shared, "cpu_adam") / "adam.o").symlink_to(tmp_path / "removed by the build")  # ENOENT at each copy
    made, skipped = ops.job_copy(shared, tmp_path / "copies" / "7.0")
    assert made and skipped == ["cpu_adam"]
    assert (tmp_path / "copies" / "7.0" / OP / f"{OP}.so").is_file()


# --- where the copy cannot be made: every rank of the node loads from the shared directory at once ---------------
# One rank of a job start, as runner.task_main starts it: prints where it loads the ops from and how long it took.
RANK = """
import os, time
from slurm_jit.launch import runner
runner.OPS_COPY_WAIT_S = 30  # bounds the test where the ranks would wait for a copy that never comes
started = time.monotonic()
runner._load_ops_from_own_copy(os.environ, "7", 0)
print(os.environ["TORCH_EXTENSIONS_DIR"], round(time.monotonic() - started, 1))
"""
RANK_DEADLINE_S = 90  # a rank imports the runner in ~2 s on the loaded host; then it waits OPS_COPY_WAIT_S at most
AT_ONCE_S = 5.0  # well under OPS_COPY_WAIT_S: no rank waits for a copy that cannot be made


def world_readable_op(root: Path, library_bytes: int = 4096) -> Path:
    """An op user nobody may read, its library ``library_bytes`` long."""
    shared = root / "shared"
    (built_op(shared) / f"{OP}.so").write_bytes(b"\0" * library_bytes)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return shared


def node_ranks(shared: Path, tmpdir: Path, prefix: list[str]) -> list[tuple[str, float, str]]:
    """The node's two ranks, started together: (where each loads the ops from, seconds it took, its stderr)."""
    env = {**os.environ, "TMPDIR": str(tmpdir), "TORCH_EXTENSIONS_DIR": str(shared), "SLURM_JOB_ID": "7"}
    procs = [subprocess.Popen([*prefix, sys.executable, "-c", RANK], env={**env, "SLURM_LOCALID": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/") for rank in (1, 0)]
    try:
        outs = [proc.communicate(timeout=RANK_DEADLINE_S) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert all(proc.returncode == 0 for proc in procs), outs
    lines = [(out.split(), err) for out, err in reversed(outs)]
    return [(words[0], float(words[1]), err) for words, err in lines]


def assert_all_load_from_shared_at_once(ranks: list[tuple[str, float, str]], shared: Path, why: str) -> None:
    assert [(where, took_s < AT_ONCE_S) for where, took_s, _ in ranks] == [(str(shared), True)] * 2, ranks
    said = [line for _, _, err in ranks for line in err.splitlines()]
    assert len(said) == 1 and why in said[0] and "HINT: point TMPDIR at a writable local disk" in said[0], said
    assert "changed during the copy" not in said[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_tmpdir_is_said_as_full_and_no_rank_takes_half_a_copy(world_traversable_tmp: Path) -> None:
    # Before: ENOSPC counted as "a build in progress": the op was left out of the copy and every rank loaded from
    # that copy, where the job rebuilt the op into the full TMPDIR and failed at its load.
    shared = world_readable_op(world_traversable_tmp, library_bytes=1 << 20)
    with disk_helpers.tmpfs(world_traversable_tmp / "tmp", 256 * 1024) as tmpdir:
        tmpdir.chmod(0o1777)
        ranks = node_ranks(shared, tmpdir, [])
        assert_all_load_from_shared_at_once(ranks, shared, "No space left on device")
        assert sorted(p.name for p in ops.copies_root({"TMPDIR": str(tmpdir)}).iterdir()) == ["7.0.failed"]


@pytest.mark.parametrize("how", ["not writable", "read-only"])
def test_an_unwritable_tmpdir_sends_every_rank_to_the_shared_dir_at_once(world_traversable_tmp: Path,
                                                                         how: str) -> None:
    # Before: the first rank could not copy and said so, the node's other ranks polled OPS_COPY_WAIT_S (120 s)
    # for a copy that never came, then failed the same way.
    shared = world_readable_op(world_traversable_tmp)
    if how == "read-only":
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        with disk_helpers.tmpfs(world_traversable_tmp / "tmp", 256 * 1024, read_only=True) as tmpdir:
            assert_all_load_from_shared_at_once(node_ranks(shared, tmpdir, []), shared, "Read-only file system")
        return
    prefix = unprivileged.prefix()  # root writes anywhere: its ranks run as nobody
    tmpdir = world_traversable_tmp / "tmp"
    tmpdir.mkdir(mode=0o555)
    assert_all_load_from_shared_at_once(node_ranks(shared, tmpdir, prefix), shared, "Permission denied")
