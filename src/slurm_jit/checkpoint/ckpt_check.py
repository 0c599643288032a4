"""``ckpt-check OUT_DIR``: the gate run before a job is resubmitted.

Prints a table of the ``checkpoint-<step>`` directories under OUT_DIR, newest first, and as the LAST line of
standard output the path to resume from (an empty line when there is none: start fresh).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from slurm_jit.checkpoint import elastic_plan, protocol, structure

if TYPE_CHECKING:
    from slurm_jit.checkpoint.reseal import DirLock

EXIT_RESUMABLE = 0
EXIT_NONE_RESUMABLE = 1
EXIT_USAGE = 2
EXIT_NO_CHECKPOINT = 3
RESEAL_COMMAND = "slurm_jit.launch.ckpt_check_command"  # the ckpt-check command: this module with the lock
UNKNOWN = "-"  # a size or age that could not be read
MAX_WORLD_SIZE = structure.MAX_WORLD_SIZE
RUN_ID_SHOWN_CHARS = 8  # enough to tell runs apart in the table; --json has the whole id
# The weights layout in the table's narrow column; --json has the manifest's words
WEIGHTS_SHOWN = {protocol.WEIGHTS_FULL: "full", protocol.WEIGHTS_MASTER_ONLY: "master",
                 protocol.WEIGHTS_FROZEN_EXCLUDED: "adapter", protocol.WEIGHTS_FROZEN_EXCLUDED_MASTER_ONLY: "adapt-m"}

EPILOG = f"""\
exit status:
  {EXIT_RESUMABLE}  a resumable checkpoint exists; the last line of output is its path
  {EXIT_NONE_RESUMABLE}  checkpoints exist but none is resumable (last line empty)
  {EXIT_NO_CHECKPOINT}  no checkpoint at all: a fresh start (last line empty)
  {EXIT_USAGE}  usage or I/O error (missing directory, not a directory, permission denied), or ckpt-check's
     own failure: never a verdict

weights (where the module weights are; from the manifest, '-' without one):
  full        in DeepSpeed's model-states file too, beside the fp32 master copy in the optimizer shards
  master      only in the fp32 master partitions of the optimizer shards (JitTrainer's JIT saves under ZeRO-1/2,
              every ZeRO-3 save): every rank's shard is needed, and a ZeRO-1/2 one is resumed by JitTrainer only
  adapter     a PEFT model's ZeRO-1/2 save (transformers' layout, frozen-excluded): the trainable weights (the
              adapters) only; the frozen base is the model as built. Both trainers resume it
  adapt-m     a PEFT model's ZeRO-1/2 JIT save (frozen-excluded-master-only): the frozen base left out, and the
              adapters only in the fp32 master partitions of the optimizer shards (zero-element placeholders in
              the model-states file): JitTrainer resumes it, a plain Trainer refuses it (size mismatch)

statuses (newest written first; only complete and unverified are resumable):
  complete    manifest verified (sizes; checksums too with --deep) and everything a resume needs is there
  unverified  no manifest (plain Trainer) but structurally whole; resumable unless --strict
  model-only  whole model weights without optimizer/RNG state (save_only_model): never resumed
  incomplete  sentinel {protocol.SENTINEL_NAME} present, or files a resume needs missing
  corrupt     a file is missing, resized, not a regular file, (--deep) has the wrong checksum, or the
              manifest, trainer_state.json and DeepSpeed tag disagree on the step

set aside (never resumed, never rotated, never deleted; all listed under "set_aside" in --json):
  checkpoint-<step>.superseded-<seq>  a complete checkpoint replaced by a later save of the same step (listed
                                      on standard error)
  checkpoint-<step>{protocol.QUARANTINE_SUFFIX}[.N]      not resumable, renamed by --quarantine (or by a new save)
"""


class UsageError(Exception):
    """Exit 2 with a one-line message."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt-check",
        description="Say which checkpoint under OUT_DIR is complete and resumable, before resubmitting a job.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the Trainer's output_dir")
    parser.add_argument("--deep", action="store_true", help="verify every file's checksum (reads everything)")
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    parser.add_argument("--world-size", metavar="N",
                        help="say whether the checkpoint to resume from resumes on N ranks (directly, after a "
                             "conversion to DeepSpeed's universal format, or not: then exit 1)")
    parser.add_argument("--strict", action="store_true",
                        help="unverified (manifest-less) checkpoints are not resumable")
    parser.add_argument(
        "--quarantine",
        action="store_true",
        help=f"rename non-resumable checkpoints newer than the resume point to checkpoint-<step>"
        f"{protocol.QUARANTINE_SUFFIX} (never deletes)",
    )
    parser.add_argument("--reseal", action="store_true",
                        help="OUT_DIR is one checkpoint-<step> you changed on purpose (resharded, converted): "
                             "after a structure check, write its manifest anew (the old one kept beside it)")
    return parser


def parse_world_size(text: str | None) -> int | None:
    """``--world-size``'s value, or UsageError (one line, HINT): argparse's own error prints its usage lines."""
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size {text!r} is not a number of ranks between 1 and {MAX_WORLD_SIZE}. HINT: "
                         "give the number of ranks the next job will run, e.g. --world-size 4")
    return value


def _human_bytes(n: int | None) -> str:
    if n is None:
        return UNKNOWN
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _human_age(written_at: float, now: float) -> str:
    if written_at <= 0:
        return UNKNOWN
    seconds = max(0.0, now - written_at)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _check_out_dir(out_dir: str) -> None:
    try:
        os.stat(out_dir)
    except FileNotFoundError:
        raise UsageError(f"{out_dir}: no such directory. HINT: pass the Trainer's output_dir") from None
    except PermissionError:
        raise UsageError(f"{out_dir}: permission denied. HINT: run as the job's user") from None
    if not os.path.isdir(out_dir):
        raise UsageError(f"{out_dir}: not a directory. HINT: pass the Trainer's output_dir, not a file in it")
    if not os.access(out_dir, os.R_OK | os.X_OK):
        raise UsageError(f"{out_dir}: permission denied. HINT: run as the job's user")


def _deep_progress(out_dir: str) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    if not sys.stderr.isatty():
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(unit="B", unit_scale=True, desc="verifying checksums", file=sys.stderr)
    return bar.update, bar.close


def printable(text: str, stream: TextIO | None = None) -> str:
    """``text`` safe to write to ``stream`` (default stdout) whatever its encoding and error handler: control
    characters and lone surrogates (undecodable file names) escaped as in a Python literal, and so is every
    character the stream's encoding cannot represent."""
    escaped = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    encoding = getattr(stream or sys.stdout, "encoding", None) or "ascii"
    return escaped.encode(encoding, "backslashreplace").decode(encoding, "replace")


def _table(resolution: protocol.Resolution, now: float) -> list[str]:
    header = (f"{'step':>8}  {'status':<10}  {'kind':<8}  {'size':>10}  {'age':>6}  {'run':<8}  {'world':>5}  "
              f"{'zero':>4}  {'weights':<7}  reason")
    lines = [header]
    for ckpt in resolution.checkpoints:
        reason = ckpt.reason or "ok"
        if resolution.checkpoint is not None and ckpt.path == resolution.checkpoint.path:
            reason += "  <- resume"
        run = (ckpt.run_id or UNKNOWN)[:RUN_ID_SHOWN_CHARS]
        lines.append(printable(
            f"{ckpt.step:>8}  {ckpt.status.value:<10}  {ckpt.kind or UNKNOWN:<8}  "
            f"{_human_bytes(ckpt.size_bytes):>10}  {_human_age(ckpt.written_at, now):>6}  {run:<8}  "
            f"{_shown(ckpt.world_size):>5}  {_shown(ckpt.zero_stage):>4}  "
            f"{WEIGHTS_SHOWN.get(ckpt.weights or '', UNKNOWN):<7}  {reason}"
        ))
    return lines


def _shown(value: int | None) -> str:
    return UNKNOWN if value is None else str(value)


def _on_world(resolution: protocol.Resolution, world_size: int | None) -> elastic_plan.Plan | None:
    """What resuming the chosen checkpoint on ``world_size`` ranks takes (None: not asked, or none chosen)."""
    if world_size is None or resolution.checkpoint is None:
        return None
    return elastic_plan.plan(resolution.checkpoint.path, world_size, check_batch=True)


def _exit_code(resolution: protocol.Resolution, on_world: elastic_plan.Plan | None = None) -> int:
    if on_world is not None and not on_world.resumable:
        return EXIT_NONE_RESUMABLE
    if resolution.checkpoint is not None:
        return EXIT_RESUMABLE
    return EXIT_NONE_RESUMABLE if resolution.checkpoints else EXIT_NO_CHECKPOINT


def run(argv: Sequence[str] | None = None, *, dir_lock: DirLock | None = None) -> int:
    """``dir_lock``: the output directory's lock, for ``--reseal`` (the ``ckpt-check`` command hands it in)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.reseal:
        _refuse_beside_reseal(parser, args)
        return _reseal(args.out_dir, dir_lock)
    world_size = parse_world_size(args.world_size)  # before anything is read or moved
    _check_out_dir(args.out_dir)
    progress, close = _deep_progress(args.out_dir) if args.deep else (None, lambda: None)
    try:
        resolution = protocol.find_resumable(args.out_dir, strict=args.strict, deep=args.deep, progress=progress)
    finally:
        close()
    moved = _quarantine(resolution) if args.quarantine else []
    on_world = _on_world(resolution, world_size)
    code = _exit_code(resolution, on_world)
    resume = str(resolution.checkpoint.path) if code == EXIT_RESUMABLE and resolution.checkpoint else ""
    if args.json:
        report = _as_json(args.out_dir, resolution, moved, code, resume)
        if world_size is not None:
            report["on_world_size"] = _plan_json(on_world, world_size)
        print(json.dumps(report, indent=1))  # ASCII-only
        return code
    for note in resolution.ignored:
        print(printable(f"ckpt-check: ignored {note}", sys.stderr), file=sys.stderr)
    for aside in (a for a in resolution.set_aside if a.kind == "superseded"):  # quarantined: as before, unlisted
        print(printable(f"ckpt-check: set aside {aside.name}: {aside.what}", sys.stderr), file=sys.stderr)
    if resolution.checkpoints:
        print("\n".join(_table(resolution, time.time())))
    else:
        print(printable(f"no checkpoint-<step> directory in {args.out_dir}: a fresh start"))
    for src, dst in moved:
        print(printable(f"quarantined {src} -> {dst}", sys.stderr), file=sys.stderr)
    if on_world is not None:
        verdict = {elastic_plan.REFUSED: "no"}.get(on_world.action, "yes")
        print(printable(f"on {on_world.world_size} ranks: {verdict} ({on_world.action}): {on_world.reason}"))
    _print_path(resume)
    return code


def _refuse_beside_reseal(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--reseal does one thing: an option it would ignore (a world size to check, a quarantine) is refused."""
    given = [action.option_strings[0] for action in parser._actions
             if action.option_strings and action.dest not in ("reseal", "help")
             and getattr(args, action.dest) != action.default]
    if given:
        raise UsageError(f"--reseal with {', '.join(given)}: --reseal writes one checkpoint's manifest and does "
                         f"nothing else: nothing done. HINT: ckpt-check --reseal {args.out_dir} alone, then "
                         f"ckpt-check {' '.join(given)} OUT_DIR for the rest")


def _reseal(ckpt_dir: str, dir_lock: DirLock | None) -> int:
    from slurm_jit.checkpoint import reseal

    if dir_lock is None:
        raise UsageError(f"{ckpt_dir}: this entry point cannot take the output directory's lock: not resealed. "
                         f"HINT: run the ckpt-check command (python -m {RESEAL_COMMAND} --reseal {ckpt_dir})")
    try:
        done = reseal.reseal(ckpt_dir, dir_lock=dir_lock)
    except reseal.ResealRefusal as exc:
        raise UsageError(str(exc)) from None
    if done.backup is None:
        print(printable(f"{done.path}: the manifest already matches its {done.files} files: nothing resealed"))
    else:
        print(printable(f"resealed {done.path}: {done.files} files, {_human_bytes(done.total_bytes)}; the old "
                        f"manifest is {done.backup.name}"))
    return EXIT_RESUMABLE


def _quarantine(resolution: protocol.Resolution) -> list[tuple[Path, Path]]:
    try:
        return protocol.quarantine(resolution)
    except protocol.QuarantineError as exc:
        done = "".join(f"; moved {src} -> {dst}" for src, dst in exc.moved)
        raise UsageError(f"could not rename {exc.src} to {exc.dst.name}: {exc.strerror}; nothing was deleted{done}. "
                         "HINT: run as the owner of the directory, or without --quarantine") from None


def _print_path(path: str) -> None:
    """The resume path as the file system spells it (bytes), whatever the output encoding, as the last line."""
    sys.stdout.flush()
    sys.stdout.buffer.write(os.fsencode(path) + b"\n")
    sys.stdout.buffer.flush()


def _as_json(out_dir: str, resolution: protocol.Resolution, moved: list[tuple[Path, Path]], code: int,
             resume: str) -> dict[str, object]:
    return {
        "out_dir": out_dir,
        "exit_code": code,
        "resume_from": resume or None,
        "checkpoints": [
            {"path": str(c.path), "step": c.step, "status": c.status.value, "kind": c.kind,
             "world_size": c.world_size, "zero_stage": c.zero_stage, "weights": c.weights,
             "size_bytes": c.size_bytes, "mtime": c.mtime, "written_at": c.written_at or None,
             "run_id": c.run_id, "save_seq": c.save_seq, "reason": c.reason,
             "resumable": resolution.checkpoint is not None and c.path == resolution.checkpoint.path}
            for c in resolution.checkpoints
        ],
        "ignored": resolution.ignored,
        "set_aside": [{"name": a.name, "kind": a.kind, "what": a.what} for a in resolution.set_aside],
        "quarantined": [{"from": str(a), "to": str(b)} for a, b in moved],
    }


def _plan_json(on_world: elastic_plan.Plan | None, world_size: int) -> dict[str, object]:
    if on_world is None:
        return {"world_size": world_size, "resumable": False, "action": None, "reason": "no resumable checkpoint"}
    return {"world_size": world_size, "resumable": on_world.resumable, "action": on_world.action,
            "written_by": on_world.written_by, "zero_stage": on_world.zero_stage, "reason": on_world.reason}


def main(argv: Sequence[str] | None = None, *, dir_lock: DirLock | None = None) -> None:
    """Exit 0/1/3 with a verdict; 2 with one line on standard error when there is none (never a traceback)."""
    try:
        code = run(argv, dir_lock=dir_lock)
    except UsageError as exc:
        _fail(f"ckpt-check: {exc}")
        code = EXIT_USAGE
    except BrokenPipeError:  # `ckpt-check OUT | head -1`: the reader left before the last line (the verdict)
        _silence_stdout()
        _fail("ckpt-check: standard output was closed before the resume path (the last line) was written. "
              "HINT: read the last line, e.g. `ckpt-check OUT | tail -n 1`, or use the exit status alone")
        code = EXIT_USAGE
    except OSError as exc:
        hint = "HINT: check the path and that you may read it"
        _fail(f"ckpt-check: {exc.filename or ''}: {exc.strerror or exc}. {hint}")
        code = EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - a crash must never read as a verdict (exit 1 = "none resumable")
        _fail(f"ckpt-check: internal error, no verdict: {type(exc).__name__}: {exc}. "
              "HINT: do not resubmit on this result; report it with the directory listing")
        code = EXIT_USAGE
    sys.exit(code)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not raise on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _fail(message: str) -> None:
    try:
        print(printable(message, sys.stderr), file=sys.stderr)
    except Exception:  # noqa: BLE001 - stderr itself unusable: the exit status still says "no verdict"
        pass


if __name__ == "__main__":
    main()
