"""The file system refusing a write in the middle of saving (read-only, quota, full) is one line with a HINT, and
nothing already saved is lost: EROFS in the middle of a save and ENOSPC at ``stop.json`` on real tmpfs mounts with a
real single-process JitTrainer (~10 s each); EDQUOT inside ``torch.save`` through the save guard.

EDQUOT cannot be made real here: this kernel's tmpfs has no ``quota`` option and its ext4 no quota format
(QFMT_V2), and btrfs-progs is not installed. So a small LD_PRELOAD shim answers EDQUOT at the ``write``/``writev``
boundary once a byte budget under one directory is spent, as a quota does; ``torch.save`` and the guard's own test
write are real and go through it, in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from disk_helpers import assert_one_line, fill

from slurm_jit.checkpoint import protocol
from slurm_jit.train import save_errors, stop_record

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")

MOUNT_TIMEOUT_S = 60
TMPFS_BYTES = 64 * 1024 * 1024  # a tiny GPT-2's checkpoints take a few MiB
RECORD_TMPFS_BYTES = 256 * 1024
SHIM_TIMEOUT_S = 120  # a subprocess that imports torch


def _mount(path: Path, size_bytes: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], check=True,
                   timeout=MOUNT_TIMEOUT_S)


@pytest.fixture
def two_mounts(tmp_path: Path) -> Iterator[Path]:
    """``out`` on one tmpfs and ``out/slurm-jit`` (stop record, timing log, output lock) on another, so that each
    can be made read-only or full while the other one still takes the trainer's writes."""
    root = tmp_path / "fs"
    out = root / "out"
    _mount(root, TMPFS_BYTES)
    try:
        _mount(out / "slurm-jit", RECORD_TMPFS_BYTES)
        yield out
    finally:
        subprocess.run(["umount", "-l", str(out / "slurm-jit")], check=False, timeout=MOUNT_TIMEOUT_S)
        subprocess.run(["umount", "-l", str(root)], check=False, timeout=MOUNT_TIMEOUT_S)


def _trainer(out: Path, callback: object, max_steps: int = 3) -> object:
    import transformers

    from slurm_jit import demo_train
    from slurm_jit.train.trainer import JitConfig, JitTrainer

    targs = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=max_steps,
                                           save_steps=1, per_device_train_batch_size=2, disable_tqdm=True)
    return JitTrainer(model=demo_train.build_model("gpt2", 16, 1), args=targs,
                      train_dataset=demo_train._Tokens(8, seed=1), callbacks=[callback],
                      jit_config=JitConfig(kill_wait_s=0))


def test_a_file_system_turning_read_only_in_the_middle_of_a_save_is_one_line_and_keeps_the_earlier_checkpoint(
        two_mounts: Path) -> None:
    import transformers

    out, root = two_mounts, two_mounts.parent

    class ReadOnlyMidSave(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == 2:  # the files are written, the manifest is not: remount under the save
                subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True, timeout=MOUNT_TIMEOUT_S)

    trainer = _trainer(out, ReadOnlyMidSave())
    with pytest.raises(save_errors.CheckpointWriteError) as caught:
        trainer.train()  # type: ignore[attr-defined]
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert_one_line(str(caught.value), "checkpoint-2", "Read-only file system (EROFS)", "read-only")
    assert (out / "checkpoint-2" / protocol.SENTINEL_NAME).exists()  # the failed save stays incomplete
    resolution = protocol.find_resumable(out, deep=True)
    assert resolution.checkpoint is not None and resolution.checkpoint.path.name == "checkpoint-1"
    assert json.loads(stop_record.path(out).read_text())["state"] == "failed"  # recorded on the writable mount


def test_enospc_writing_stop_json_after_a_jit_checkpoint_is_one_line_and_the_checkpoint_stays_complete(
        two_mounts: Path) -> None:
    import transformers

    out = two_mounts

    class SignalThenFillTheRecordDisk(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == 2:
                fill(out / "slurm-jit")  # the JIT checkpoint goes to the other mount; stop.json finds it full
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = _trainer(out, SignalThenFillTheRecordDisk(), max_steps=50)
    with pytest.raises(save_errors.CheckpointWriteError) as caught:  # stop_record.StopRecordError: one line
        trainer.train()  # type: ignore[attr-defined]
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    resolution = protocol.find_resumable(out, deep=True)
    ckpt = resolution.checkpoint
    assert ckpt is not None and ckpt.kind == "jit" and ckpt.status is protocol.Status.COMPLETE, resolution
    assert type(caught.value).__name__ == "StopRecordError"
    assert_one_line(str(caught.value), "stop.json", "No space left on device (ENOSPC)",
                     f"{ckpt.path} is complete", "free space")
    assert stop_record.read(out)["state"] == "running"  # type: ignore[index]  # the record before, whole
    assert not stop_record.path(out).with_suffix(".tmp").exists()  # no half-written temporary left


SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

static long long spent;

/* Bytes a write of n may still put under QUOTA_DIR, as a quota answers: all of them, a short write up to the
   limit, or 0 (EDQUOT); -1 for a file elsewhere. */
static long long room(int fd, size_t n) {
    const char *dir = getenv("QUOTA_DIR"), *budget = getenv("QUOTA_BYTES");
    char link[64], target[PATH_MAX];
    if (!dir || !budget) return -1;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t len = readlink(link, target, sizeof target - 1);
    if (len < 0) return -1;
    target[len] = 0;
    if (strncmp(target, dir, strlen(dir)) != 0) return -1;
    long long left = atoll(budget) - spent;
    return left <= 0 ? 0 : (left < (long long)n ? left : (long long)n);
}

ssize_t write(int fd, const void *buf, size_t n) {
    static ssize_t (*real)(int, const void *, size_t);
    if (!real) real = dlsym(RTLD_NEXT, "write");
    long long ok = room(fd, n);
    if (ok == 0 && n > 0) { errno = EDQUOT; return -1; }
    ssize_t done = real(fd, buf, ok < 0 ? n : (size_t)ok);
    if (ok >= 0 && done > 0) spent += done;
    return done;
}

ssize_t writev(int fd, const struct iovec *iov, int count) {
    static ssize_t (*real)(int, const struct iovec *, int);
    size_t n = 0;
    if (!real) real = dlsym(RTLD_NEXT, "writev");
    for (int i = 0; i < count; i++) n += iov[i].iov_len;
    long long ok = room(fd, n);
    if (ok < 0) return real(fd, iov, count);
    if (ok == 0 && n > 0) { errno = EDQUOT; return -1; }
    if ((size_t)ok < n) return write(fd, iov[0].iov_base, iov[0].iov_len);  /* a short write */
    ssize_t done = real(fd, iov, count);
    if (done > 0) spent += done;
    return done;
}
"""

SAVE_UNDER_GUARD = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from slurm_jit.train import save_errors
    ckpt = Path(sys.argv[1])
    try:
        with save_errors.disk_full_is_one_line(ckpt):
            torch.save({"exp_avg": torch.zeros(1024 * 1024)}, ckpt / "optimizer.pt")  # 4 MiB over a 1 MiB quota
    except save_errors.CheckpointWriteError as exc:
        print(exc)
        sys.exit(1)
""")


def test_edquot_inside_torch_save_is_one_line_with_a_quota_hint(tmp_path: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler for the EDQUOT shim")
    shim = tmp_path / "edquot.so"
    (tmp_path / "edquot.c").write_text(SHIM_C)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "edquot.c"), "-ldl"], check=True,
                   timeout=SHIM_TIMEOUT_S)
    out = tmp_path / "out"
    earlier = out / "checkpoint-1"
    earlier.mkdir(parents=True)
    (earlier / "kept.bin").write_bytes(b"saved before")
    ckpt = out / "checkpoint-2"
    ckpt.mkdir()
    env = {**os.environ, "LD_PRELOAD": str(shim), "QUOTA_DIR": str(ckpt), "QUOTA_BYTES": str(1024 * 1024)}
    proc = subprocess.run([sys.executable, "-c", SAVE_UNDER_GUARD, str(ckpt)], env=env, capture_output=True,
                          text=True, timeout=SHIM_TIMEOUT_S)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    message = proc.stdout.strip()
    assert_one_line(message, "checkpoint-2", "Disk quota exceeded (EDQUOT)", "quota")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (earlier / "kept.bin").read_bytes() == b"saved before"
    assert not (ckpt / save_errors.PROBE_NAME).exists()  # the guard's test write is gone


def test_a_read_only_file_system_at_setting_aside_an_earlier_run_s_checkpoint_is_one_line_and_keeps_it(
        two_mounts: Path) -> None:
    import transformers

    out, root = two_mounts, two_mounts.parent
    _trainer(out, transformers.TrainerCallback(), max_steps=2).train()  # type: ignore[attr-defined]
    earlier = (out / "checkpoint-2" / protocol.MANIFEST_NAME).read_bytes()

    class ReadOnlyBeforeTheResave(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == 2:  # a rollback run about to save step 2 again: its first write is a rename
                subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True, timeout=MOUNT_TIMEOUT_S)

    trainer = _trainer(out, ReadOnlyBeforeTheResave(), max_steps=2)
    with pytest.raises(save_errors.CheckpointWriteError) as caught:
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))  # type: ignore[attr-defined]
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert_one_line(str(caught.value), "checkpoint-2", "could not be set aside", "Read-only file system (EROFS)",
                     "untouched")
    assert (out / "checkpoint-2" / protocol.MANIFEST_NAME).read_bytes() == earlier
    assert not list(out.glob("checkpoint-2.*"))
    resolution = protocol.find_resumable(out, deep=True)
    assert resolution.checkpoint is not None and resolution.checkpoint.path.name == "checkpoint-2"


def test_a_failure_whose_stop_record_finds_the_disk_full_logs_that_in_one_line_with_one_prefix(
        two_mounts: Path, caplog: pytest.LogCaptureFixture) -> None:
    import transformers

    out = two_mounts

    class FillTheRecordDiskThenFail(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == 1:
                fill(out / "slurm-jit")
                raise RuntimeError("a user's callback failed")

    trainer = _trainer(out, FillTheRecordDiskThenFail())
    with caplog.at_level("ERROR"), pytest.raises(RuntimeError, match="a user's callback failed"):
        trainer.train()  # type: ignore[attr-defined]
    said = [r.getMessage() for r in caplog.records if "stop.json" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert_one_line(said[0], "(failed) could not be written", "No space left on device (ENOSPC)")
    assert said[0].count("slurm_jit:") == 1, said[0]
