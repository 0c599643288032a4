"""The async save's device-to-host staging on a real device (issue #42 item 1), a row of ``tools/gpu-check``.

An async periodic save stages a rank's tensors into pinned host buffers with non-blocking copies: the ones taken at
once on the training thread, the deferred ones in the background writer's thread, whose current CUDA device is
cuda:0 whatever device the rank uses (the current device is per thread). Each copy must be waited for on its own
device before the buffers are saved. Each case here stages a tensor on a device, with a long kernel queued on that
device first (so that a copy lands about a second late), once at once and once deferred to the real
:class:`~slurm_jit.train.async_save.writer.BackgroundWriter`, and checks that the buffers and the file the writer
saved hold the tensor's values of the staging: a wait for the wrong device reads the previous save's bytes.

Cases: cuda:0; with 2 GPUs or more, cuda:1 as a rank using it sees it (its thread's current device cuda:1) and with
the thread's current device left at cuda:0. ``--cpu``: one case on the CPU (no device to wait for: the harness
itself, so that it cannot rot).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from slurm_jit.bench.gpu import ASYNC_STAGING, ROW_SPECS
from slurm_jit.bench.rows import Row, measured

NUMEL = 16 * 2**20  # 64 MiB of float32: a copy long enough to be seen late
SLEEP_CYCLES = 2**31  # torch.cuda._sleep's spin: ~1 s at a GPU's ~2 GHz clock, before each copy on its device
PROBE_TIMEOUT_S = 300  # the probe's process: torch's import, CUDA's start, a few copies of 64 MiB


def cases(device: str, device_count: int) -> list[tuple[str, str | None]]:
    """(the tensor's device, this thread's current device or None: left as it is) to check; pure."""
    if device != "cuda":
        return [("cpu", None)]
    found: list[tuple[str, str | None]] = [("cuda:0", "cuda:0")]
    if device_count >= 2:
        found += [("cuda:1", "cuda:1"), ("cuda:1", "cuda:0")]
    return found


def check_case(device: str, current: str | None, work: Path) -> dict[str, Any]:
    """One case: whether the buffers and the written file equal the source at each staging."""
    import torch

    from slurm_jit.train.async_save import files, staging, writer

    if current is not None:
        torch.cuda.set_device(current)
    cuda = device.startswith("cuda")

    def late() -> None:  # a long kernel ahead of the copies on the tensor's device
        if cuda:
            with torch.cuda.device(device):
                torch.cuda._sleep(SLEEP_CYCLES)

    source = torch.arange(1, NUMEL + 1, dtype=torch.float32, device=device)
    stager = staging.HostStager(copy_threads=1)
    result: dict[str, Any] = {"device": device, "current": current, "pinned": stager.pin}
    try:
        late()
        first = stager.stage({"x.pt": {"x": source}})  # copied at once (the training thread's copies)
        result["at_once_equal"] = bool(torch.equal(first.states["x.pt"]["x"], source.cpu()))
        first.release()
        late()
        source.mul_(2)  # queued behind the kernel too: the deferred copy must see it
        expected = source.cpu()
        staged = stager.stage({"x.pt": {"x": source}}, defer=True)
        background = writer.BackgroundWriter(zip_crc32=False)
        try:
            path = work / "checkpoint-1" / "x.pt"
            background.submit(path.parent, [(path, files.Later(lambda: staged.states["x.pt"]))],
                              wait_if_busy=False, release=staged.release, prepare=staged.copy_pending)
            background.wait()
        finally:
            background.close()
        result["deferred_equal"] = bool(torch.equal(staged.states["x.pt"]["x"], expected))
        result["written_equal"] = bool(torch.equal(torch.load(path, map_location="cpu")["x"], expected))
    finally:
        stager.free()
    result["equal"] = all(result[k] for k in ("at_once_equal", "deferred_equal", "written_equal"))
    return result


def probe(device: str) -> dict[str, Any]:
    """Every case of ``device`` ("cuda" or "cpu"), and what ran them."""
    import torch

    count = torch.cuda.device_count() if device == "cuda" else 0
    with tempfile.TemporaryDirectory(prefix="slurm-jit-staging-check-") as work:
        found = [check_case(d, current, Path(work) / f"case{i}")
                 for i, (d, current) in enumerate(cases(device, count))]
    return {"device_count": count, "cases": found}


def probe_in_child(device: str) -> dict[str, Any]:
    """:func:`probe` in a process of its own: its CUDA context ends with it (the device kept free)."""
    code = ("import json, sys; from slurm_jit.bench.staging_check import probe; "
            "print(json.dumps(probe(sys.argv[1])))")
    proc = subprocess.run([sys.executable, "-c", code, device], capture_output=True, text=True,
                          timeout=PROBE_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the staging probe exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def row(device: str) -> Row:
    """The row: 1 when every case's buffers and file equal the source, its cases in the details."""
    found = probe_in_child(device)
    ok = all(case["equal"] for case in found["cases"])
    ran = "; ".join(f"{c['device']} from a thread on {c['current'] or 'its default'}: "
                    f"{'equal' if c['equal'] else 'NOT equal'}" for c in found["cases"])
    if device == "cuda" and found["device_count"] < 2:
        ran += "; cuda:1 skipped (1 GPU)"
    return measured(ASYNC_STAGING, float(ok), *ROW_SPECS[ASYNC_STAGING], note=ran, **found)
