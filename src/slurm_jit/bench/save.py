"""Rows 2 and 3: JIT save time against the raw write floor (issue #34: on tmpfs, the target; on the disk,
reported), throughput against the disk's write limit and against upstream ``enable_jit_checkpoint``, bytes written
against the minimal resumable state, ZeRO-3's 16-bit gather on and off, and peak memory during the save against
steady training."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_jit import timing
from slurm_jit.bench import floors, runs
from slurm_jit.bench.disk import CHUNK_BYTES, MB, DiskLimits
from slurm_jit.bench.rows import NO_TARGET, Row, measured, skipped
from slurm_jit.checkpoint.manifest import MANIFEST_NAME

logger = logging.getLogger(__name__)

KILL_WAIT_S = 3.0  # upstream's JITCheckpointManager waits 3 s (kill_wait=3, not configurable): ours the same
# Issue 10 held the save to 0.8 of the disk's write limit; issue #34 dropped that target (the disk here is a host
# cache whose speed moves 5x between runs): the ratio is reported, the floor on tmpfs is the target.
SAVE_BW_TARGET = NO_TARGET
UPSTREAM_TARGET = "<= 1.0"  # ours no slower than upstream plus a sync of the files it wrote
BYTES_TARGET = "<= 1.1"  # bytes written at most 1.1 x the minimal resumable state
MEMORY_TARGET = "<= 1.1"  # peak RSS during a JIT save at most 1.1 x steady training RSS
STEPS_BEFORE_SIGNAL = 4  # past the timing log's warm-up steps, so the steady RSS is the steady state


@dataclass(frozen=True, kw_only=True)
class JitSave:
    """One JIT stop of our trainer: its checkpoint and what it cost."""

    outcome: runs.Outcome
    ckpt: Path
    save_s: float  # the longest rank's save, from the timing log
    phases: dict[str, float]  # that rank's save, phase by phase (train/save_path.py SAVE_PHASES)
    total_bytes: int  # every file of the checkpoint (the manifest's count)
    needed_bytes: int  # what a resume reads: fp32 master weights, optimizer moments, small state files
    files: dict[str, int]  # every file of the checkpoint (path relative to it -> bytes), the manifest's
    world_size: int  # the ranks that wrote it

    def sizes_by_rank(self) -> list[list[int]]:
        """Each rank's file sizes: what the write floor writes."""
        return [[size for _, size in files] for files in floors.by_rank(self.files, self.world_size)]

    def paths_by_rank(self) -> list[list[Path]]:
        """Each rank's files: what the read floor reads."""
        return [[self.ckpt / rel for rel, _ in files] for files in floors.by_rank(self.files, self.world_size)]


def train_args(model: runs.Model, zero_stage: int, *extra: str) -> list[str]:
    return [*model.args(), "--zero-stage", str(zero_stage), "--max-steps", "100000", "--kill-wait",
            str(KILL_WAIT_S), *extra]


def run_ours(out: Path, model: runs.Model, zero_stage: int, *extra: str) -> JitSave:
    outcome = runs.run(out, train_args(model, zero_stage, *extra), after_steps=STEPS_BEFORE_SIGNAL)
    if not outcome.clean or not outcome.new_ckpts:
        raise RuntimeError(f"the JIT run in {out} ended {outcome.codes} with checkpoints {outcome.new_ckpts}")
    ckpt = outcome.new_ckpts[-1]
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    saves = [r for r in timing.read_records(out) if r.get("event") == "save" and r.get("kind") == "jit"]
    if not saves:
        raise RuntimeError(f"no JIT save in the timing log of {out}")
    longest = max(saves, key=lambda r: float(r["dur_s"]))
    return JitSave(outcome=outcome, ckpt=ckpt, save_s=float(longest["dur_s"]), phases=dict(longest.get("phases", {})),
                   total_bytes=int(manifest["total_bytes"]), needed_bytes=int(manifest["bytes_needed_for_resume"]),
                   files={rel: int(entry["size"]) for rel, entry in manifest["files"].items()},
                   world_size=int(manifest["world_size"]))


def bandwidth_row(name: str, save: JitSave, disk: DiskLimits, what: str) -> Row:
    bw_bps = save.total_bytes / save.save_s
    return measured(name, bw_bps / disk.write_bps, "ratio", SAVE_BW_TARGET,
                    f"{what}: JIT save bandwidth (manifest's bytes / timing log's save time) over the disk write "
                    "limit (row disk_write)",
                    save_s=round(save.save_s, 3), bytes=save.total_bytes, save_mb_s=round(bw_bps / MB, 1),
                    disk_write_mb_s=round(disk.write_bps / MB, 1),
                    phases_s={name: round(s, 3) for name, s in save.phases.items()})


def _floor_details(save: JitSave) -> dict[str, Any]:
    return {"save_s": round(save.save_s, 4), "bytes": save.total_bytes,
            "bytes_per_rank": [sum(sizes) for sizes in save.sizes_by_rank()], "files": len(save.files),
            "phases_s": {name: round(s, 4) for name, s in save.phases.items()}}


def write_floor_row(name: str, save: JitSave, trials_s: list[float], what: str,
                    hash_trials_s: list[float] | None = None) -> Row:
    """The save on tmpfs over the best of the raw write floor's trials on tmpfs (issue #34's target); with
    ``hash_trials_s`` (floors.hash_trials of the same bytes), the checksum's own time and the save over write +
    checksum in the details (reported)."""
    floor_s = floors.best_of(trials_s)
    checksum: dict[str, Any] = {}
    if hash_trials_s:
        hash_s = floors.best_of(hash_trials_s)
        checksum = {"checksum_floor_s": round(hash_s, 4), "checksum_trials_s": [round(t, 4) for t in hash_trials_s],
                    "over_write_plus_checksum_floor": round(floors.over_floor(save.save_s, floor_s + hash_s), 4)}
    return measured(name, floors.over_floor(save.save_s, floor_s), "ratio", floors.FLOOR_TARGET,
                    f"{what}, output directory on tmpfs ({floors.TMPFS}): the JIT save's time (longest rank, every "
                    f"phase, timing log) over the raw floor: each rank's bytes (its files' sizes) written from memory "
                    f"by {save.world_size} threads at once, os.write in {CHUNK_BYTES // 2**20} MiB chunks + fsync, "
                    f"into tmpfs, best of {len(trials_s)}",
                    floor_s=round(floor_s, 4), floor_trials_s=[round(t, 4) for t in trials_s],
                    above_floor_s=floors.above_floor(save.phases, floor_s), **checksum, **_floor_details(save))


def disk_floor_row(save: JitSave, trials_s: list[float], directory: Path) -> Row:
    """The save on the real disk beside the same raw floor written there (reported: the disk here swings)."""
    spread = floors.spread(trials_s)
    return measured("save_over_write_floor_disk", floors.over_floor(save.save_s, spread.median_s), "ratio", NO_TARGET,
                    f"ZeRO-2, output directory on the disk ({directory}): the JIT save's time (longest rank, every "
                    f"phase) over the median of {len(trials_s)} trials of the raw write floor there (as "
                    "save_over_write_floor_zero2's, buffered + fsync), min/median/max in the details",
                    floor=spread.as_details(), floor_trials_s=[round(t, 4) for t in trials_s],
                    above_floor_median_s=floors.above_floor(save.phases, spread.median_s), **_floor_details(save))


def bytes_row(name: str, save: JitSave, what: str) -> Row:
    return measured(name, save.total_bytes / save.needed_bytes, "ratio", BYTES_TARGET,
                    f"{what}: bytes a JIT save writes over the minimal resumable state (fp32 master + moments + "
                    "small state files, the manifest's bytes_needed_for_resume)",
                    bytes_written=save.total_bytes, bytes_needed=save.needed_bytes)


def memory_row(save: JitSave) -> Row:
    o = save.outcome
    return measured("memory_peak_over_steady", o.stop_rss_bytes / o.steady_rss_bytes, "ratio", MEMORY_TARGET,
                    "ZeRO-2: largest summed RSS of both ranks from the signal to the exit (the JIT save inside) over "
                    "the largest during steady training before it (sampled every 20 ms)",
                    peak_rss_bytes=o.stop_rss_bytes, steady_rss_bytes=o.steady_rss_bytes)


UPSTREAM_STEP_SLEEP_S = 0.5  # long steps: simultaneous signals land in one step on both ranks (upstream's best
# case; with short steps its per-rank timers fire in different steps, the ranks save different steps and hang)


def upstream_rows(out: Path, model: runs.Model, ours: JitSave) -> list[Row]:
    """Upstream enable_jit_checkpoint, plain Trainer, same model and ranks, simultaneous signals (its best case)."""
    name = "save_vs_upstream_plus_sync"
    compares = ("ZeRO-2, simultaneous SIGTERM: our JIT save's wall time (checkpoint directory first seen to its "
                "last file's mtime, fsyncs and manifest included) over upstream enable_jit_checkpoint's, measured "
                "the same way, plus an fsync of the files it wrote (upstream never syncs)")
    outcome = runs.run(out, train_args(model, 2, "--trainer", "plain", "--upstream-jit", "--step-sleep",
                                       str(UPSTREAM_STEP_SLEEP_S)), after_steps=STEPS_BEFORE_SIGNAL)
    if not outcome.clean or not outcome.new_ckpts:
        verdict = "hung (killed)" if outcome.hung else f"ended {outcome.codes}"
        return [skipped(name, "ratio", UPSTREAM_TARGET, compares, f"the upstream run {verdict}, checkpoints "
                        f"{[p.name for p in outcome.new_ckpts]}: nothing to compare with"),
                skipped("upstream_bytes_over_needed", "ratio", NO_TARGET, "upstream's bytes", "no upstream checkpoint")]
    ckpt = outcome.new_ckpts[-1]
    upstream_s = runs.write_span_s(outcome, ckpt)
    sync_s = runs.fsync_tree_s(ckpt)
    upstream_bytes = runs.tree_bytes(ckpt)
    ours_s = runs.write_span_s(ours.outcome, ours.ckpt)
    return [
        measured(name, ours_s / (upstream_s + sync_s), "ratio", UPSTREAM_TARGET, compares,
                 ours_save_s=round(ours_s, 3), ours_save_s_timing_log=round(ours.save_s, 3),
                 ours_bytes=ours.total_bytes, upstream_save_s=round(upstream_s, 3),
                 upstream_fsync_after_s=round(sync_s, 3), upstream_bytes=upstream_bytes),
        measured("upstream_bytes_over_needed", upstream_bytes / ours.needed_bytes, "ratio", NO_TARGET,
                 "ZeRO-2: bytes upstream's JIT checkpoint wrote over the minimal resumable state (ours' "
                 "bytes_needed_for_resume, same model)", bytes_written=upstream_bytes,
                 bytes_needed=ours.needed_bytes),
    ]


def zero3_rows(base: Path, model: runs.Model, disk: DiskLimits) -> list[Row]:
    off = run_ours(base / "zero3-gather-off", model, 3)
    on = run_ours(base / "zero3-gather-on", model, 3, "--jit-save-weights")
    return [
        bandwidth_row("save_bw_over_disk_zero3", off, disk, "ZeRO-3 (no 16-bit gather, our default)"),
        bytes_row("bytes_over_needed_zero3", off, "ZeRO-3"),
        measured("zero3_gather_on_over_off", on.save_s / off.save_s, "ratio", NO_TARGET,
                 "ZeRO-3 JIT save time with the consolidated 16-bit gather (jit_save_model_weights=True, "
                 "stage3_gather_16bit_weights_on_model_save) over without it",
                 save_s_on=round(on.save_s, 3), save_s_off=round(off.save_s, 3), bytes_on=on.total_bytes,
                 bytes_off=off.total_bytes),
    ]
