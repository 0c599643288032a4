"""The GPU rows (bench/gpu.py; tools/bench's entry is gpu_check.bench_rows): their own measurement (the
device-to-host copy) on this machine's real tensors, their names in tools/bench, and the rows where no GPU is seen:
skipped, every one, saying so. Numbers are reported, never asserted; the write floor they share with tools/bench is
tested in test_floors.py."""

from __future__ import annotations

import pytest
import torch

from slurm_jit.bench import gpu, gpu_check
from slurm_jit.bench.cli import ROW_NAMES
from slurm_jit.demo_train import deepspeed_config


def test_the_copy_probe_without_a_device_copies_host_to_host_and_skips_pinned() -> None:
    found = gpu.copy_probe("cpu", 2**20, trials=2)
    assert found["pinned"] is None and found["pageable"] > 0
    assert found["torch"] == torch.__version__ and found["device_name"] == "cpu (no device)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is seen: the rows are measured, not skipped")
def test_without_a_gpu_every_gpu_row_is_skipped_saying_no_gpu_was_lent() -> None:
    rows = gpu_check.bench_rows()
    assert [r.name for r in rows] == list(gpu.GPU_ROWS)
    for row in rows:
        assert row.value is None and row.met is None
        assert row.note.startswith("skipped: no GPU was lent"), row.note
        assert (row.unit, row.target, row.compares) == gpu.ROW_SPECS[row.name]


def test_tools_bench_lists_the_gpu_check_rows_last() -> None:
    assert ROW_NAMES[-len(gpu.GPU_ROWS):] == gpu.GPU_ROWS
    assert set(gpu.ROW_SPECS) == set(gpu.GPU_ROWS)


def test_the_cuda_deepspeed_config_enables_bf16_and_the_cpu_one_stays_as_it_was() -> None:
    assert deepspeed_config(2, bf16=True)["bf16"] == {"enabled": True}
    assert "bf16" not in deepspeed_config(2)
