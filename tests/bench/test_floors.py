"""The floors of issue #34 (bench/floors.py): their arithmetic on exact numbers, which rank writes which real
DeepSpeed/Trainer file, the room check, and the raw writers and readers on real files. The floors' times are
reported by tools/bench, never asserted here."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_jit.bench import floors

GIB = 2**30
# The files of a real 2-rank ZeRO-2 JIT checkpoint of demo_train (ZeRO-3 adds per-rank model states)
ZERO2_FILES = {
    "global_step4/mp_rank_00_model_states.pt": 1_000,
    "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt": 600_000,
    "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt": 600_008,
    "rng_state_0.pth": 14_000,
    "rng_state_1.pth": 14_001,
    "scheduler.pt": 1_100,
    "trainer_state.json": 900,
    "config.json": 700,
    "latest": 12,
}


def test_the_best_of_trials_is_the_fastest() -> None:
    assert floors.best_of([0.30, 0.21, 0.25]) == 0.21
    for bad in ([], [0.2, 0.0], [-1.0]):
        with pytest.raises(ValueError, match="positive"):
            floors.best_of(bad)


def test_the_spread_is_min_median_max() -> None:
    spread = floors.spread([6.61, 0.46, 2.08, 0.50, 1.00])  # the disk trials, and one more
    assert (spread.min_s, spread.median_s, spread.max_s) == (0.46, 1.00, 6.61)
    assert spread.as_details() == {"min_s": 0.46, "median_s": 1.0, "max_s": 6.61}
    assert floors.spread([0.4, 0.2]).median_s == pytest.approx(0.3)


def test_over_floor_is_the_measured_time_in_floors() -> None:
    assert floors.over_floor(0.34, 0.21) == pytest.approx(1.619, abs=1e-3)  # the 827 MB save
    assert floors.over_floor(0.2, 0.2) == 1.0
    with pytest.raises(ValueError, match="floor of 0"):
        floors.over_floor(0.34, 0.0)


def test_above_floor_takes_the_floor_from_the_write_phase_only() -> None:
    phases = {"begin": 0.01, "write": 0.25, "callbacks": 0.0, "fsync": 0.02, "barrier": 0.01, "manifest": 0.04,
              "rotate": 0.01}
    above = floors.above_floor(phases, 0.21)
    assert above["write"] == pytest.approx(0.04) and above["manifest"] == 0.04 and above["begin"] == 0.01
    assert sum(above.values()) == pytest.approx(sum(phases.values()) - 0.21)
    assert floors.above_floor({"write": 0.1}, 0.21) == {"write": pytest.approx(-0.11)}  # faster than the floor


def test_each_file_goes_to_the_rank_that_writes_it() -> None:
    assert floors.rank_of("global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt") == 1
    assert floors.rank_of("global_step9/zero_pp_rank_3_mp_rank_00_model_states.pt") == 3  # ZeRO-3's
    assert floors.rank_of("global_step4/mp_rank_00_model_states.pt") == 0  # mp_rank is the model-parallel rank
    assert floors.rank_of("rng_state_1.pth") == 1
    assert floors.rank_of("rng_state_12.pth") == 12
    assert floors.rank_of("rng_state.pth") == 0  # a one-process run's
    assert floors.rank_of("trainer_state.json") == 0
    shares = floors.by_rank(ZERO2_FILES, 2)
    assert [sum(size for _, size in files) for files in shares] == [
        1_000 + 600_000 + 14_000 + 1_100 + 900 + 700 + 12, 600_008 + 14_001]
    assert sum(len(files) for files in shares) == len(ZERO2_FILES)


def test_a_file_of_a_rank_beyond_the_world_size_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 1, beyond a world size of 1"):
        floors.by_rank(ZERO2_FILES, 1)
    with pytest.raises(ValueError, match="at least 1"):
        floors.by_rank({}, 0)


def test_the_room_check_names_what_is_short() -> None:
    need = floors.TMPFS_COPIES * floors.state_bytes(25_000_000)  # 1.2 GB for the default model's 25 M parameters
    assert need == 3 * 16 * 25_000_000
    assert floors.room_missing(need, 24 * GIB, 20 * GIB) is None
    short_disk = floors.room_missing(need, GIB, 20 * GIB)
    assert short_disk is not None and "1.0 GiB free" in short_disk and "3 copies" in short_disk
    short_memory = floors.room_missing(need, 24 * GIB, 2 * GIB)
    assert short_memory is not None and "2.0 GiB of memory available" in short_memory
    assert floors.tmpfs_room_missing(1, Path("/nonexistent-tmpfs")) == "no writable tmpfs at /nonexistent-tmpfs"


def test_a_scratch_directory_is_removed_however_its_block_ends(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), floors.scratch(tmp_path, "x") as path:
        (path / "sub").mkdir()
        (path / "sub" / "file").write_bytes(b"x" * 10)
        raise RuntimeError("the run broke")
    assert list(tmp_path.iterdir()) == []


def test_the_writers_write_each_ranks_sizes_and_leave_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, int]] = []
    real_fsync = floors.os.fsync

    def fsync(fd: int) -> None:  # the real fsync, and what it made durable
        seen.append((Path(f"/proc/self/fd/{fd}").readlink().name, floors.os.fstat(fd).st_size))
        real_fsync(fd)

    monkeypatch.setattr(floors.os, "fsync", fsync)
    sizes = [[3 * 2**20 + 5, 17], [2 * 2**20]]
    times = floors.write_trials(tmp_path, sizes, trials=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert sorted(seen) == sorted([("rank0-file0.bin", 3 * 2**20 + 5), ("rank0-file1.bin", 17),
                                   ("rank1-file0.bin", 2 * 2**20)] * 2)
    assert list(tmp_path.iterdir()) == []


def test_the_readers_read_every_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for path, size in zip(files, (9 * 2**20 + 1, 0, 1234), strict=True):
        path.write_bytes(b"\1" * size)
    counted: list[int] = []
    real = floors._read_rank

    def counting(paths: list[Path]) -> int:  # the real reader, and what it read
        counted.append(real(paths))
        return counted[-1]

    monkeypatch.setattr(floors, "_read_rank", counting)
    times = floors.read_trials([files[:2], files[2:]], trials=3)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert sorted(counted) == [1234] * 3 + [9 * 2**20 + 1] * 3


def test_each_rank_hashes_the_files_it_wrote_for_the_manifest() -> None:
    """save_path.hashed_by: the manifest's hashing dealt as the files were written (a rank reads its own, from its
    page cache), every file hashed once; a name beyond the world size is rank 0's."""
    from slurm_jit.train.save_path import hashed_by

    rels = ["config.json", "global_step4/mp_rank_00_model_states.pt",
            "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_0.pth", "rng_state_1.pth",
            "rng_state_5.pth", "trainer_state.json"]
    shares = [hashed_by(rels, rank, 2) for rank in range(2)]
    assert shares[1] == ["global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_1.pth"]
    assert sorted(shares[0] + shares[1]) == sorted(rels)


def test_the_checksum_floor_hashes_every_rank_bytes_with_one_thread_each() -> None:
    """floors.hash_trials: as many timed trials as asked, each hashing every rank's bytes (a real xxh3-128 of them:
    a larger state takes longer)."""
    small = floors.hash_trials([[2**20], [2**20]], 3)
    large = floors.hash_trials([[64 * 2**20, 64 * 2**20], [128 * 2**20]], 3)
    assert len(small) == len(large) == 3 and all(t > 0 for t in small + large)
    assert min(large) > min(small)
