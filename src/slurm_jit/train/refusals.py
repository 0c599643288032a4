"""What the JitTrainer refuses, each as one line with a HINT: settings the checkpoint protocol cannot honour
(checked at ``__init__``) and checkpoints that cannot be resumed exactly (checked before any training).

Pure functions of their inputs (the checkpoint directory is read, never written), so that tests can call them.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from slurm_jit.checkpoint import elastic_plan, protocol, reseal
from slurm_jit.checkpoint import manifest as manifest_file

LATEST_TAG_MAX_BYTES = 256  # DeepSpeed's `latest` holds one tag such as "global_step1234"


class JitRefusal(ValueError):
    """A setting or a checkpoint the JitTrainer cannot work with; the message is one line with a HINT."""


# The launchers (launch/submit.py, JitExecutor, sbatch/) export their --output-dir: the directory whose stop record
# and checkpoints the requeue decision reads. A training that writes elsewhere would never be requeued from its own.
OUTPUT_DIR_ENV = "SLURM_JIT_OUTPUT_DIR"


OUTPUT_DIR_FLAGS = ("--output_dir", "--output-dir")  # HfArgumentParser's TrainingArguments, and argparse style


def command_output_dir(argv: list[str]) -> str | None:
    """The output directory a training command gives its script (``--output_dir X`` or ``--output_dir=X``; the last
    one wins, as with argparse), or None."""
    found = None
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in OUTPUT_DIR_FLAGS:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def output_dir_at_construction(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """``JitTrainer(*args, **kwargs)`` (the TrainingArguments second, as for ``Trainer``): :func:`output_dir_of_job`
    before upstream creates the directory, as the one line to raise."""
    targs = kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None)
    output_dir = getattr(targs, "output_dir", None)
    refusal = output_dir_of_job(str(output_dir)) if output_dir is not None else None
    return f"slurm_jit: {refusal}" if refusal else None


def output_dir_of_job(output_dir: str) -> str | None:
    """:func:`output_dir_refusal` against the launcher's directory of this job (``OUTPUT_DIR_ENV``), if any."""
    return output_dir_refusal(output_dir, os.environ.get(OUTPUT_DIR_ENV))


def output_dir_refusal(output_dir: str, launcher_dir: str | None) -> str | None:
    """Why ``TrainingArguments.output_dir`` cannot be this job's (the launcher's is another directory), or None."""
    if not launcher_dir:
        return None
    if output_dir and os.path.realpath(os.path.abspath(output_dir)) == os.path.realpath(os.path.abspath(launcher_dir)):
        return None
    return (f"output_dir {output_dir!r} is not the launcher's --output-dir {launcher_dir!r}: the requeue reads the "
            f"stop record and checkpoints of the launcher's. HINT: give the script --output_dir {launcher_dir} (or "
            f"the launcher --output-dir {output_dir or 'DIR'}); outside a slurm-jit job: unset {OUTPUT_DIR_ENV}")


def refused_settings(*, save_on_each_node: bool, ds_config: dict[str, Any] | None) -> str | None:
    """Why these Trainer/DeepSpeed settings cannot go with the checkpoint protocol, or None."""
    if save_on_each_node:
        return ("save_on_each_node=True: the checkpoint protocol needs one checkpoint directory that every rank "
                "sees (rank 0 writes the manifest of every rank's files); with node-local storage the other "
                "nodes' files are not there. HINT: save_on_each_node=False with output_dir on shared storage")
    checkpoint = (ds_config or {}).get("checkpoint")
    checkpoint = checkpoint if isinstance(checkpoint, dict) else {}
    writer = checkpoint.get("writer")
    if isinstance(writer, dict) and writer.get("decoupled"):
        return ("DeepSpeed checkpoint.writer.decoupled=true: the decoupled engine commits its files after "
                "save_checkpoint returns, so a manifest would be written before the data. HINT: remove "
                "checkpoint.writer (or set decoupled=false) in the DeepSpeed config")
    if (ds_config or {}).get("datastates_ckpt", False) is not False:
        return ("DeepSpeed datastates_ckpt: the DataStates engine persists its files after save_checkpoint "
                "returns, so a manifest would be written before the data. HINT: remove datastates_ckpt from "
                "the DeepSpeed config")
    if checkpoint.get("use_node_local_storage"):
        return ("DeepSpeed checkpoint.use_node_local_storage=true: each node writes its shards to its own "
                "storage, which rank 0 cannot list in the manifest. HINT: remove use_node_local_storage and "
                "put output_dir on shared storage")
    return None


def _read_latest_tag(ckpt_dir: Path, name: str = "latest") -> str | None:
    """The DeepSpeed tag in ``latest`` (or ``name``; a regular file only, bounded read), or None when there is none."""
    path = ckpt_dir / name
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        return os.read(fd, LATEST_TAG_MAX_BYTES).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)


def _broken(path: Path, match: re.Match[str] | None) -> str | None:
    """Why the protocol calls this checkpoint incomplete or corrupt, or None (an explicit path is checked too)."""
    if match is None:  # not named checkpoint-<step>: the step is unknown; the sentinel still says "unfinished"
        sentinel = path / protocol.SENTINEL_NAME
        return f"{protocol.SENTINEL_NAME} present" if sentinel.exists() or sentinel.is_symlink() else None
    info = protocol.inspect(path, int(match.group(1)))
    if info.status in (protocol.Status.INCOMPLETE, protocol.Status.CORRUPT):
        return f"{info.status.value} ({info.reason})"
    return None


def resume_refusal(ckpt_dir: str | os.PathLike[str], *, world_size: int) -> str | None:
    """Why this checkpoint cannot be resumed exactly by a run of ``world_size`` ranks, or None."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        return (f"{path}: no such checkpoint directory. HINT: pass an existing checkpoint-<step> directory, or "
                "resume_from_checkpoint=True to resume from the newest resumable one in output_dir")
    match = protocol.CHECKPOINT_RE.fullmatch(path.name)
    manifest = None
    if (path / protocol.MANIFEST_NAME).is_file():
        manifest, _ = manifest_file.read(path)
    on_world = elastic_plan.plan(path, world_size, manifest)
    if not on_world.resumable:
        return on_world.reason
    if manifest is not None:
        if manifest.get("contents") == "model_only":
            return (f"{path}: holds the model only (a save_only_model save): no optimizer, scheduler or RNG "
                    "state to resume from. HINT: resume from a checkpoint whose manifest says contents=full "
                    "(ckpt-check OUT_DIR), or load these weights with from_pretrained in a new run")
    tag = _read_latest_tag(path)
    if match is not None and tag is not None and tag != f"global_step{match.group(1)}":
        return (f"{path}: DeepSpeed tag {tag!r} is not global_step{match.group(1)}: the engine state is of "
                "another step (transformers' enable_jit_checkpoint saves step S+1's engine as checkpoint-S), "
                "and every later JIT save would be refused. HINT: resume from an earlier checkpoint whose tag "
                "matches its step (ckpt-check OUT_DIR), or move this one aside")
    broken = _broken(path, match)
    if broken and reseal.changed_after_manifest(path, manifest):
        return (f"{path}: {broken}: its files are not the ones its manifest lists. HINT: if you changed it on "
                f"purpose (resharded, converted): ckpt-check --reseal {path}; else resume from the checkpoint "
                "ckpt-check OUT_DIR names, or resume_from_checkpoint=True")
    if broken:
        return (f"{path}: {broken}: resuming it would load a partial or damaged state. HINT: resume from the "
                "checkpoint ckpt-check OUT_DIR names, or resume_from_checkpoint=True")
    return None
