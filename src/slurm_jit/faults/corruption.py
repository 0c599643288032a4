"""Row 4: damage a real complete checkpoint in each documented way; ckpt-check (quick and ``--deep``, its own
process) must classify it as documented, never crash, never call it resumable when it is not, and read no file
outside the checkpoint (every file outside has its access time set before mtime: a read would move it)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slurm_jit.checkpoint import protocol
from slurm_jit.faults import common

RESUMABLE = {"complete", "unverified"}


@dataclass(frozen=True)
class Damage:
    name: str
    apply: Callable[[Path, Path], None]  # (checkpoint, a directory outside it)
    quick: str  # the documented status under a plain ckpt-check
    deep: str  # under --deep


def _shard(ckpt: Path, rank: int) -> Path:
    return next(ckpt.glob(f"global_step*/*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))


def _truncate(ckpt: Path, outside: Path) -> None:
    path = _shard(ckpt, 1)
    os.truncate(path, path.stat().st_size // 2)


def _flip_byte(ckpt: Path, outside: Path) -> None:
    path = _shard(ckpt, 0)
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))


def _missing_shard(ckpt: Path, outside: Path) -> None:
    _shard(ckpt, 1).unlink()


def _extra_unknown_file(ckpt: Path, outside: Path) -> None:
    (ckpt / "notes.txt").write_text("a file nobody listed; resume never reads it\n")


def _extra_rank_file(ckpt: Path, outside: Path) -> None:
    shutil.copy(ckpt / "rng_state_0.pth", ckpt / "rng_state_5.pth")  # a rank beyond the manifest's world size


def _deleted_manifest(ckpt: Path, outside: Path) -> None:
    (ckpt / protocol.MANIFEST_NAME).unlink()


def _manifest_points_outside(ckpt: Path, outside: Path) -> None:
    (outside / "secret.json").write_text('{"global_step": 1}')
    manifest_path = ckpt / protocol.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    rel = os.path.relpath(outside / "secret.json", ckpt)
    manifest["files"][rel] = {"size": (outside / "secret.json").stat().st_size}
    manifest["files"]["/etc/hostname"] = {"size": 1}
    manifest_path.write_text(json.dumps(manifest))


def _symlink_swap(ckpt: Path, outside: Path) -> None:
    path = _shard(ckpt, 0)
    shutil.copy(path, outside / path.name)  # the same bytes: only the link itself is wrong
    path.unlink()
    path.symlink_to(outside / path.name)


DAMAGES = [
    Damage("truncated optimizer shard", _truncate, "corrupt", "corrupt"),
    Damage("flipped byte (sizes unchanged)", _flip_byte, "complete", "corrupt"),  # quick checks sizes only
    Damage("missing rank shard", _missing_shard, "corrupt", "corrupt"),
    Damage("unknown extra file notes.txt", _extra_unknown_file, "complete", "complete"),  # never read by resume
    Damage("extra file of rank 5 of 2", _extra_rank_file, "incomplete", "incomplete"),
    Damage("deleted manifest", _deleted_manifest, "unverified", "unverified"),  # as a plain Trainer's save
    Damage("manifest lists paths outside", _manifest_points_outside, "corrupt", "corrupt"),
    Damage("shard swapped for a symlink", _symlink_swap, "corrupt", "corrupt"),
]


def _freeze_atimes(outside: Path) -> dict[Path, float]:
    """Access time 0 (before mtime) on every file outside: relatime moves it on the next read."""
    times = {}
    for path in outside.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.utime(path, (0, path.stat().st_mtime))
            times[path] = 0.0
    return times


def _read_outside(outside: Path, times: dict[Path, float]) -> list[str]:
    return [p.name for p in times if p.stat().st_atime != times[p]]


def _try(damage: Damage, sample: Path, root: Path, tally: common.Tally) -> str:
    case = common.fresh(root / damage.name.replace(" ", "-"))
    out, outside = case / "out", case / "outside"
    outside.mkdir(parents=True)
    ckpt = out / sample.name
    shutil.copytree(sample, ckpt, symlinks=True)
    damage.apply(ckpt, outside)
    times = _freeze_atimes(outside)
    got = []
    for flags, want in (((), damage.quick), (("--deep",), damage.deep)):
        check = common.ckpt_check(out, *flags)
        status = common.statuses(check).get(int(sample.name.split("-")[1]))
        got.append(str(status))
        if check["exit_code"] == 2:
            tally.fail(f"{damage.name}: ckpt-check {' '.join(flags)} gave no verdict: {check.get('error')}")
        if status in RESUMABLE and want not in RESUMABLE:
            tally.false_complete += 1
        tally.check(status == want, f"{damage.name}: {status} {' '.join(flags)}, documented {want}")
    read = _read_outside(outside, times)
    tally.check(not read, f"{damage.name}: ckpt-check read {read} outside the checkpoint")
    tally.trials += 1
    shutil.rmtree(case)
    return f"{damage.name}: {got[0]}/{got[1]}"


def run_row(root: Path, sample: Path) -> common.Row:
    t0 = time.monotonic()
    tally = common.Tally()
    seen = [_try(damage, sample, root, tally) for damage in DAMAGES]
    detail = ("ckpt-check quick/--deep on a damaged copy of a real ZeRO-2 checkpoint: " + "; ".join(seen)
              + "; no file outside read (access times), no crash")
    return tally.row("corruption of a complete checkpoint", detail, time.monotonic() - t0)
