"""The demo's last word: per-step losses of a requeued run against an uninterrupted one.

    python -m slurm_jit.launch.compare OUT_DIR REFERENCE_OUT_DIR

Reads ``losses-rank0.jsonl`` of both (written by :mod:`slurm_jit.demo_train`); for steps logged more than once
(a stopped run's steps that its resume repeated) the last run's loss counts. Prints where each restart resumed,
the steps around it side by side, a small text chart of both curves, and exits 0 only when every step's loss is
equal (bitwise), 1 otherwise.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from slurm_jit.launch import progress

CHART_WIDTH = 60
CHART_HEIGHT = 12
AROUND_RESTART = 2  # steps shown on each side of a restart


def read_losses(out_dir: str) -> list[tuple[int, float]]:
    path = Path(out_dir) / "losses-rank0.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [(int(r["step"]), float(r["loss"])) for r in rows]


def restarts(out_dir: str, logged: list[tuple[int, float]]) -> list[int]:
    """The steps runs resumed after: the launcher's requeued stops, and where the logged step does not increase
    (a run that logged steps past its last checkpoint)."""
    history = progress.read(out_dir).get("history")
    requeued = {h["step"] for h in history if isinstance(h, dict) and h.get("requeue")
                and isinstance(h.get("step"), int)} if isinstance(history, list) else set()
    repeated = {prev for (prev, _), (step, _) in zip(logged, logged[1:], strict=False) if step <= prev}
    return sorted(requeued | repeated)


def chart(series: dict[str, dict[int, float]], marks: list[int]) -> list[str]:
    """A text plot: one column per bucket of steps, '*' requeued run, 'o' reference, '#' both, '|' restart."""
    values = [v for s in series.values() for v in s.values()]
    steps = sorted({k for s in series.values() for k in s})
    if not values or not steps:
        return []
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    grid = [[" "] * CHART_WIDTH for _ in range(CHART_HEIGHT)]
    last = steps[-1]
    for col in range(CHART_WIDTH):
        if any(int(m * (CHART_WIDTH - 1) / last) == col for m in marks):
            for cells in grid:
                cells[col] = "|"
    for symbol, points in zip("*o", series.values(), strict=False):
        for step, value in points.items():
            col = int(step * (CHART_WIDTH - 1) / last)
            line = CHART_HEIGHT - 1 - int((value - low) / span * (CHART_HEIGHT - 1))
            here = grid[line][col]
            grid[line][col] = "#" if here in "*o#" and here != symbol else symbol
    labels = {0: f"{high:.3f}", CHART_HEIGHT - 1: f"{low:.3f}"}
    return [f"{labels.get(i, ''):>7} {''.join(cells)}" for i, cells in enumerate(grid)]


def compare(out_dir: str, reference_dir: str) -> tuple[bool, list[str]]:
    logged = read_losses(out_dir)
    run = dict(logged)  # the last loss logged for each step
    reference = dict(read_losses(reference_dir))
    marks = restarts(out_dir, logged)
    differ = sorted(s for s in set(run) | set(reference) if run.get(s) != reference.get(s))
    lines = [f"losses: {len(run)} steps in the requeued run, {len(reference)} in the uninterrupted one; "
             f"restarts after step(s) {', '.join(map(str, marks)) or 'none'}"]
    for mark in marks:
        for step in range(mark - AROUND_RESTART + 1, mark + AROUND_RESTART + 1):
            if step in run or step in reference:
                lines.append(f"  step {step:>5}: requeued {run.get(step)!s:>22}   uninterrupted "
                             f"{reference.get(step)!s:>22}{'' if run.get(step) == reference.get(step) else '  DIFF'}")
    lines.append("  loss by step: * requeued run, o uninterrupted, # both, | restart")
    lines += chart({"requeued": run, "reference": reference}, marks)
    lines.append("equal: every step's loss is bitwise the same" if not differ
                 else f"DIFFERENT at {len(differ)} step(s), first {differ[0]}")
    return not differ, lines


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m slurm_jit.launch.compare OUT_DIR REFERENCE_OUT_DIR", file=sys.stderr)
        sys.exit(2)
    try:
        same, lines = compare(args[0], args[1])
    except (OSError, ValueError, KeyError) as exc:
        print(f"compare: cannot read the losses: {exc}. HINT: both directories need losses-rank0.jsonl",
              file=sys.stderr)
        sys.exit(2)
    print("\n".join(lines))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
