"""Does a checkpoint hold everything an exact resume needs? Header checks only, run with and without a manifest.

What a ``transformers.Trainer`` checkpoint must hold to be resumed:

- one RNG state file per rank: ``rng_state.pth`` (world size 1) or ``rng_state_0.pth`` .. ``rng_state_{W-1}.pth``
  (Trainer names them so only when the world size is above 1: a lone ``rng_state_0.pth`` is a run of 2 or more);
- with DeepSpeed: a ``latest`` file naming the tag directory ``global_step<step>`` of this very step (transformers'
  own JIT checkpoint writes ``global_step<step+1>`` into ``checkpoint-<step>``: refused), holding the model states
  (``mp_rank_00_model_states.pt``, or one ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank under ZeRO-3)
  and one optimizer shard ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank;
- without DeepSpeed: model weights and ``optimizer.pt``;
- every ``.pt``/``.pth``/``.bin``/``.safetensors``/``.json`` file passes its header check
  (:mod:`slurm_jit.checkpoint.formats`), and nothing in the tree is a symlink, FIFO, socket or device.

The world size is the one the manifest records when there is one. Without a manifest it is inferred from the
names present (the highest rank named by an RNG state file or a DeepSpeed shard, plus one; at least 2 when the
RNG files are numbered): trainer_state.json does not record it (TrainerState has no world size) and DeepSpeed
records it only inside pickles, which are never unpickled. So a manifest-less checkpoint that lost every file of
its top rank cannot be told from a smaller run's; a manifest can.

A checkpoint written with ``save_only_model`` holds whole weights and no resume state at all: :func:`model_only`.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from slurm_jit.checkpoint import formats

RNG_RE = re.compile(r"rng_state_([0-9]+)\.pth", re.ASCII)
RNG_SINGLE = "rng_state.pth"  # Trainer's name at world size 1
DS_LATEST = "latest"
DS_TAG_RE = re.compile(r"[\w.-]+", re.ASCII)
DS_TAG_PREFIX = "global_step"  # DeepSpeed's default tag, global_step<engine step>, as Trainer saves it
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
OPTIMIZER_FILE = "optimizer.pt"
LATEST_MAX_BYTES = 4096  # 'latest' holds one tag name
# Above any data-parallel run published (tens of thousands of ranks): a rank beyond it is a broken or hostile
# name, never a reason to allocate or loop that far.
MAX_WORLD_SIZE = 1_000_000
SHARD_RE = re.compile(r"(bf16_)?zero_pp_rank_([0-9]+)_mp_rank_[0-9]+_(optim|model)_states\.pt", re.ASCII)
MODEL_STATES = "mp_rank_00_model_states.pt"
# checkpoint-S/universal: the elastic conversion of this checkpoint (train/elastic.py), a checkpoint of its own with
# its own sentinel and manifest; whatever state it is in says nothing about checkpoint-S.
UNIVERSAL_DIR_NAME = "universal"


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _file_entry(path: Path) -> bool:
    """Present and not a directory (a symlink, FIFO, ... counts: the header check reports it)."""
    return os.path.lexists(path) and not real_dir(path)


def real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _shards(tag_dir: Path) -> tuple[set[int], set[int]]:
    """(ranks with an optimizer shard, ranks with a ZeRO-3 model states shard) under one tag directory."""
    optim: set[int] = set()
    model: set[int] = set()
    for name in os.listdir(tag_dir):
        if (m := SHARD_RE.fullmatch(name)) is not None:
            (optim if m.group(3) == "optim" else model).add(int(m.group(2)))
    return optim, model


def _tag_dirs(ckpt_dir: Path) -> list[Path]:
    return [ckpt_dir / name for name in os.listdir(ckpt_dir) if real_dir(ckpt_dir / name)]


def _first_missing(ranks: set[int], world: int) -> int | None:
    """The lowest rank below ``world`` not in ``ranks`` (no allocation sized by ``world``)."""
    present = sorted(r for r in ranks if r < world)
    for expected, rank in enumerate(present):
        if rank != expected:
            return expected
    return len(present) if len(present) < world else None


def _named_ranks(ckpt_dir: Path) -> tuple[set[int], int, str | None]:
    """(RNG file ranks, highest rank named anywhere + 1, what is wrong)."""
    rng = {int(m.group(1)) for name in os.listdir(ckpt_dir) if (m := RNG_RE.fullmatch(name))}
    named = set(rng)
    for tag_dir in _tag_dirs(ckpt_dir):
        optim, model = _shards(tag_dir)
        named |= optim | model
    top = max(named, default=-1)
    if top >= MAX_WORLD_SIZE:
        return rng, 0, f"a file names rank {top}, beyond the sane limit of {MAX_WORLD_SIZE} ranks"
    return rng, top + 1, None


def world_size(ckpt_dir: Path, recorded: int | None = None) -> tuple[int | None, str | None]:
    """(world size, None) or (None, what is wrong): every rank's RNG state file must be there.

    ``recorded``: the manifest's world size; without it the world size is inferred from the names present.
    """
    rng, named_world, why = _named_ranks(ckpt_dir)
    if why:
        return None, why
    if recorded is not None:
        if not 1 <= recorded <= MAX_WORLD_SIZE:
            return None, f"recorded world size {recorded} is not between 1 and {MAX_WORLD_SIZE}"
        if named_world > recorded:
            return None, f"files of rank {named_world - 1} in a checkpoint of {recorded} ranks"
        world = recorded
    else:
        world = max(named_world, 2 if rng else 1)
    # a present name counts here even if it is not a regular file: headers() names what is wrong with it
    if world == 1:
        return (1, None) if _file_entry(ckpt_dir / RNG_SINGLE) else (None, f"no RNG state file ({RNG_SINGLE})")
    missing = _first_missing({r for r in rng if _file_entry(ckpt_dir / f"rng_state_{r}.pth")}, world)
    if missing is not None:
        return None, f"RNG state file of rank {missing} missing ({world} ranks)"
    return world, None


def read_latest(ckpt_dir: Path) -> tuple[str | None, str | None]:
    """(the tag 'latest' names, None) or (None, why it cannot be used)."""
    try:
        raw = formats.read_bounded(ckpt_dir / DS_LATEST, LATEST_MAX_BYTES)
    except (OSError, formats.UntrustedFile):
        return None, "DeepSpeed tag directory without a readable 'latest' file"
    tag = raw.decode("utf-8", errors="replace").strip()
    if not DS_TAG_RE.fullmatch(tag) or tag in (".", ".."):
        return None, f"'latest' names an invalid tag {tag!r}"
    return tag, None


def tag_mismatch(ckpt_dir: Path, step: int) -> str | None:
    """Why the DeepSpeed tag in ``latest`` is not this step's, or None (also when there is no readable tag)."""
    if not _regular(ckpt_dir / DS_LATEST):
        return None
    tag, _ = read_latest(ckpt_dir)
    if tag is None or tag == f"{DS_TAG_PREFIX}{step}":
        return None
    why = f"'latest' names DeepSpeed tag {tag}, not {DS_TAG_PREFIX}{step} of this checkpoint"
    if tag == f"{DS_TAG_PREFIX}{step + 1}":
        why += (". HINT: transformers' enable_jit_checkpoint writes the next step's engine state "
                "(global_step<step+1>) into checkpoint-<step>; resume from an older checkpoint or start fresh")
    return why


def _deepspeed_missing(ckpt_dir: Path, world: int, zero_stage: int | None) -> str | None:
    tag, why = read_latest(ckpt_dir)
    if tag is None:
        return why
    tag_dir = ckpt_dir / tag
    if not real_dir(tag_dir):
        return f"'latest' names {tag}, which is not a directory here"
    optim, model = _shards(tag_dir)
    if zero_stage == 0 and not optim:  # no ZeRO: DeepSpeed keeps the optimizer in the model states file
        return None if _regular(tag_dir / MODEL_STATES) else f"{tag}: no model states file"
    if not _regular(tag_dir / MODEL_STATES) and _first_missing(model, world) is not None:
        return f"{tag}: no model states file"
    missing = _first_missing(optim, world)
    if missing is not None:
        return f"{tag}: optimizer shard of rank {missing} missing ({world} ranks)"
    return None


def has_deepspeed(ckpt_dir: Path) -> bool:
    return os.path.lexists(ckpt_dir / DS_LATEST) or any(
        name.startswith(DS_TAG_PREFIX) for name in os.listdir(ckpt_dir))


def check(ckpt_dir: Path, recorded_world: int | None = None, zero_stage: int | None = None) -> str | None:
    """None when the checkpoint holds everything a resume needs, else the first thing missing or broken.
    ``zero_stage``: the manifest's; under stage 0 (DeepSpeed without ZeRO) the optimizer is in the model states
    file and no rank writes a shard (a bf16 stage-0 run's optimizer does: then every rank's is needed)."""
    world, why = world_size(ckpt_dir, recorded_world)
    if world is None:
        return why
    if has_deepspeed(ckpt_dir):
        why = _deepspeed_missing(ckpt_dir, world, zero_stage)
    elif not any(_regular(ckpt_dir / name) for name in WEIGHT_FILES):
        why = "no model weights file"
    elif not _regular(ckpt_dir / OPTIMIZER_FILE):
        why = f"no {OPTIMIZER_FILE}"
    return why or headers(ckpt_dir)


def model_only(ckpt_dir: Path) -> bool:
    """True for a whole ``save_only_model`` checkpoint: model weights, and no resume state at all."""
    names = os.listdir(ckpt_dir)
    resume_state = (RNG_SINGLE in names or OPTIMIZER_FILE in names or has_deepspeed(ckpt_dir)
                    or any(RNG_RE.fullmatch(name) for name in names))
    has_weights = any(_regular(ckpt_dir / name) for name in WEIGHT_FILES)
    return has_weights and not resume_state and headers(ckpt_dir) is None


def headers(ckpt_dir: Path) -> str | None:
    """The first file under ``ckpt_dir`` that is not a regular file or fails its header check, with why."""
    universal = os.path.join(ckpt_dir, UNIVERSAL_DIR_NAME)
    for root, dirs, files in formats.walk(ckpt_dir):
        if root == universal or root.startswith(universal + os.sep):
            continue
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(root, d))]):
            path = Path(root) / name
            if path == Path(universal):
                continue
            problem = formats.check_file(path)
            if problem:
                return f"{path.relative_to(ckpt_dir)}: {problem}"
    return None
