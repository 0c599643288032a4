"""``tools/faults [--quick] [--out DIR]``: run every fault row, print the table, write ``DIR/results.json``.

``--quick`` is the subset CI runs (every row but the signal storms and the async-save kills, fewer kills, a small
state); the full run is the one whose table is in docs/faults.md. ``--only NAME`` runs one row alone (with
``--quick``: its short form): ``async-kills`` (SIGKILL in an async periodic save, issue #23). Needs root (tmpfs
and read-only mounts) and 2+ CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from slurm_jit.faults import async_kills, common, corruption, disk_full, kills, races, read_only, security, storms

DEFAULT_OUT = "fault-results"
ONLY = {async_kills.NAME: async_kills.run_row}  # rows that run alone: tools/faults --only NAME


def run_rows(scratch: Path, quick: bool, kill_trials: int = kills.FULL_TRIALS_PER_STAGE) -> list[common.Row]:
    sample_dir = scratch / "sample"
    sample_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    row, resume_args = kills.run_row(scratch / "kills", quick, sample_dir, kill_trials)
    rows.append(_show(row))
    samples = sorted(sample_dir.glob("checkpoint-*"))
    rows.append(_show(disk_full.run_row(scratch / "disk-full", quick)))
    if samples:
        rows.append(_show(read_only.run_row(scratch / "read-only", quick, samples[0], resume_args)))
        rows.append(_show(corruption.run_row(scratch / "corruption", samples[0])))
    else:
        rows.append(_show(common.Row(name="read-only output directory / corruption", trials=0, false_complete=0,
                                     lost_steps=0, passed=False, detail="row 1 left no complete checkpoint")))
    if not quick:
        rows.append(_show(storms.run_row(scratch / "storms")))
        rows.append(_show(async_kills.run_row(scratch / "async-kills", quick)))
    rows.append(_show(races.run_row(scratch / "races")))
    if samples:
        rows.append(_show(security.run_row(scratch / "security", samples[0], quick, resume_args)))
    return rows


def _show(row: common.Row) -> common.Row:
    print(f"faults: {'pass' if row.passed else 'FAIL'}  {row.name} ({row.seconds:.0f} s)", flush=True)
    return row


def table(rows: Sequence[common.Row]) -> str:
    """The Markdown table (docs/faults.md has one of a full run)."""
    lines = ["| fault | trials | false complete | lost steps | passed | seconds | detail |",
             "|---|---:|---:|---:|---|---:|---|"]
    for r in rows:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.name} | {r.trials} | {r.false_complete} | {r.lost_steps} | "
                     f"{'yes' if r.passed else '**no**'} | {r.seconds:.0f} | {detail} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the fast subset (CI)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"where results.json goes (default {DEFAULT_OUT}/)")
    parser.add_argument("--kill-trials", type=int, default=kills.FULL_TRIALS_PER_STAGE, metavar="N",
                        help=f"full run: SIGKILL trials per ZeRO stage (default {kills.FULL_TRIALS_PER_STAGE}: "
                             "50 in all, ~30-40 min on 2 loaded cores)")
    parser.add_argument("--only", choices=sorted(ONLY), default=None,
                        help="run this row alone (with --quick: its short form)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directories (runs, logs)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"tools/faults: cannot create {out}: {exc.strerror}. HINT: pass a writable --out DIR", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="slurm-jit-faults-"))
    t0, started = time.monotonic(), time.time()
    try:
        with common.sigterm_unwinds():  # a SIGTERM unwinds: rank groups killed, mounts and scratch removed
            rows = ([_show(ONLY[args.only](scratch / args.only, args.quick))] if args.only else
                    run_rows(scratch, args.quick, args.kill_trials))
    finally:
        if args.keep:
            print(f"tools/faults: scratch kept in {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    result = {"quick": args.quick, "kill_trials_per_stage": None if args.quick else args.kill_trials,
              "started": started, "seconds": round(time.monotonic() - t0, 1),
              "cpus": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0],
              "rows": [r.as_json() for r in rows]}
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "table.md").write_text(table(rows) + "\n")
    print(table(rows))
    print(f"tools/faults: {sum(r.passed for r in rows)}/{len(rows)} rows passed in {result['seconds']:.0f} s; "
          f"{out / 'results.json'}")
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
