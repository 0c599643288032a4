"""results.json, results.md (a table, text charts, the machine) and the table printed at the end of a run."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from slurm_jit.bench.rows import Row

BAR_WIDTH = 50  # characters of the longest bar in a text chart
HIST_BINS = 12


def _disk(path: Path) -> str:
    """The filesystem the runs write to: device, type, size."""
    import psutil

    path = path.resolve()
    best = max((p for p in psutil.disk_partitions(all=True) if path.is_relative_to(p.mountpoint)),
               key=lambda p: len(p.mountpoint), default=None)
    usage = psutil.disk_usage(str(path))
    where = f"{best.device} ({best.fstype}) on {best.mountpoint}" if best else "unknown device"
    return f"{where}, {usage.total / 2**30:.0f} GiB, {usage.free / 2**30:.0f} GiB free"


def machine(work: Path) -> dict[str, Any]:
    """What the numbers depend on: cores, memory, the disk (the load is taken at the start and the end)."""
    mem_kib, cpu = 0, platform.machine()
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"nproc": os.cpu_count(), "ram_gib": round(mem_kib / 2**20, 1), "cpu": cpu,
            "kernel": platform.release(), "python": platform.python_version(), "disk": _disk(work)}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _met(row: Row) -> str:
    return {True: "yes", False: "**NO**", None: "-"}[row.met]


def _value(row: Row) -> str:
    return "skipped" if row.value is None else f"{row.value:g} {row.unit}"


def table(rows: list[Row]) -> list[str]:
    lines = ["| row | value | target | met | compares |", "|---|---|---|---|---|"]
    for r in rows:
        what = r.compares + (f" ({r.note})" if r.note else "")
        lines.append(f"| `{r.name}` | {_value(r)} | {r.target} | {_met(r)} | {what} |")
    return lines


def text_table(rows: list[Row]) -> str:
    width = max(len(r.name) for r in rows)
    out = [f"{'row':<{width}}  {'value':>14}  {'target':<16} met"]
    for r in rows:
        met = {True: "yes", False: "NO", None: "-"}[r.met]
        out.append(f"{r.name:<{width}}  {_value(r):>14}  {r.target:<16} {met}")
    return "\n".join(out)


def bars(pairs: list[tuple[str, float]], unit: str) -> list[str]:
    """One text bar per (label, value), scaled to the largest."""
    top = max((v for _, v in pairs), default=0.0) or 1.0
    width = max(len(label) for label, _ in pairs)
    return [f"{label:<{width}} |{'#' * round(BAR_WIDTH * v / top):<{BAR_WIDTH}}| {v:.1f} {unit}"
            for label, v in pairs]


def histogram(series: dict[str, list[float]]) -> list[str]:
    """Side-by-side text histograms of step times (ms) over shared bins."""
    everything = [v for vs in series.values() for v in vs]
    lo, hi = min(everything), statistics.quantiles(everything, n=100)[98]
    step = (hi - lo) / HIST_BINS or 1e-9
    counts = {k: [0] * HIST_BINS for k in series}
    for name, values in series.items():
        for v in values:
            counts[name][min(HIST_BINS - 1, int((v - lo) / step))] += 1
    top = max(max(c) for c in counts.values()) or 1
    half = BAR_WIDTH // 2
    lines = [f"{'step ms':>9} | " + " | ".join(f"{k:<{half}}" for k in series)]
    for i in range(HIST_BINS):
        cells = " | ".join(f"{'#' * round(half * counts[k][i] / top):<{half}}" for k in series)
        lines.append(f"{(lo + i * step) * 1000:>9.1f} | {cells}")
    lines.append(f"(the top 1 % above {hi * 1000:.1f} ms counted in the last bin)")
    return lines


def _floor_pairs(by_name: dict[str, Row]) -> list[tuple[str, float]]:
    """(label, seconds): each measured save beside its write floor (on the disk: the floor's median)."""
    pairs: list[tuple[str, float]] = []
    for name, label in (("save_over_write_floor_zero2", "ZeRO-2 tmpfs"),
                        ("save_over_write_floor_zero3", "ZeRO-3 tmpfs"), ("save_over_write_floor_disk", "ZeRO-2 disk")):
        row = by_name.get(name)
        if row is None or row.value is None:
            continue
        floor_s = row.details["floor"]["median_s"] if "floor" in row.details else row.details["floor_s"]
        pairs += [(f"{label} floor", float(floor_s)), (f"{label} save ", float(row.details["save_s"]))]
    return pairs


def _charts(rows: list[Row]) -> list[str]:
    by_name = {r.name: r for r in rows}
    out: list[str] = []
    disk = by_name.get("disk_write")
    saves = [(n, float(by_name[n].details["save_mb_s"])) for n in ("save_bw_over_disk_zero2", "save_bw_over_disk_zero3")
             if n in by_name and by_name[n].details.get("save_mb_s")]
    if disk and disk.value and saves:
        pairs = [("disk write limit", disk.value)] + [(n.replace("save_bw_over_disk_", "JIT save "), v)
                                                     for n, v in saves]
        out += ["### Save bandwidth against the disk's write limit", "", "```", *bars(pairs, "MB/s"), "```", ""]
    floors = _floor_pairs(by_name)
    if floors:
        out += ["### JIT saves against the raw write floor (issue 34)", "", "```", *bars(floors, "s"), "```", ""]
    p99 = by_name.get("agreement_overhead_p99")
    if p99 and p99.details.get("jit_hist"):
        series = {"plain Trainer": p99.details["plain_hist"], "JitTrainer": p99.details["jit_hist"]}
        out += ["### Step-time distribution, with and without the agreement", "", "```", *histogram(series), "```",
                ""]
    sig = by_name.get("signal_exit_prediction_min")
    if sig and sig.details.get("trials"):
        pairs = []
        for i, (pred, meas) in enumerate(sig.details["trials"]):
            pairs += [(f"trial {i + 1:>2} measured ", meas), (f"trial {i + 1:>2} predicted", pred)]
        out += ["### Signal to exit (minus kill_wait) against the grace calculator's prediction", "", "```",
                *bars(pairs, "s"), "```", ""]
    return out


def write(out_dir: Path, rows: list[Row], meta: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "rows": [r.as_json() for r in rows]}
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    lines = ["# slurm-jit benchmarks", "",
             f"`tools/bench {meta['profile_flag']}`".replace(" `", "`"), "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in meta["machine"].items()), "",
             f"Model of the save, memory, verify and resume rows: GPT-2 width {meta['model']['width']}, "
             f"{meta['model']['layers']} layers, {meta['model']['params'] / 1e6:.1f} M parameters, fp32, 2 ranks.", "",
             f"Load average (1, 5, 15 min) at the start {meta['load_start']}, at the end {meta['load_end']}; "
             f"ran {meta['wall_s']:.0f} s, {meta['started_utc']}.", "",
             *table(rows), "", *_charts(rows)]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
