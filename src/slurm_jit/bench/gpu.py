"""Row 9: the GPU rows, the ones ``tools/gpu-check`` measures (:mod:`slurm_jit.bench.gpu_check`), and the one
measurement of their own: the device-to-host copy (the write floors are :mod:`slurm_jit.bench.floors`').

``tools/bench`` runs the GPU check's profile where torch sees a GPU (under 8 minutes more:
:func:`slurm_jit.bench.gpu_check.bench_rows`); elsewhere the rows are skipped: no GPU was lent. The rows' names and
what they compare are defined here once, for both.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from slurm_jit.bench.rows import NO_TARGET

COPY_TRIALS = 5  # best of 5: the copy is what the machine can do, so the fastest trial is the measure
COPY_TIMEOUT_S = 300  # the copy probe's process: torch's import, CUDA's start, 5 copies of 1 GiB
NO_GPU = "no GPU was lent"  # why the rows are skipped where torch sees none

BITWISE, SHARED = "gpu_resume_bitwise", "gpu_shared_agreed_step"
FLOOR_DISK, FLOOR_TMPFS = "gpu_save_over_write_floor_disk", "gpu_save_over_write_floor_tmpfs"
COPY_PINNED, COPY_PAGEABLE = "gpu_d2h_copy_pinned", "gpu_d2h_copy_pageable"
ASYNC_STAGING = "gpu_async_staging_devices"
# in the order measured
GPU_ROWS = (BITWISE, FLOOR_TMPFS, FLOOR_DISK, COPY_PINNED, COPY_PAGEABLE, ASYNC_STAGING, SHARED)
_FLOOR = ("the JIT save's time (its timing record, every phase) over the raw write floor: its files (the manifest's, "
          "the same sizes) written from memory by one thread per rank (bench/floors.py: os.write in 8 MiB chunks, "
          "fsync each file) in the same filesystem")
ROW_SPECS: dict[str, tuple[str, str, str]] = {  # name -> (unit, target, what it compares)
    BITWISE: ("equal", ">= 1.0", "1 rank, ZeRO-2 (bf16 on CUDA): a JIT stop by a real SIGTERM and its resume to the "
              "end against a run that never stopped: the complete state (python -m slurm_jit.exactness), the "
              "weights' digest, the losses (1: all bitwise equal)"),
    FLOOR_DISK: ("ratio", NO_TARGET, f"{_FLOOR}, on the local disk (the fastest of 5; their spread in the details)"),
    FLOOR_TMPFS: ("ratio", NO_TARGET, f"{_FLOOR}, on tmpfs (best of 3)"),
    COPY_PINNED: ("GB/s", NO_TARGET, "device-to-host copy of one large tensor into a pinned host buffer allocated "
                  "once (best of 5)"),
    COPY_PAGEABLE: ("GB/s", NO_TARGET, "device-to-host copy of one large tensor into a pageable host buffer "
                    "allocated once (best of 5)"),
    ASYNC_STAGING: ("equal", ">= 1.0", "an async save's staging of a tensor on each device behind a ~1 s kernel "
                    "(cuda:0; with 2 GPUs cuda:1, from a thread on cuda:1 and on cuda:0), at once and deferred to the "
                    "background writer: the buffers and the file written equal the tensor (1: every case)"),
    SHARED: ("agreed", ">= 1.0", "2 ranks sharing the one GPU, the model's collectives over gloo (NCCL refuses two "
             "ranks on one GPU), SIGTERM 0.5 s apart: both ranks' stop records name one step, the checkpoint of "
             "that step complete, clean exits (1: yes)"),
}


def copy_probe(device: str, nbytes: int, trials: int = COPY_TRIALS) -> dict[str, Any]:
    """GB/s of a copy of ``nbytes`` from ``device`` into a pinned and into a pageable host buffer (each allocated
    and touched once, best of ``trials``), and what ran it. Pinned memory needs CUDA: None without it."""
    import torch

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    found: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                             "device_name": torch.cuda.get_device_name(0) if cuda else "cpu (no device)"}
    for kind in ("pinned", "pageable"):
        if kind == "pinned" and not cuda:
            found[kind] = None
            continue
        dst = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
        best_s = float("inf")
        for _ in range(trials):
            sync()
            start_s = time.perf_counter()
            dst.copy_(src, non_blocking=kind == "pinned")
            sync()
            best_s = min(best_s, time.perf_counter() - start_s)
        found[kind] = nbytes / best_s / 1e9
        del dst
    return found


def copy_probe_in_child(device: str, nbytes: int) -> dict[str, Any]:
    """:func:`copy_probe` in a process of its own: its CUDA context ends with it (the device kept free)."""
    code = ("import json, sys; from slurm_jit.bench.gpu import copy_probe; "
            "print(json.dumps(copy_probe(sys.argv[1], int(sys.argv[2]))))")
    proc = subprocess.run([sys.executable, "-c", code, device, str(nbytes)], capture_output=True, text=True,
                          timeout=COPY_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the copy probe exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
