"""Crafted checkpoint directories for the protocol tests: whole or broken, in milliseconds, without torch.

The files have the layout and headers the structural checks read (a ``torch.save``-like zip with a data.pkl, a
safetensors header whose tensors end at the end of the file, JSON), written through the real protocol writer when a
manifest is wanted. The content is not loadable by torch: nothing here trains or resumes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_jit.checkpoint import protocol
from slurm_jit.faults import security
from slurm_jit.launch import ckpt_check_command

TENSOR_BYTES = 16  # one small tensor in model.safetensors
CHECK_TIMEOUT_S = 10.0  # a hang detector: a crafted directory is checked in milliseconds


def torch_like_zip(path: Path, payload: bytes = b"\x80\x02}q\x00.") -> None:
    """A zip laid out like ``torch.save`` output (archive/data.pkl holds an empty dict pickle, never read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", payload)
        archive.writestr("archive/version", "3\n")


def write_evil_pt(path: Path, marker: Path) -> Path:
    """A zip laid out like ``torch.save`` output whose data.pkl touches ``marker`` when unpickled."""
    security.write_evil(path, marker)
    return path


def safetensors(path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, TENSOR_BYTES]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * TENSOR_BYTES)


def write_files(ckpt: Path, step: int, *, world: int = 1, deepspeed: bool = False, tag: str | None = None,
                model_only: bool = False, trainer_state: dict[str, Any] | None = None) -> None:
    """The files a Trainer (plain or under DeepSpeed ZeRO-2) writes into ``checkpoint-<step>``."""
    ckpt.mkdir(parents=True, exist_ok=True)
    state = {"global_step": step, "log_history": []} if trainer_state is None else trainer_state
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "config.json").write_text('{"model_type": "gpt2"}')
    if model_only and deepspeed:
        return  # save_only_model under DeepSpeed: Trainer writes no weights outside the engine
    safetensors(ckpt / "model.safetensors")
    if model_only:
        return
    for rank in range(world):
        torch_like_zip(ckpt / ("rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"))
    torch_like_zip(ckpt / "scheduler.pt")
    if not deepspeed:
        torch_like_zip(ckpt / "optimizer.pt")
        return
    tag = tag or f"global_step{step}"
    (ckpt / "latest").write_text(tag)
    torch_like_zip(ckpt / tag / "mp_rank_00_model_states.pt")
    for rank in range(world):
        torch_like_zip(ckpt / tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


def checkpoint(out: Path, step: int, *, manifest: bool = True, created: float | None = None,
               mtime: float | None = None, world: int = 1, deepspeed: bool = False, tag: str | None = None,
               model_only: bool = False, **extra: Any) -> Path:
    """``out/checkpoint-<step>``, whole; with a manifest written by the real protocol writer unless told not.

    ``created`` sets the manifest's time, ``mtime`` the directory's (both: seconds since the epoch); ``extra``
    goes into the manifest (``run_id``, ``contents``, or any field to override).
    """
    ckpt = out / f"checkpoint-{step}"
    if manifest:
        protocol.write_sentinel(ckpt, step, "periodic")
    write_files(ckpt, step, world=world, deepspeed=deepspeed, tag=tag, model_only=model_only)
    if manifest:
        fields = dict(extra)
        if created is not None:
            fields["created"] = created
        protocol.write_manifest(
            ckpt, step=step, kind="periodic", world_size=world, zero_stage=2 if deepspeed else None,
            deepspeed_tag=(tag or f"global_step{step}") if deepspeed and not model_only else None,
            files=protocol.file_entries(ckpt, protocol.payload_files(ckpt)), extra=fields)
    if mtime is not None:
        os.utime(ckpt, (mtime, mtime))
    return ckpt


def edit_manifest(ckpt: Path, **changes: Any) -> None:
    path = ckpt / protocol.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


# ---------------------------------------------------------------- ckpt-check in-process, bounded in time


@dataclass(frozen=True)
class CheckRun:
    code: int
    stdout: bytes
    stderr: str

    @property
    def last_line(self) -> bytes:
        assert self.stdout.endswith(b"\n"), self.stdout
        return self.stdout.splitlines()[-1] if self.stdout.strip(b"\n") else b""


class Hung(BaseException):
    """ckpt-check did not return within its time bound (a BaseException: no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Raise Hung in the main thread after ``seconds`` (interrupts a blocking open() or read(): PEP 475)."""
    def expire(_signum: int, _frame: object) -> None:
        raise Hung(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_ckpt_check(*argv: object, timeout_s: float = CHECK_TIMEOUT_S) -> CheckRun:
    """The ``ckpt-check`` command's main (launch/ckpt_check_command.py) in this process with a strict UTF-8 stdout
    and stderr (PYTHONIOENCODING=utf-8:strict)."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    code: int | str | None = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), time_bound(timeout_s):
        try:
            ckpt_check_command.main([os.fspath(a) if isinstance(a, Path) else str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code
    assert isinstance(code, int), code
    return CheckRun(code=code, stdout=out.buffer.getvalue(),  # type: ignore[attr-defined]
                    stderr=err.buffer.getvalue().decode("utf-8"))  # type: ignore[attr-defined]
