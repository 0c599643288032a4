"""Is a checkpoint without a manifest structurally whole? (The test for ``unverified``.)

For a checkpoint written by a plain ``transformers.Trainer``:

- one RNG state file per rank: ``rng_state.pth`` (world size 1) or ``rng_state_0.pth`` .. ``rng_state_{W-1}.pth``;
- with DeepSpeed: a ``latest`` file naming a tag directory that holds the model states (``mp_rank_00_model_states.pt``,
  or one ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank under ZeRO-3) and one optimizer shard
  ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank;
- without DeepSpeed: model weights and ``optimizer.pt``;
- every ``.pt``/``.pth``/``.bin``/``.safetensors``/``.json`` file passes its header check
  (:mod:`slurm_jit.checkpoint.formats`).

The data-parallel world size is the highest rank named by an RNG state file or a DeepSpeed shard, plus one
(no tensor or pipeline parallelism); every rank below it must have both.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from slurm_jit.checkpoint import formats

RNG_RE = re.compile(r"^rng_state_(\d+)\.pth$")
DS_LATEST = "latest"
DS_TAG_RE = re.compile(r"^[\w.-]+$")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
LATEST_MAX_BYTES = 4096


def regular_file(path: Path) -> bool:
    """A regular file (not a link, FIFO or device): the only kind a check may open."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


SHARD_RANK_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_(optim|model)_states\.pt$")


def _shard_ranks(ckpt_dir: Path) -> set[int]:
    """Ranks named by the DeepSpeed shard files under any tag directory."""
    ranks: set[int] = set()
    for tag_dir in ckpt_dir.iterdir():
        if tag_dir.is_dir() and not tag_dir.is_symlink():
            ranks.update(int(m.group(1)) for name in os.listdir(tag_dir) if (m := SHARD_RANK_RE.search(name)))
    return ranks


def world_size(ckpt_dir: Path) -> tuple[int | None, str | None]:
    """(world size, None) or (None, what is wrong): the RNG state files and the shards must agree."""
    ranks = sorted(int(m.group(1)) for name in os.listdir(ckpt_dir) if (m := RNG_RE.match(name)))
    if not ranks and regular_file(ckpt_dir / "rng_state.pth"):
        ranks = [0]
    world = max([*ranks, *_shard_ranks(ckpt_dir)], default=-1) + 1
    if world == 0:
        return None, "no RNG state file"
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        return None, f"RNG state file of rank {missing[0]} missing ({world} ranks)"
    return world, None


def _deepspeed_missing(ckpt_dir: Path, world: int) -> str | None:
    latest = ckpt_dir / DS_LATEST
    if not regular_file(latest) or latest.stat().st_size > LATEST_MAX_BYTES:
        return "DeepSpeed tag directory without a readable 'latest' file"
    tag = latest.read_text(encoding="utf-8", errors="replace").strip()
    if not DS_TAG_RE.match(tag) or tag in (".", ".."):
        return f"'latest' names an invalid tag {tag!r}"
    tag_dir = ckpt_dir / tag
    if tag_dir.is_symlink() or not tag_dir.is_dir():
        return f"'latest' names {tag}, which is not a directory here"
    names = set(os.listdir(tag_dir))
    zero3_states = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    if "mp_rank_00_model_states.pt" not in names and not all(n in names for n in zero3_states):
        return f"{tag}: no model states file"
    for rank in range(world):
        pattern = re.compile(rf"^(bf16_)?zero_pp_rank_{rank}_mp_rank_\d+_optim_states\.pt$")
        if not any(pattern.match(n) for n in names):
            return f"{tag}: optimizer shard of rank {rank} missing ({world} ranks)"
    return None


def check(ckpt_dir: Path) -> str | None:
    """None when the checkpoint is structurally whole, else the first thing missing or broken."""
    world, why = world_size(ckpt_dir)
    if world is None:
        return why
    has_deepspeed = regular_file(ckpt_dir / DS_LATEST) or any(
        p.name.startswith("global_step") for p in ckpt_dir.iterdir()
    )
    if has_deepspeed:
        why = _deepspeed_missing(ckpt_dir, world)
    elif not any(regular_file(ckpt_dir / name) for name in WEIGHT_FILES):
        why = "no model weights file"
    elif not regular_file(ckpt_dir / "optimizer.pt"):
        why = "no optimizer.pt"
    return why or _headers(ckpt_dir)


def _headers(ckpt_dir: Path) -> str | None:
    for root, _dirs, files in os.walk(ckpt_dir):
        for name in sorted(files):
            path = Path(root) / name
            if path.is_symlink():
                return f"{path.relative_to(ckpt_dir)} is a symlink: not trusted"
            problem = formats.check_file(path)
            if problem:
                return f"{path.relative_to(ckpt_dir)}: {problem}"
    return None
