"""tools/gpu-check: its --cpu run in the suite (the same script as on a GPU, on CPU ranks with a tiny model), so
that it cannot rot: exit 0, every row printed and written, a JIT stop resumed bitwise and 2 ranks signalled 0.5 s
apart on one agreed step. Its exit status and refusals. The floors' and copies' numbers are reported, never
asserted (STYLE.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_jit.bench import gpu, gpu_check, staging_check
from slurm_jit.bench.rows import NO_TARGET, failed, measured, skipped

GPU_CHECK = Path(__file__).resolve().parents[2] / "tools" / "gpu-check"
CPU_RUN_TIMEOUT_S = 600  # ~1-3 min on 2 cores (5 one-rank runs and one of 2 ranks); a hang fails here


@pytest.mark.deepspeed
def test_gpu_check_on_cpu_ranks_passes_and_writes_every_row(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([str(GPU_CHECK), "--cpu", "--out", str(out), "--work-dir", str(work)],
                          capture_output=True, text=True, timeout=CPU_RUN_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads((out / "gpu-check.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == list(gpu.GPU_ROWS)
    for name, row in rows.items():
        assert json.loads((out / f"{name}.json").read_text()) == row
        assert f"gpu-check: {name} = " in proc.stdout
    bitwise = rows[gpu.BITWISE]
    assert bitwise["value"] == 1.0 and bitwise["met"] is True
    assert all(bitwise["details"]["checks"].values()), bitwise
    assert bitwise["details"]["exactness"].startswith("bitwise equal")
    assert gpu_check.CPU.signal_after <= bitwise["details"]["stop_step"] < gpu_check.CPU.steps
    shared = rows[gpu.SHARED]
    assert shared["met"] is True and shared["details"]["codes"] == [0, 0]
    steps = {rank["step"] for rank in shared["details"]["ranks"].values()}
    assert len(shared["details"]["ranks"]) == 2 and steps == {shared["details"]["stop_record_step"]}
    for name in (gpu.FLOOR_DISK, gpu.FLOOR_TMPFS):
        assert rows[name]["value"] > 0 and rows[name]["details"]["floor_s"] > 0, rows[name]
        assert rows[name]["details"]["bytes"] > 0
    assert rows[gpu.COPY_PINNED]["note"].startswith("skipped: pinned host memory needs CUDA")
    assert rows[gpu.COPY_PAGEABLE]["value"] > 0
    staged = rows[gpu.ASYNC_STAGING]
    assert staged["met"] is True and [c["device"] for c in staged["details"]["cases"]] == ["cpu"], staged
    assert doc["meta"]["leftover_ranks"] == []
    assert not list(work.iterdir()), "the runs' directories are removed after the run"
    tmpfs_runs = doc["meta"]["bitwise_runs_in"].split(" ")[0]
    assert tmpfs_runs.startswith(str(work)) or not Path(tmpfs_runs).exists(), "the tmpfs runs are removed too"


def test_the_staging_cases_need_a_second_gpu_for_cuda_1() -> None:
    assert staging_check.cases("cpu", 0) == [("cpu", None)]
    assert staging_check.cases("cuda", 1) == [("cuda:0", "cuda:0")]
    assert staging_check.cases("cuda", 4) == [("cuda:0", "cuda:0"), ("cuda:1", "cuda:1"), ("cuda:1", "cuda:0")]


def test_a_staging_case_on_cpu_compares_buffers_and_file_with_the_source(tmp_path: Path) -> None:
    """The row's own code, in this process (the suite's --cpu run takes it through a child process)."""
    found = staging_check.check_case("cpu", None, tmp_path)
    assert found["equal"] and found["at_once_equal"] and found["deferred_equal"] and found["written_equal"], found
    assert (tmp_path / "checkpoint-1" / "x.pt").is_file()


def test_the_exit_status_is_1_for_a_missed_target_or_a_row_not_measured() -> None:
    ok = measured(gpu.BITWISE, 1.0, "equal", ">= 1.0", "-")
    reported = measured(gpu.FLOOR_DISK, 7.0, "ratio", NO_TARGET, "-")
    skip = skipped(gpu.COPY_PINNED, "GB/s", NO_TARGET, "-", "pinned host memory needs CUDA (--cpu)")
    assert gpu_check.exit_status([ok, reported, skip]) == 0
    assert gpu_check.exit_status([ok, measured(gpu.SHARED, 0.0, "agreed", ">= 1.0", "-")]) == 1
    assert gpu_check.exit_status([ok, failed(gpu.FLOOR_TMPFS, "ratio", NO_TARGET, "-", "RuntimeError: x")]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is seen here")
def test_the_gpu_check_without_a_gpu_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "HINT: " in err and "--cpu" in err, err
    assert not (tmp_path / "out").exists(), "refused before anything is written"


def test_an_out_dir_that_cannot_be_one_is_refused_in_one_line(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert gpu_check.main(["--cpu", "--out", str(a_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "HINT: " in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is seen here")
def test_demo_train_on_cuda_without_one_is_refused_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "slurm_jit.demo_train", "--output-dir", str(tmp_path / "out"),
                           "--device", "cuda"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("demo_train:")]
    assert len(lines) == 1 and "HINT: " in lines[0] and "--device cpu" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
