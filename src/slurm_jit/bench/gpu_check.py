"""``tools/gpu-check``: the GPU path in one run of under 8 minutes on one GPU (issue #34 item 4).

Rows, each printed as one line once measured and written to ``OUT/<row>.json``, all of them to
``OUT/gpu-check.json``:

- ``gpu_resume_bitwise``: 1 rank, bf16 ZeRO-2, GPT-2 width 1024 x 24 layers (302.5 M parameters with the
  demo's 128-token vocabulary): a real SIGTERM stops it with a JIT checkpoint, a second run resumes it to the end; its
  complete state there (weights, fp32 master, moments, RNGs: ``python -m slurm_jit.exactness``), its weights'
  digest and its losses are bitwise those of a run that never stopped.
- ``gpu_save_over_write_floor_tmpfs`` / ``_disk``: the JIT save's time (the timing log's, every phase) over the
  raw write floor of :mod:`slurm_jit.bench.floors` (its files, the same sizes, written from memory by one thread per
  rank, ``os.write`` in large chunks, fsync each) in the same filesystem: tmpfs (best of 3), the local disk
  (``--work-dir``; the fastest of 5, their spread in the details).
- ``gpu_d2h_copy_pinned`` / ``_pageable``: GB/s of one device-to-host copy of a large tensor into a host buffer
  allocated (and touched) once, best of 5, in a process of its own.
- ``gpu_async_staging_devices``: an async save's staging on each device, its deferred copies awaited by the
  background writer on the tensors' device (:mod:`slurm_jit.bench.staging_check`).
- ``gpu_shared_agreed_step``: 2 ranks sharing the one GPU, the model's collectives over gloo (NCCL refuses two
  ranks on one GPU), SIGTERM to rank 0 and 0.5 s later to rank 1: each rank's stop record (its timing log's
  ``stop``) names the same step, the stop record and a complete checkpoint of that step, clean exits.

``--cpu``: the same script on CPU ranks, a tiny model, a few steps (the test suite runs it, so that it cannot
rot); the pinned copy is skipped there (no device). Exit status: 0 when every judged row met its target, 1 when one
did not or a row could not be measured, 2 on bad input (a GPU check without a GPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_jit import local_ranks, timing
from slurm_jit.bench import floors, runs, staging_check
from slurm_jit.bench.gpu import (
    ASYNC_STAGING,
    BITWISE,
    COPY_PAGEABLE,
    COPY_PINNED,
    FLOOR_DISK,
    FLOOR_TMPFS,
    GPU_ROWS,
    NO_GPU,
    ROW_SPECS,
    SHARED,
    copy_probe_in_child,
)
from slurm_jit.bench.rows import Row, failed, measured, skipped
from slurm_jit.checkpoint import protocol
from slurm_jit.checkpoint.manifest import MANIFEST_NAME
from slurm_jit.train import stop_record

logger = logging.getLogger(__name__)

KILL_WAIT_S = 1.0  # as the staggered-signal bench: short, and the agreement does not depend on it
STEP_SLEEP_S = 0.05  # paces the steps, so that kill_wait and the 0.5 s stagger span several of them
SHARED_DELAY_S = 0.5  # issue #34: SIGTERM to the 2 ranks 0.5 s apart
# A healthy stop ends within kill_wait + a few steps + the save + teardown; a rank alive this long after the last
# signal is hung (killed, reported)
HANG_AFTER_S = 120.0
STEPS_AFTER_SIGNAL = 30  # max steps past the signal: kill_wait / STEP_SLEEP_S = 20 steps, and 2 for the rounds
EXACTNESS_TIMEOUT_S = 300  # python -m slurm_jit.exactness: two dumps of ~4.3 GB (the GPU profile) loaded, compared


@dataclass(frozen=True, kw_only=True)
class Profile:
    """What one gpu-check runs."""

    flag: str  # how it is asked for: "" (the GPU) or "--cpu"
    device: str  # demo_train --device
    model: runs.Model  # the bitwise and save rows' model
    shared_model: runs.Model  # the 2-rank row's model (the agreement, not the size, is what it checks)
    signal_after: int  # steps ended before the SIGTERM
    copy_bytes: int  # the device-to-host copy's size
    run_timeout_s: float  # a run's start to its first steps, or to its end

    @property
    def steps(self) -> int:
        return self.signal_after + STEPS_AFTER_SIGNAL


GPU = Profile(flag="", device="cuda", model=runs.Model(width=1024, layers=24, heads=16),
              shared_model=runs.Model(width=256, layers=4, heads=4), signal_after=10, copy_bytes=2**30,
              run_timeout_s=300)
CPU = Profile(flag="--cpu", device="cpu", model=runs.Model(width=64, layers=2, heads=2),
              shared_model=runs.Model(width=64, layers=2, heads=2), signal_after=5, copy_bytes=64 * 2**20,
              run_timeout_s=300)


@dataclass
class Run:
    """One start of demo_train's ranks and how they ended."""

    out: Path
    codes: list[int | None]  # None: alive at its deadline (killed: a hang, or a start that never came)
    log_tail: str  # the last lines of each rank's log, for a row that says why it failed
    pids: list[int]
    reached: bool = True  # the steps before the signal were reached

    @property
    def clean(self) -> bool:
        return self.reached and self.codes == [0] * len(self.codes)

    def why(self) -> str:
        if not self.reached:
            return f"never reached the steps before the signal ({self.codes}): {self.log_tail}"
        return f"ranks ended {self.codes}: {self.log_tail}"


def _train_args(profile: Profile, model: runs.Model, *extra: str) -> list[str]:
    """demo_train's arguments: ZeRO-2 on the profile's device (CUDA: bf16, NCCL unless ``extra`` says gloo)."""
    return [*model.args(), "--device", profile.device, "--zero-stage", "2", "--kill-wait", str(KILL_WAIT_S),
            "--step-sleep", str(STEP_SLEEP_S), *extra]


def _tail(ranks: local_ranks.Ranks) -> str:
    lines = [line for r in range(len(ranks.logs)) for line in ranks.log(r).splitlines()[-3:] if line.strip()]
    return " | ".join(lines)[-600:]


def run(out: Path, args: list[str], world_size: int, timeout_s: float,
        signals: tuple[float, ...] | None = None, after_steps: int = 0) -> Run:
    """Start ``world_size`` ranks of demo_train; with ``signals``, once rank 0 ended ``after_steps`` steps send rank
    r's process group SIGTERM ``signals[r]`` seconds after the first, as Slurm does; wait for every rank's end."""
    before = len(runs.step_times(out))
    ranks = local_ranks.start(["-m", "slurm_jit.demo_train", "--output-dir", str(out), "--step-times", *args],
                              world_size, out.parent / f"logs-{out.name}")
    result = Run(out=out, codes=[None] * world_size, log_tail="", pids=[p.pid for p in ranks.procs])
    STARTED_PIDS.extend(result.pids)
    try:
        if signals is None:
            result.codes = ranks.wait(timeout_s)
            return result
        deadline = time.monotonic() + timeout_s
        while len(runs.step_times(out)) - before < after_steps:
            if time.monotonic() > deadline or any(p.poll() is not None for p in ranks.procs):
                result.reached, result.codes = False, ranks.wait(0.1)
                return result
            time.sleep(runs.POLL_S)
        first = time.monotonic()
        for rank, delay_s in sorted(enumerate(signals), key=lambda pair: pair[1]):
            time.sleep(max(0.0, first + delay_s - time.monotonic()))
            ranks.signal(rank, signal.SIGTERM)
        result.codes = ranks.wait(KILL_WAIT_S + HANG_AFTER_S)
        return result
    finally:
        ranks.kill()
        result.log_tail = _tail(ranks)


# ------------------------------------------------------------------ the rows

@dataclass(frozen=True, kw_only=True)
class JitSave:
    """The JIT stop of a stopped run, read before anything else writes into its output directory."""

    step: int
    ckpt: Path
    record: dict[str, Any]  # the longest rank's timing record of the save (dur_s, phases, bytes)
    files: dict[str, int]  # every file of the checkpoint (path relative to it -> bytes), the manifest's
    world_size: int  # the ranks that wrote it

    def sizes_by_rank(self) -> list[list[int]]:
        """Each rank's file sizes: what the write floor writes."""
        return [[size for _, size in files] for files in floors.by_rank(self.files, self.world_size)]


def jit_save(stopped: Run) -> JitSave:
    """The JIT stop recorded by a run that a signal stopped."""
    if not stopped.clean:
        raise RuntimeError(f"the stopped run: {stopped.why()}")
    record = stop_record.read(stopped.out)
    if not record or record.get("state") != "jit_stop":
        raise RuntimeError(f"no JIT stop recorded in {stopped.out} (stop record: {record})")
    saves = [r for r in timing.read_records(stopped.out) if r.get("event") == "save" and r.get("kind") == "jit"]
    if not saves:
        raise RuntimeError(f"no JIT save in the timing log of {stopped.out}")
    ckpt = Path(record["checkpoint"])
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    return JitSave(step=int(record["step"]), ckpt=ckpt, record=max(saves, key=lambda r: float(r["dur_s"])),
                   files={rel: int(entry["size"]) for rel, entry in manifest["files"].items()},
                   world_size=int(manifest["world_size"]))


def floor_row(name: str, save: JitSave, root: Path, trials: int) -> Row:
    """A JIT save over the raw write floor in a scratch directory under ``root`` (the filesystem it was written
    to), ``trials`` times: over the fastest, all of them in the details."""
    with floors.scratch(root, "gpu-check-write-floor") as directory:
        trials_s = floors.write_trials(directory, save.sizes_by_rank(), trials)
    save_s, floor_s = float(save.record["dur_s"]), floors.best_of(trials_s)
    phases = {k: float(v) for k, v in save.record.get("phases", {}).items()}
    unit, target, compares = ROW_SPECS[name]
    nbytes = sum(save.files.values())
    return measured(name, floors.over_floor(save_s, floor_s), unit, target, compares,
                    note=f"save {save_s:.4g} s, floor {floor_s:.4g} s: {nbytes} bytes in {len(save.files)} files",
                    save_s=save_s, floor_s=floor_s, floor_trials=floors.spread(trials_s).as_details(), bytes=nbytes,
                    files=len(save.files), phases_s=phases, above_floor_s=floors.above_floor(phases, floor_s),
                    step=save.step)


def _losses(out: Path) -> list[tuple[int, float]]:
    path = out / "losses-rank0.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(r["step"]), float(r["loss"])) for r in map(json.loads, lines) if r]


def _exactness(a: Path, b: Path, step: int) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "slurm_jit.exactness", str(a), str(b), "--step", str(step)],
                          capture_output=True, text=True, timeout=EXACTNESS_TIMEOUT_S, check=False)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"exactness gave no verdict: {proc.stderr.strip()[-400:]}")
    return proc.returncode, proc.stdout.strip()[-600:]


def bitwise_row(profile: Profile, root: Path) -> tuple[Row, JitSave]:
    """The uninterrupted run, the stopped one and its resume; also the stopped run's save (the tmpfs floor's)."""
    steps = profile.steps
    args = _train_args(profile, profile.model, "--max-steps", str(steps), "--dump-state-at", str(steps))
    reference = run(root / "reference", args, 1, profile.run_timeout_s)
    if not reference.clean:
        raise RuntimeError(f"the uninterrupted run: {reference.why()}")
    stopped = run(root / "stopped", args, 1, profile.run_timeout_s, signals=(0.0,), after_steps=profile.signal_after)
    save = jit_save(stopped)
    logged = len(_losses(stopped.out))
    resumed = run(stopped.out, [*args, "--resume"], 1, profile.run_timeout_s)
    if not resumed.clean:
        raise RuntimeError(f"the resumed run: {resumed.why()}")
    resumed_losses = _losses(stopped.out)[logged:]
    reference_losses = dict(_losses(reference.out))
    code, verdict = _exactness(reference.out, stopped.out, steps)
    digests = [json.loads((r.out / "final-state.json").read_text())["weights_sha256"] for r in (reference, stopped)]
    for dump in (reference.out, stopped.out / "exact-state"):  # compared: room on tmpfs for the floor's files
        shutil.rmtree(dump, ignore_errors=True)
    checks = {
        "resumed_from_the_jit_stop": [s for s, _ in resumed_losses] == list(range(save.step + 1, steps + 1)),
        "exact_state_equal": code == 0,
        "weights_digest_equal": digests[0] == digests[1],
        "losses_equal": all(reference_losses.get(s) == loss for s, loss in resumed_losses),
    }
    unit, target, compares = ROW_SPECS[BITWISE]
    model = (f"GPT-2 width {profile.model.width} x {profile.model.layers} layers, "
             f"{profile.model.params() / 1e6:.1f} M parameters, {'bf16' if profile.device == 'cuda' else 'fp32'} "
             f"on {profile.device}")
    differ = [k for k, v in checks.items() if not v]
    note = f"{model}; stopped at step {save.step} of {steps}" + (f"; NOT: {', '.join(differ)}" if differ else "")
    row = measured(BITWISE, float(not differ), unit, target, compares, note=note, stop_step=save.step, steps=steps,
                   checks=checks, exactness=verdict, weights_sha256=digests, model=model)
    return row, save


def copy_rows(profile: Profile) -> tuple[list[Row], dict[str, Any]]:
    found = copy_probe_in_child(profile.device, profile.copy_bytes)
    rows = []
    for name, kind in ((COPY_PINNED, "pinned"), (COPY_PAGEABLE, "pageable")):
        unit, target, compares = ROW_SPECS[name]
        if found[kind] is None:
            rows.append(skipped(name, unit, target, compares, "pinned host memory needs CUDA (--cpu)"))
            continue
        note = f"{profile.copy_bytes} bytes from {profile.device}" + ("" if profile.device == "cuda" else
                                                                      " (host to host: no device)")
        rows.append(measured(name, float(found[kind]), unit, target, compares, note=note, bytes=profile.copy_bytes,
                             device_name=found["device_name"]))
    return rows, found


def shared_row(profile: Profile, root: Path) -> Row:
    """2 ranks on the one device, SIGTERM to rank 0, SHARED_DELAY_S later to rank 1: one agreed step."""
    out = root / "shared"
    args = _train_args(profile, profile.shared_model, "--max-steps", "100000", "--dist-backend", "gloo")
    result = run(out, args, 2, profile.run_timeout_s, signals=(0.0, SHARED_DELAY_S), after_steps=profile.signal_after)
    stops = {int(r["rank"]): r for r in timing.read_records(out) if r.get("event") == "stop"}
    record = stop_record.read(out) or {}
    step = record.get("step") if record.get("state") == "jit_stop" else None
    status = protocol.inspect(record["checkpoint"], step).status.value if step is not None else None
    agreed = (result.clean and sorted(stops) == [0, 1] and {s.get("step") for s in stops.values()} == {step}
              and status == protocol.Status.COMPLETE.value)
    backend = "gloo on the GPU's tensors (staged through host memory)" if profile.device == "cuda" else "gloo (CPU)"
    unit, target, compares = ROW_SPECS[SHARED]
    per_rank = {r: {"step": s.get("step"), "signal_step": s.get("signal_step")} for r, s in sorted(stops.items())}
    note = f"stop steps by rank {per_rank}, stop record step {step}, checkpoint {status}; model collectives: {backend}"
    if not result.clean:
        note += f"; {result.why()}"
    return measured(SHARED, float(agreed), unit, target, compares, note=note, codes=result.codes, ranks=per_rank,
                    stop_record_step=step, checkpoint_status=status, backend=backend)


# ------------------------------------------------------------------ the run

def _section(rows: list[Row], names: Sequence[str], fn: Callable[[], list[Row]], say: Callable[[Row], None]) -> None:
    """Rows from ``fn``, or one 'not measured' row per name when it breaks (the run goes on)."""
    try:
        got = fn()
    except Exception as exc:  # noqa: BLE001 - reported in the row, and the exit status says so
        logger.exception("gpu-check: %s failed", ", ".join(names))
        got = [failed(n, ROW_SPECS[n][0], ROW_SPECS[n][1], ROW_SPECS[n][2], f"{type(exc).__name__}: {exc}")
               for n in names]
    for row in got:
        say(row)
    rows.extend(got)


def measure(profile: Profile, work: Path, say: Callable[[Row], None] = lambda row: None,
            meta: dict[str, Any] | None = None) -> list[Row]:
    """Every row of GPU_ROWS, in order; ``work`` on the local disk. The bitwise runs go to tmpfs where it has
    room (their checkpoint, the two dumps compared, then the floor's files: at most floors.TMPFS_COPIES copies of
    the state at once), so that its floor row reads their save; else to ``work``, the tmpfs row skipped."""
    rows: list[Row] = []
    meta = {} if meta is None else meta
    no_room = floors.tmpfs_room_missing(floors.TMPFS_COPIES * floors.state_bytes(profile.model.params()))
    fast = work if no_room else Path(tempfile.mkdtemp(prefix="slurm-jit-gpu-check-", dir=floors.TMPFS))
    meta["bitwise_runs_in"] = str(fast) + (f" ({no_room})" if no_room else " (tmpfs)")
    try:
        saves: list[JitSave] = []

        def bitwise() -> list[Row]:
            row, save = bitwise_row(profile, fast)
            saves.append(save)
            return [row]

        _section(rows, [BITWISE], bitwise, say)
        if no_room:
            unit, target, compares = ROW_SPECS[FLOOR_TMPFS]
            _section(rows, [FLOOR_TMPFS], lambda: [skipped(FLOOR_TMPFS, unit, target, compares, no_room)], say)
        else:
            _section(rows, [FLOOR_TMPFS], lambda: [floor_row(FLOOR_TMPFS, _need(saves), fast,
                                                             floors.TMPFS_TRIALS)], say)
        shutil.rmtree(fast / "stopped", ignore_errors=True)  # done with: the room is the disk run's
        disk_args = _train_args(profile, profile.model, "--max-steps", str(profile.steps))
        _section(rows, [FLOOR_DISK], lambda: [floor_row(FLOOR_DISK, jit_save(run(
            work / "stopped-disk", disk_args, 1, profile.run_timeout_s, signals=(0.0,),
            after_steps=profile.signal_after)), work, floors.DISK_TRIALS)], say)

        def copies() -> list[Row]:
            got, found = copy_rows(profile)
            meta.update(torch=found["torch"], cuda=found["cuda"], device_name=found["device_name"])
            return got

        _section(rows, [COPY_PINNED, COPY_PAGEABLE], copies, say)
        _section(rows, [ASYNC_STAGING], lambda: [staging_check.row(profile.device)], say)
        _section(rows, [SHARED], lambda: [shared_row(profile, work)], say)
    finally:
        if fast != work:
            shutil.rmtree(fast, ignore_errors=True)
    return rows


def bench_rows() -> list[Row]:
    """``tools/bench``'s GPU rows: the GPU profile measured where torch sees a GPU, else skipped."""
    import torch

    if not torch.cuda.is_available():
        reason = f"{NO_GPU} (torch.cuda.is_available() is False here); tools/gpu-check measures these rows on one"
        return [skipped(name, *ROW_SPECS[name], reason) for name in GPU_ROWS]
    work = Path(tempfile.mkdtemp(prefix="slurm-jit-bench-gpu-"))
    try:
        return measure(GPU, work, say=lambda row: logger.info("%s", line(row)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _need(saves: list[JitSave]) -> JitSave:
    if not saves:
        raise RuntimeError(f"no JIT save to hold to the floor ({BITWISE}'s runs failed)")
    return saves[0]


STARTED_PIDS: list[int] = []  # every rank this process started, for the device's leftovers check


def leftovers() -> list[int]:
    """Ranks this check started that still run (a clean run leaves none: every run kills its groups)."""
    import psutil

    alive = []
    for pid in STARTED_PIDS:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            pass
    return alive


def device_processes() -> str:
    """What holds the GPU now, as nvidia-smi lists it (the check leaves nothing of its own there)."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not listed ({exc})"
    return proc.stdout.strip().replace("\n", "; ") or "none"


def no_gpu_reason() -> str | None:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return None


def exit_status(rows: Sequence[Row]) -> int:
    """0 when every judged row met its target and every row was measured or skipped; 1 otherwise."""
    bad = [r for r in rows if r.met is False or r.note.startswith("not measured")]
    return 1 if bad else 0


def line(row: Row) -> str:
    value = "skipped" if row.value is None else f"{row.value:g} {row.unit}"
    met = {True: "yes", False: "NO", None: "-"}[row.met]
    return f"gpu-check: {row.name} = {value} (target {row.target}: {met}) {row.note}".rstrip()


def _write_row(out: Path, row: Row) -> None:
    (out / f"{row.name}.json").write_text(json.dumps(row.as_json(), indent=1) + "\n", encoding="utf-8")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/gpu-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="CPU ranks, a tiny model, a few steps (~2-3 min)")
    p.add_argument("--out", default="gpu-check-results", help="the rows as JSON go here")
    p.add_argument("--work-dir", default=None, help="a directory on the local disk for the runs (default: OUT); "
                   "they go into a fresh directory inside it, removed after")
    p.add_argument("--keep-work", action="store_true", help="keep the runs' directories")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    profile = CPU if args.cpu else GPU
    if not args.cpu and (why := no_gpu_reason()):
        print(f"tools/gpu-check: {why}. HINT: run it on a GPU machine with a CUDA build of torch (GPU_CHECK_PYTHON="
              "/path/to/python tools/gpu-check), or tools/gpu-check --cpu", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="gpu-check-work-", dir=args.work_dir or out))
    except OSError as exc:
        print(f"tools/gpu-check: cannot make its directories ({exc.strerror}: {exc.filename}). HINT: --out and "
              "--work-dir must be writable directories", file=sys.stderr)
        return 2
    started, meta = time.monotonic(), {"profile": f"tools/gpu-check {profile.flag}".strip(), "work": str(work),
                                       "model_params": profile.model.params(), "load_start": list(os.getloadavg())}

    def say(row: Row) -> None:
        print(line(row), flush=True)
        _write_row(out, row)

    try:
        rows = measure(profile, work, say, meta)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    alive = leftovers()
    meta.update(wall_s=round(time.monotonic() - started, 1), load_end=list(os.getloadavg()), leftover_ranks=alive,
                device_processes_after=device_processes() if profile.device == "cuda" else "no device")
    (out / "gpu-check.json").write_text(json.dumps({"meta": meta, "rows": [r.as_json() for r in rows]}, indent=1)
                                        + "\n", encoding="utf-8")
    status = exit_status(rows) or (1 if alive else 0)
    print(f"gpu-check: {'PASS' if status == 0 else 'FAIL'} in {meta['wall_s']:.0f} s; rows in {out}; ranks left "
          f"running: {alive or 'none'}; on the device after: {meta['device_processes_after']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
