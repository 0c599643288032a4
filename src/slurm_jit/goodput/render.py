"""The report's tables (Markdown) and each system's timeline picture (an SVG written by hand: the venv has no
matplotlib). Pure: text in, text out."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from slurm_jit.goodput.chain import Chain
from slurm_jit.goodput.predict import Prediction
from slurm_jit.goodput.report import RESTART_PARTS, RunFacts, SystemReport
from slurm_jit.goodput.systems import SYSTEMS


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _weights(equal: bool | None, key: str) -> str:
    if equal is None:
        return "no final state"
    return ("bitwise equal" if key == "c" else "equal (sha256)") if equal else "differ"


def summary_table(reports: Sequence[SystemReport], predictions: dict[str, Prediction]) -> str:
    rows = ["| system | goodput | at the chain's pace | calculator | allocated s | uninterrupted s | queued s | "
            "jobs / runs | steps computed (redone) | final weights | outcome |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        p = predictions.get(r.key)
        calc = f"{_pct(p.predicted)} ({100 * p.error:.0f} % off)" if p else "-"
        paced = "-" if r.paced_goodput is None else _pct(r.paced_goodput)
        rows.append(f"| {SYSTEMS[r.key].label} | **{_pct(r.goodput)}** | {paced} | {calc} | {r.allocation_s:.0f} | "
                    f"{r.uninterrupted_s:.0f} | {r.queue_s:.0f} | {r.jobs} / {r.runs} | {r.steps_computed} "
                    f"({r.steps_redone}) | {_weights(r.weights_equal, r.key)} | {r.outcome} |")
    return "\n".join(rows)


def costs_table(report: SystemReport) -> str:
    """Every end of a run before the training's end, its cost split."""
    head = " / ".join(RESTART_PARTS).replace("_", " ")
    rows = [f"| run | end | last step | resumed after | redone (steps, s) | detection s | queue s | restart s: {head} "
            "| in allocation s |", "|---|---|---|---|---|---|---|---|---|"]
    for e in report.ends:
        parts = " / ".join(f"{e.restart[p]:.1f}" if p in e.restart else "-" for p in RESTART_PARTS)
        queue = "-" if e.queue_s is None else f"{e.queue_s:.1f}"
        rows.append(f"| {e.run + 1} | {e.kind} | {e.last_step if e.last_step is not None else '-'} | "
                    f"{e.kept_step if e.kept_step is not None else '-'} | {e.redone_steps}, {e.redone_s:.1f} | "
                    f"{e.detection_s:.1f} | {queue} | {e.restart_s:.1f}: {parts} | {e.total_s:.1f} |")
    matched = "" if report.startup_s is None or report.end_s is None else (
        f"; matched, the uninterrupted run's start-up and end ({report.startup_s[1]:.1f} s, {report.end_s[1]:.1f} s) "
        f"swapped for the chain's ({report.startup_s[0]:.1f} s, {report.end_s[0]:.1f} s): "
        f"{report.matched_loss_s:.1f}")
    rows.append(f"| | **sum** | | | | | | | **{report.split_s:.1f}** (measured loss: allocated - uninterrupted "
                f"= {report.loss_s:.1f}{matched}) |")
    return "\n".join(rows)


def scale_table(rows: dict[str, dict[tuple[str, int], tuple[float, int | None]]]) -> str:
    """{system key: {(mix, gpus): (goodput, advised save_steps)}} as a table."""
    keys = list(rows)
    cells = sorted({cell for per in rows.values() for cell in per}, key=lambda c: (c[0], c[1]))
    out = ["| failures | GPUs | " + " | ".join(SYSTEMS[k].label for k in keys) + " |",
           "|---|---|" + "---|" * len(keys)]
    for mix, gpus in cells:
        values = [rows[k].get((mix, gpus)) for k in keys]
        out.append(f"| {mix} | {gpus:,} | " + " | ".join(
            "-" if v is None else f"{_pct(v[0])} ({v[1] if v[1] is not None else '-'})" for v in values) + " |")
    return "\n".join(out)


WIDTH, HEIGHT, PAD = 760, 300, 50
COLOURS = {"kill": "#c0392b", "hang": "#8e44ad", "preempt": "#d35400"}


def timeline_svg(report: SystemReport, runs: Sequence[RunFacts], chain: Chain, work_steps: int) -> str:
    """Steps over wall time from the chain's first allocation: allocations shaded, each run's steps a line,
    the faults marked."""
    if not runs:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="40"><text x="10" y="25">no run' \
               "</text></svg>\n"
    t0 = runs[0].run.start
    t1 = max((r.run.end or r.run.start) for r in runs)
    span = max(1.0, t1 - t0)

    def x(t: float) -> float:
        return PAD + (t - t0) / span * (WIDTH - 2 * PAD)

    def y(step: float) -> float:
        return HEIGHT - PAD - step / max(1, work_steps) * (HEIGHT - 2 * PAD)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
             'font-size="11">', f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
             f'<text x="{PAD}" y="18" font-size="13">{escape(SYSTEMS[report.key].label)}: goodput '
             f'{_pct(report.goodput)}</text>']
    for r in runs:  # allocations
        wide = max(1.0, x(r.run.end or t1) - x(r.run.start))
        parts.append(f'<rect x="{x(r.run.start):.1f}" y="{PAD}" width="{wide:.1f}" height="{HEIGHT - 2 * PAD}" '
                     'fill="#eaf2fb"/>')
    for r in runs:  # steps
        if r.steps:
            points = " ".join(f"{x(t):.1f},{y(s):.1f}" for s, t in r.steps[:: max(1, len(r.steps) // 300)])
            parts.append(f'<polyline points="{points}" fill="none" stroke="#2c3e50" stroke-width="1.5"/>')
    marks = [(t, kind) for r in runs for kind, (_, t) in r.faults.items()]
    if chain.preempt is not None:
        marks.append((chain.preempt[0], "preempt"))
    for t, kind in marks:
        parts.append(f'<line x1="{x(t):.1f}" y1="{PAD}" x2="{x(t):.1f}" y2="{HEIGHT - PAD}" '
                     f'stroke="{COLOURS.get(kind, "black")}" stroke-dasharray="4 3"/>'
                     f'<text x="{x(t) + 3:.1f}" y="{PAD + 12}" fill="{COLOURS.get(kind, "black")}">{kind}</text>')
    parts += [f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
              f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
              f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 18}" text-anchor="end">{span:.0f} s (wall, queues '
              'included; shaded: allocated)</text>',
              f'<text x="{PAD - 5}" y="{PAD + 4}" text-anchor="end">{work_steps}</text>',
              f'<text x="{PAD - 5}" y="{HEIGHT - PAD}" text-anchor="end">0</text>',
              f'<text x="12" y="{HEIGHT / 2}" transform="rotate(-90 12 {HEIGHT / 2})">step</text>', "</svg>", ""]
    return "\n".join(parts)
