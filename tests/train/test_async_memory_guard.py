"""The memory guard of async periodic saves (train/async_save/memory_guard.py): the staging buffer is allocated only
where host memory (psutil) and the process's cgroup limit (Slurm's --mem) can hold it; else one line with a HINT."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from slurm_jit.train.async_save import memory_guard
from slurm_jit.train.async_save.memory_guard import HostMemoryError, check_host_memory

GIB = 1024**3


def _fake_available(monkeypatch: pytest.MonkeyPatch, available: int) -> None:
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=available))
    monkeypatch.setattr(memory_guard, "cgroup_room", lambda *_: None)


def test_a_buffer_that_fits_passes_on_this_machine() -> None:
    check_host_memory(64 * 1024**2)  # the real psutil and cgroup numbers of this machine


def test_a_buffer_over_the_available_memory_less_the_margin_is_one_line_with_a_hint(monkeypatch) -> None:
    _fake_available(monkeypatch, 3 * GIB)
    check_host_memory(2 * GIB - 1)  # 3 GiB less the 1 GiB margin
    with pytest.raises(HostMemoryError) as caught:
        check_host_memory(2 * GIB + 1)
    line = str(caught.value)
    assert "\n" not in line and "2.00 GiB" in line and "safety margin" in line
    assert "periodic saves stay synchronous. HINT: ask for more memory (#SBATCH --mem)" in line


def test_ranks_of_one_node_share_the_available_memory(monkeypatch) -> None:
    _fake_available(monkeypatch, 5 * GIB)
    check_host_memory(2 * GIB, sharing_ranks=2)
    with pytest.raises(HostMemoryError, match="shared by 4 ranks of this node"):
        check_host_memory(2 * GIB, sharing_ranks=4)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_v2_limit_of_an_ancestor_counts_without_its_inactive_page_cache(tmp_path) -> None:
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/job_7/step_0/task_0\n")
    root = tmp_path / "cgroup"
    _write(root / "job_7" / "memory.max", f"{4 * GIB}\n")  # Slurm's --mem=4G on the job's cgroup
    _write(root / "job_7" / "memory.current", f"{3 * GIB}\n")
    _write(root / "job_7" / "memory.stat", f"anon 1\ninactive_file {GIB}\n")
    _write(root / "job_7" / "step_0" / "task_0" / "memory.max", "max\n")
    assert memory_guard.cgroup_room(proc, root) == 2 * GIB


def test_the_cgroup_v1_memory_controller_limit_counts(tmp_path) -> None:
    proc = tmp_path / "proc_cgroup"
    proc.write_text("5:cpu,cpuacct:/x\n4:memory:/slurm/uid_0/job_9\n0::/\n")
    root = tmp_path / "cgroup"
    job = root / "memory" / "slurm" / "uid_0" / "job_9"
    _write(job / "memory.limit_in_bytes", f"{8 * GIB}\n")
    _write(job / "memory.usage_in_bytes", f"{2 * GIB}\n")
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    assert memory_guard.cgroup_room(proc, root) == 6 * GIB


def test_a_cgroup_limit_under_the_host_memory_refuses(monkeypatch) -> None:
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=100 * GIB))
    monkeypatch.setattr(memory_guard, "cgroup_room", lambda *_: 2 * GIB)
    with pytest.raises(HostMemoryError, match="the cgroup's memory limit: 2.00 GiB available"):
        check_host_memory(2 * GIB)


def test_the_margin_from_the_environment_refuses_on_the_real_numbers_of_this_machine(monkeypatch) -> None:
    check_host_memory(64 * 1024**2)  # the default 1 GiB margin: fits
    monkeypatch.setenv(memory_guard.MARGIN_ENV, "1PiB")  # more than any machine here has: nothing fits
    with pytest.raises(HostMemoryError, match=r"less a 1048576\.00 GiB safety margin\); periodic saves stay"):
        check_host_memory(64 * 1024**2)
    monkeypatch.setenv(memory_guard.MARGIN_ENV, "0")
    assert memory_guard.margin_from_env() == 0


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "1e400"])
def test_a_margin_that_is_no_size_is_one_line_and_keeps_the_saves_synchronous(monkeypatch, bad: str) -> None:
    monkeypatch.setenv(memory_guard.MARGIN_ENV, bad)
    with pytest.raises(HostMemoryError) as caught:
        check_host_memory(1)
    line = str(caught.value)
    assert "\n" not in line and memory_guard.MARGIN_ENV in line and "HINT:" in line
    assert "periodic saves stay synchronous" in line
