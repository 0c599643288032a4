"""Each job start's own copy of DeepSpeed's built ops (launch/ops.py): what is copied, what a job's build publishes
to the shared directory, which copies a node removes. Real directories laid out as torch's builder leaves them; the
job that loads from a copy past a real lock is tests/integration/test_ops_copy_on_slurm.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

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
